"""Fixtures of the pond tests: seeded input files (helpers in pond_helpers.py)."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

NFILES = 4
ROWS_PER_FILE = 1500


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """4 Parquet files (k: 0..49, s: varchar, v: double, id: unique), the same rows as CSV and JSON."""
    d = tmp_path_factory.mktemp("pond-data")
    rng = random.Random(22)
    rid = 0
    for f in range(NFILES):
        rows = []
        for _ in range(ROWS_PER_FILE):
            rows.append({"id": rid, "k": rng.randrange(50), "s": f"s{rng.randrange(1000)}", "v": rng.random() * 100})
            rid += 1
        pq.write_table(pa.Table.from_pylist(rows), d / f"part-{f}.parquet", row_group_size=500)
        with open(d / f"part-{f}.csv", "w") as out:
            for r in rows:
                out.write(f"{r['id']},{r['k']},{r['s']},{r['v']!r}\n")
        with open(d / f"part-{f}.json", "w") as out:
            for r in rows:
                out.write(json.dumps(r) + "\n")
    return str(d)
