"""Every operator, on both executors (local process pool and Ray on loopback), each result compared as a
multiset with DuckDB run on the whole input. One session (and one Ray instance) per executor per module."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

import threefs.pond as pond
from threefs.pond import UnschedulableError

from pond_helpers import multiset, reference


@pytest.fixture(scope="module", params=["local", "ray"])
def sp(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"pond-root-{request.param}")
    session = pond.init(data_root=str(root), executor=request.param, num_cpus=2, progress=False)
    yield session
    session.shutdown()


def test_hash_repartition_group_by(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet").repartition(5, hash_by="k")
    assert "__data_partition__" in df.to_arrow().column_names
    out = sp.partial_sql("select k, count(*) as n, sum(v) as t from {0} group by k", df)
    got = out.take_all()
    assert multiset(got) == reference(data_dir, "select k, count(*), sum(v) from {0} group by k")
    # hash partitioning put each key in exactly one partition
    parts = [ds.to_arrow_table() for ds in out._compute()]
    keys = [set(t.column("k").to_pylist()) for t in parts]
    assert sum(len(k) for k in keys) == len(set().union(*keys)) == 50


def test_hash_by_two_columns(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet").repartition(3, hash_by=["k", "s"])
    out = sp.partial_sql("select k, s, count(*) from {0} group by k, s", df)
    assert multiset(out.take_all()) == reference(data_dir, "select k, s, count(*) from {0} group by k, s")


def test_shuffle_by_expression(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet").repartition(7, by="k % 7")
    out = df.map("min(k % 7) as lo, max(k % 7) as hi, count(*) as n")
    rows = out.take_all()
    assert [(r["lo"], r["hi"]) for r in rows] == [(i, i) for i in range(7)]
    assert sum(r["n"] for r in rows) == 4 * 1500


def test_shuffle_key_out_of_range_message(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet").repartition(7, by="k % 8")
    with pytest.raises(pond.PondError, match="partition key 7 is out of range 0-6"):
        df.count()


def test_even_partitions_by_files_and_rows(sp, data_dir):
    by_files = sp.read_parquet(f"{data_dir}/*.parquet").repartition(2)
    by_rows = sp.read_parquet(f"{data_dir}/*.parquet").repartition(5, by_rows=True)
    assert [ds.num_rows for ds in by_files._compute()] == [3000, 3000]
    assert [ds.num_rows for ds in by_rows._compute()] == [1200] * 5
    ref = reference(data_dir, "select * from {0}")
    assert multiset(by_rows.map("*").take_all()) == ref
    assert multiset(by_files.take_all()) == ref


def test_map_filter_flat_map_sql_and_python(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet").repartition(3, by_rows=True)
    assert multiset(df.map("id, v * 2 as w").take_all()) == reference(data_dir, "select id, v * 2 from {0}")
    assert multiset(df.map(lambda r: {"id": r["id"], "w": r["v"] * 2}).take_all()) == \
        reference(data_dir, "select id, v * 2 from {0}")
    assert multiset(df.filter("k < 10").take_all()) == reference(data_dir, "select * from {0} where k < 10")
    assert multiset(df.filter(lambda r: r["k"] < 10).take_all()) == \
        reference(data_dir, "select * from {0} where k < 10")
    assert multiset(df.flat_map("unnest([id, k]) as x").take_all()) == \
        reference(data_dir, "select unnest([id, k]) from {0}")
    assert multiset(df.flat_map(lambda r: [{"x": r["id"]}, {"x": r["k"]}]).take_all()) == \
        reference(data_dir, "select unnest([id, k]) from {0}")


def test_consecutive_sql_is_fused(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet").filter("k < 25").map("id, k").partial_sort("id")
    text = df.explain()
    assert text.count("SqlEngineNode") == 1, text  # three SQL nodes became one query
    assert multiset(df.take_all()) == reference(data_dir, "select id, k from {0} where k < 25")


def test_map_batches(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet")
    sizes = df.map_batches(lambda t: pa.table({"n": [t.num_rows]}), batch_size=1000).take_all()
    assert [r["n"] for r in sizes] == [1000] * 6
    doubled = df.map_batches(lambda t: t.select(["id"]).append_column("w", pa.compute.multiply(t["v"], 2)))
    assert multiset(doubled.take_all()) == reference(data_dir, "select id, v * 2 from {0}")


def test_partial_sort(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet").repartition(4, by_rows=True).partial_sort(["k", "id desc"])
    for ds in df._compute():
        rows = [(r["k"], -r["id"]) for r in ds.to_arrow_table().to_pylist()]
        assert rows == sorted(rows)
    assert multiset(df.take_all()) == reference(data_dir, "select * from {0}")


def test_range_partition_gives_a_global_sort(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet").repartition(6, range_by="v").partial_sort("v")
    values = [r["v"] for r in df.take_all()]
    assert values == sorted(values) and len(values) == 6000
    sizes = [ds.num_rows for ds in df._compute()]
    assert len(sizes) == 6 and min(sizes) > 300, sizes  # sampled split points balance the partitions
    assert sp.read_parquet(f"{data_dir}/*.parquet").sort("id", npartitions=3).take(5) == \
        sp.read_parquet(f"{data_dir}/*.parquet").partial_sort("id").take(5)


def test_co_partitioned_join_with_split_points(sp, data_dir):
    left = sp.read_parquet(f"{data_dir}/*.parquet").repartition(4, range_by="k", split_points=[10, 25, 40])
    right = sp.from_arrow(pa.table({"k2": list(range(50)), "name": [f"n{i}" for i in range(50)]})) \
        .repartition(4, range_by="k2", split_points=[10, 25, 40])
    joined = sp.partial_sql("select id, name from {0} join {1} on k = k2", left, right)
    assert multiset(joined.take_all()) == reference(data_dir, "select id, 'n' || k from {0}")


def test_random_shuffle_limit_take_count(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet").repartition(3, by_rows=True)
    shuffled = df.random_shuffle()
    rows = shuffled.take_all()
    assert multiset(rows) == reference(data_dir, "select * from {0}")
    assert [r["id"] for r in rows] != sorted(r["id"] for r in rows)
    assert df.limit(17).count() == 17
    assert len(df.take(9)) == 9
    assert sp.read_parquet(f"{data_dir}/*.parquet").count() == 6000


def test_write_parquet_links_and_manifest_and_no_recompute(sp, data_dir, tmp_path):
    df = sp.partial_sql("select k, count(*) as n from {0} group by k",
                        sp.read_parquet(f"{data_dir}/*.parquet").repartition(3, hash_by="k"))
    out = tmp_path / "out"
    df.write_parquet(str(out))
    files = sorted(p for p in os.listdir(out) if p.endswith(".parquet"))
    manifest = (out / ".MANIFEST.txt").read_text().split()
    assert sorted(os.path.basename(p) for p in manifest) == files and files
    assert all(os.stat(out / f).st_nlink >= 2 for f in files)  # hard links to the task outputs
    executed = sp._scheduler.stats.executed
    assert multiset(df.to_pandas().itertuples(index=False)) == reference(data_dir, "select k, count(*) from {0} group by k")
    assert sp._scheduler.stats.executed == executed  # to_pandas() read the result; nothing ran again
    df.recompute().compute()
    assert sp._scheduler.stats.executed > executed  # recompute() does run its own tasks again


def test_csv_json_columns_union_by_name(sp, data_dir):
    schema = {"id": "bigint", "k": "bigint", "s": "varchar", "v": "double"}
    csv = sp.read_csv(f"{data_dir}/*.csv", schema=schema)
    assert multiset(csv.take_all()) == reference(data_dir, "select id, k, s, v from {0}")
    js = sp.read_json(f"{data_dir}/*.json", schema=schema)
    assert multiset(js.map("id, k, s, v").take_all()) == reference(data_dir, "select id, k, s, v from {0}")
    cols = sp.read_parquet([f"{data_dir}/part-0.parquet", f"{data_dir}/part-1.parquet"], columns=["id", "s"])
    t = cols.to_arrow()
    assert t.column_names == ["id", "s"] and t.schema.field("s").type == pa.large_string()
    assert sp.read_parquet(data_dir, union_by_name=True).count() == 6000


def test_request_that_can_never_run_fails_at_once(sp, data_dir):
    df = sp.read_parquet(f"{data_dir}/*.parquet").map("id", cpu_limit=4096)
    with pytest.raises(UnschedulableError, match="asks for 4096 CPUs, but the largest"):
        df.count()
    big = sp.read_parquet(f"{data_dir}/*.parquet").map("id", memory_limit=1 << 60)
    with pytest.raises(UnschedulableError, match="GiB of memory, but the largest"):
        big.count()


def test_each_task_gets_its_thread_and_memory_limits(sp):
    df = sp.partial_sql("select current_setting('threads') as t, current_setting('memory_limit') as m",
                        cpu_limit=2, memory_limit=1 << 30)
    row = df.take_all()[0]
    assert row["t"] == 2
    assert row["m"].replace(" ", "") in ("921.0MiB", "921MiB"), row  # 0.9 × 1 GiB


def test_sql_error_names_the_query(sp):
    with pytest.raises(pond.PondError, match="select a,, from"):
        sp.partial_sql("select a,, from {0}", sp.from_items([1, 2])).count()
