"""fsspec adapter `threefs://`, and pandas, pyarrow and DuckDB through it."""

from __future__ import annotations

import fsspec
import pytest

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture
def tfs(cluster, monkeypatch):
    monkeypatch.setenv("THREEFS_CONFIG", str(cluster.client_config_path))
    fs = fsspec.filesystem("threefs", config=str(cluster.client_config_path))
    yield fs


def test_registered_by_entry_point(tfs):
    from threefs.client.fsspec import ThreeFSFileSystem

    assert fsspec.get_filesystem_class("threefs") is ThreeFSFileSystem
    assert isinstance(tfs, ThreeFSFileSystem)
    assert tfs._strip_protocol("threefs:///a/b/") == "/a/b"
    assert tfs._strip_protocol("threefs://a/b") == "/a/b"


def test_namespace_and_ranges(tfs, d, rng):
    data = rng.randbytes(3 * (1 << 20) + 17)
    tfs.pipe_file(f"threefs://{d}/x.bin", data)
    tfs.makedirs(f"{d}/sub/deeper", exist_ok=True)
    tfs.makedirs(f"{d}/sub/deeper", exist_ok=True)
    info = tfs.info(f"threefs://{d}/x.bin")
    assert info["size"] == len(data) and info["type"] == "file" and info["name"] == f"{d}/x.bin"
    assert sorted(tfs.ls(d, detail=False)) == [f"{d}/sub", f"{d}/x.bin"]
    assert {e["type"] for e in tfs.ls(d)} == {"file", "directory"}
    assert tfs.cat_file(f"{d}/x.bin", start=(1 << 20) - 3, end=(1 << 20) + 3) == data[(1 << 20) - 3:(1 << 20) + 3]
    assert tfs.cat_file(f"{d}/x.bin", start=-5) == data[-5:]
    assert tfs.cat(f"{d}/x.bin") == data
    with tfs.open(f"{d}/x.bin", "rb") as f:
        f.seek(100)
        assert f.read(10) == data[100:110]
    tfs.mv(f"{d}/x.bin", f"{d}/sub/y.bin")
    assert not tfs.exists(f"{d}/x.bin") and tfs.size(f"{d}/sub/y.bin") == len(data)
    tfs.cp_file(f"{d}/sub/y.bin", f"{d}/copy.bin")
    assert tfs.cat(f"{d}/copy.bin") == data
    assert sorted(p for p in tfs.find(d)) == [f"{d}/copy.bin", f"{d}/sub/y.bin"]
    tfs.rm(f"{d}/sub", recursive=True)
    assert not tfs.exists(f"{d}/sub")
    with pytest.raises(FileNotFoundError):
        tfs.info(f"{d}/nope")
    with fsspec.open(f"threefs://{d}/t.txt", "w") as f:  # fsspec.open: url + text mode wrapper
        f.write("hello\n")
    with fsspec.open(f"threefs://{d}/t.txt", "r") as f:
        assert f.read() == "hello\n"


def test_pandas_parquet_and_csv(tfs, d, cluster):
    df = pd.DataFrame({"a": range(50_000), "b": [f"s{i % 13}" for i in range(50_000)]})
    opts = {"config": str(cluster.client_config_path)}
    df.to_parquet(f"threefs://{d}/df.parquet", storage_options=opts)
    assert pd.read_parquet(f"threefs://{d}/df.parquet", storage_options=opts).equals(df)
    df.to_csv(f"threefs://{d}/df.csv", index=False, storage_options=opts)
    assert pd.read_csv(f"threefs://{d}/df.csv", storage_options=opts).equals(df)


def test_pyarrow_dataset_over_fsspec(tfs, d):
    table = pa.table({"x": list(range(20_000)), "y": [float(i) / 3 for i in range(20_000)]})
    pq.write_table(table, f"{d}/t.parquet", filesystem=tfs, row_group_size=5000)
    assert pq.read_table(f"{d}/t.parquet", filesystem=tfs).equals(table)
    assert pq.ParquetFile(f"{d}/t.parquet", filesystem=tfs).metadata.num_row_groups == 4


def test_duckdb_reads_and_writes(tfs, d):
    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    con.register_filesystem(tfs)
    pd.DataFrame({"k": range(1000), "v": [i * 2 for i in range(1000)]}).to_parquet(
        f"{d}/in.parquet", filesystem=tfs)
    assert con.execute(f"select count(*), sum(v) from read_parquet('threefs://{d}/in.parquet')").fetchone() \
        == (1000, 999_000)
    con.execute(f"copy (select k, v + 1 as w from read_parquet('threefs://{d}/in.parquet') where k < 10) "
            f"to 'threefs://{d}/out.parquet' (format parquet)")
    assert con.execute(f"select sum(w) from 'threefs://{d}/out.parquet'").fetchone() == (100,)
    con.close()
