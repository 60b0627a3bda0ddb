"""File objects: read-ahead, write-behind, seek/tell/truncate, close semantics, and the libraries that
use file objects (shutil, numpy, pyarrow, pandas, io text)."""

from __future__ import annotations

import io
import shutil

import numpy as np
import pytest

from threefs.client.file import File, RawFile
from threefs.common.status import StatusCode, ThreeFSError

CS = 1 << 20


def test_small_writes_fill_chunks_and_length_is_exact_after_close(fs, d, rng):
    data = rng.randbytes(3 * CS + 777)
    with fs.open(f"{d}/f", "wb") as f:
        assert isinstance(f, File)
        pos = 0
        while pos < len(data):
            n = rng.randrange(1, 70_000)
            piece = bytearray(data[pos:pos + n])  # mutable: must be copied, not kept
            assert f.write(piece) == len(piece)
            piece[:] = bytes(len(piece))  # the caller reuses its buffer at once
            pos += n
        assert f.tell() == len(data)
    assert fs.stat(f"{d}/f").length == len(data)
    assert fs.read_bytes(f"{d}/f") == data


def test_large_bytes_writes_and_unaligned_starts(fs, d, rng):
    data = rng.randbytes(5 * CS + 3)
    with fs.open(f"{d}/f", "wb") as f:
        f.write(data[:100])  # unaligned: the rest is buffered to the next segment boundary
        f.write(data[100:])  # bytes, mostly whole segments
    assert fs.read_bytes(f"{d}/f") == data


def test_seek_rewrite_in_flight_keeps_write_order(fs, d, rng):
    """Overlapping writes are ordered although earlier ones may still be in flight."""
    model = bytearray()
    with fs.open(f"{d}/f", "w+b", write_behind_bytes=8 * CS) as f:
        for _ in range(80):
            off = rng.randrange(0, 2 * CS)
            piece = rng.randbytes(rng.randrange(1, 300_000))
            f.seek(off)
            f.write(piece)
            end = off + len(piece)
            model.extend(bytes(max(0, end - len(model))))
            model[off:end] = piece
        f.seek(0)
        assert f.read() == bytes(model)
    assert fs.stat(f"{d}/f").length == len(model)
    assert fs.read_bytes(f"{d}/f") == bytes(model)


def test_read_ahead_sequential_small_reads_and_jumps(fs, d, rng):
    data = rng.randbytes(6 * CS + 12345)
    fs.write_bytes(f"{d}/f", data)
    with fs.open(f"{d}/f", "rb", read_ahead_bytes=4 * CS) as f:
        got = bytearray()
        while piece := f.read(rng.randrange(1, 300_000)):
            got += piece
        assert got == data
        for _ in range(40):  # jumps: read straight, then sequential again
            off = rng.randrange(0, len(data) + 10)
            f.seek(off)
            a = f.read(rng.randrange(0, 50_000))
            b = f.read(rng.randrange(0, 2 * CS))
            assert a + b == data[off:off + len(a) + len(b)]
        f.seek(-10, io.SEEK_END)
        assert f.read() == data[-10:]
        assert f.read(5) == b""


def test_jumps_are_read_from_the_callers_thread_and_a_stream_from_there_prefetches(fs, d, rng):
    """A read that does not continue the last one (random access) is read from the caller's thread, no trip
    to the loop; reading on from where it ended starts a prefetching stream as before. A read after our own
    buffered writes still goes through the engine (it flushes them first)."""
    data = rng.randbytes(6 * CS)
    fs.write_bytes(f"{d}/f", data)
    with fs.open(f"{d}/f", "rb", read_ahead_bytes=4 * CS) as f:
        for _ in range(20):
            off = rng.randrange(1, len(data))
            f.seek(off)
            assert f.read(5000) == data[off:off + 5000]
        assert not f._hopped  # every read so far came from this thread
        f.seek(CS + 7)
        assert f.read(100) == data[CS + 7:CS + 107]  # a jump
        got = b"".join(f.read(64 * 1024) for _ in range(8))  # then on from there
        assert got == data[CS + 107:CS + 107 + 8 * 64 * 1024]
        assert f._hopped and (f._held or f._reader.active)  # a stream, prefetching
    with fs.open(f"{d}/g", "w+b") as f:
        f.write(b"x" * 1000)
        f.seek(10)
        assert f.read(20) == b"x" * 20  # the buffered write is flushed first, then read
    with fs.open(f"{d}/f", "rb", buffering=0) as f:  # unbuffered: every read from this thread
        f.seek(3 * CS - 10)
        assert f.read(30) == data[3 * CS - 10:3 * CS + 20]


def test_readinto_large_goes_straight_to_caller_memory(fs, d, rng):
    data = rng.randbytes(4 * CS)
    fs.write_bytes(f"{d}/f", data)
    arr = np.zeros(len(data), dtype=np.uint8)
    with fs.open(f"{d}/f", "rb") as f:
        assert f.readinto(arr) == len(data)
    assert arr.tobytes() == data


