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
    from threefs.client.fsspec import DuckDBThreeFSFileSystem

    con = duckdb.connect()
    con.register_filesystem(DuckDBThreeFSFileSystem(client=tfs.client, skip_instance_cache=True))
    pd.DataFrame({"k": range(1000), "v": [i * 2 for i in range(1000)]}).to_parquet(
        f"{d}/in.parquet", filesystem=tfs)
    assert con.execute(f"select count(*), sum(v) from read_parquet('threefs://{d}/in.parquet')").fetchone() \
        == (1000, 999_000)
    con.execute(f"copy (select k, v + 1 as w from read_parquet('threefs://{d}/in.parquet') where k < 10) "
            f"to 'threefs://{d}/out.parquet' (format parquet)")
    assert con.execute(f"select sum(w) from 'threefs://{d}/out.parquet'").fetchone() == (100,)
    con.close()


def test_duckdb_threads_scan_one_file_through_a_shared_handle(tfs, d, tmp_path):
    """DuckDB's worker threads read row groups of one file through one handle as seek() + read():
    with per-thread positions every thread reads where it seeked (a shared position mixed them up:
    wrong bytes or a read-ahead cancelled under another thread's feet)."""
    duckdb = pytest.importorskip("duckdb")
    from threefs.client.fsspec import DuckDBThreeFSFileSystem

    n = 400_000
    table = pa.table({"k": pa.array(range(n), pa.int64()),
                      "s": pa.array([f"value-{i * 7919 % n:08d}" for i in range(n)])})
    pq.write_table(table, f"{d}/many_groups.parquet", filesystem=tfs, row_group_size=10_000)
    pq.write_table(table, str(tmp_path / "local.parquet"), row_group_size=10_000)
    con = duckdb.connect(config={"threads": 4})
    con.register_filesystem(DuckDBThreeFSFileSystem(client=tfs.client, skip_instance_cache=True))
    query = "select count(*), sum(k), sum(hash(s)), min(s), max(s) from read_parquet('{}')"
    want = con.execute(query.format(tmp_path / "local.parquet")).fetchone()
    for _ in range(5):
        assert con.execute(query.format(f"threefs://{d}/many_groups.parquet")).fetchone() == want
    con.close()


def test_position_per_thread_reader(tfs, d, rng):
    import io
    import threading

    from threefs.client.fsspec import PositionPerThreadReader

    data = rng.randbytes((1 << 20) + 333)
    tfs.pipe_file(f"{d}/p.bin", data)
    f = PositionPerThreadReader(tfs.client, f"{d}/p.bin")
    assert f.size == len(data) and f.read() == data and f.read() == b""
    assert f.seek(-10, io.SEEK_END) == len(data) - 10 and f.read(100) == data[-10:]
    errors = []

    def reader(seed):
        import random
        r = random.Random(seed)
        try:
            for _ in range(60):
                off, n = r.randrange(len(data)), r.randrange(1, 70_000)
                f.seek(off)
                got = f.read(n)
                assert got == data[off:off + n], (off, n)
                assert f.tell() == off + len(got)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with pytest.raises(IsADirectoryError):
        PositionPerThreadReader(tfs.client, str(d))
