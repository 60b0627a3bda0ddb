"""Helpers of the pond tests: DuckDB over the whole input as the reference, results as multisets."""

from __future__ import annotations

import duckdb


def reference(data_dir: str, sql: str) -> list:
    """`sql` over all input rows ({0} = the whole input) in one DuckDB, as a sorted multiset."""
    con = duckdb.connect()
    src = f"read_parquet('{data_dir}/*.parquet')"
    return multiset(con.execute(sql.format(src)).fetchall())


def multiset(rows) -> list:
    out = []
    for r in rows:
        if isinstance(r, dict):
            r = tuple(r.values())
        out.append(tuple(round(x, 9) if isinstance(x, float) else x for x in r))
    return sorted(out, key=repr)