def test_append_truncate_and_read_own_writes(fs, d):
    with fs.open(f"{d}/f", "wb") as f:
        f.write(b"hello")
    with fs.open(f"{d}/f", "ab") as f:
        f.write(b" world")
        assert f.tell() == 11
    assert fs.read_bytes(f"{d}/f") == b"hello world"
    with fs.open(f"{d}/f", "r+b") as f:
        f.seek(0, io.SEEK_END)
        f.write(b"!!")
        f.seek(0)
        assert f.read() == b"hello world!!"  # buffered writes are flushed before reads
        assert f.truncate(5) == 5
        f.seek(0)
        assert f.read() == b"hello"
    assert fs.stat(f"{d}/f").length == 5  # close must not bring the truncated bytes back
    assert fs.read_bytes(f"{d}/f") == b"hello"


def test_raw_file_is_unbuffered(fs, d):
    with fs.open(f"{d}/f", "wb", buffering=0) as f:
        assert isinstance(f, RawFile)
        f.write(b"abc")
        f.fsync()
        assert fs.stat(f"{d}/f").length == 3  # fsync published the length before close


def test_fsync_publishes_length_before_close(fs, d):
    with fs.open(f"{d}/f", "wb") as f:
        f.write(b"x" * 1000)
        f.fsync()
        assert fs.stat(f"{d}/f").length == 1000
        assert fs.read_bytes(f"{d}/f") == b"x" * 1000


def test_background_write_error_surfaces_at_flush_and_close(fs, d):
    """A write past the largest chunk index the layout addresses fails in the background; the caller
    sees it at flush(), and close publishes only what storage acknowledged."""
    f = fs.open(f"{d}/f", "wb")
    f.write(b"ok" * 10)
    f.flush()
    f.seek(CS * (1 << 32))  # chunk index 2**32: not addressable
    f.write(b"lost")  # buffered: returns at once
    with pytest.raises(ThreeFSError) as e:
        f.flush()
    assert e.value.code == StatusCode.FILE_TOO_LARGE
    f.close()
    assert fs.stat(f"{d}/f").length == 20


def test_closed_file_and_wrong_mode_errors(fs, d):
    with fs.open(f"{d}/f", "wb") as f:
        with pytest.raises(io.UnsupportedOperation):
            f.read(1)
    with pytest.raises(ValueError):
        f.write(b"x")
    with fs.open(f"{d}/f", "rb") as f:
        with pytest.raises(io.UnsupportedOperation):
            f.write(b"x")
        with pytest.raises(OSError):
            f.seek(-1)
    with pytest.raises(IsADirectoryError):
        fs.open(d, "rb")
    with pytest.raises(ThreeFSError):
        fs.open(f"{d}/f", "rw")


def test_shutil_copyfileobj_both_ways(fs, d, rng, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(rng.randbytes(3 * CS + 5))
    with open(src, "rb") as a, fs.open(f"{d}/f", "wb") as b:
        shutil.copyfileobj(a, b, 1 << 20)
    with fs.open(f"{d}/f", "rb") as a, open(tmp_path / "back.bin", "wb") as b:
        shutil.copyfileobj(a, b)
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()


def test_text_mode_lines(fs, d):
    lines = [f"line {i} {'x' * (i % 50)}\n" for i in range(5000)]
    with fs.open(f"{d}/t.txt", "w") as f:
        f.writelines(lines)
    with fs.open(f"{d}/t.txt", "r") as f:
        assert f.readlines() == lines
    with fs.open(f"{d}/t.txt", "rb") as f:
        assert f.readline() == lines[0].encode()
        assert sum(1 for _ in f) == len(lines) - 1


def test_numpy_save_load(fs, d, rng):
    arr = np.arange(300_000, dtype=np.float64).reshape(600, 500)
    with fs.open(f"{d}/a.npy", "wb") as f:
        np.save(f, arr)
    with fs.open(f"{d}/a.npy", "rb") as f:
        assert np.array_equal(np.load(f), arr)


def test_pyarrow_parquet_and_pandas_csv_through_file_objects(fs, d):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pd = pytest.importorskip("pandas")
    table = pa.table({"k": list(range(100_000)), "v": [f"v{i % 97}" for i in range(100_000)]})
    with fs.open(f"{d}/t.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=10_000)
    with fs.open(f"{d}/t.parquet", "rb") as f:
        assert pq.read_table(f).equals(table)
    with fs.open(f"{d}/t.parquet", "rb") as f:  # column projection: random reads of the footer etc.
        assert pq.read_table(f, columns=["v"]).column("v").equals(table.column("v"))
    df = table.to_pandas()
    with fs.open(f"{d}/t.csv", "w") as f:
        df.to_csv(f, index=False)
    with fs.open(f"{d}/t.csv", "rb") as f:
        assert pd.read_csv(f).equals(df)


def test_one_file_object_read_by_many_threads(fs, d):
    """Calls on one File run one at a time (as with io's buffered files): threads sharing it read every
    block exactly once, whole, and nothing they wait on is cancelled by another thread."""
    import struct
    import threading

    block, count = 4096, 2048
    data = b"".join(struct.pack("<Q", i) * (block // 8) for i in range(count))
    with fs.open(f"{d}/shared.bin", "wb") as f:
        f.write(data)
    seen, errors = [], []
    with fs.open(f"{d}/shared.bin", "rb") as f:
        def reader():
            try:
                while piece := f.read(block):
                    seen.append(piece)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=reader) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert all(len(p) == block and p == p[:8] * (block // 8) for p in seen)
    assert sorted(struct.unpack_from("<Q", p)[0] for p in seen) == list(range(count))
