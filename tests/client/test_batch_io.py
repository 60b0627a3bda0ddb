"""Batch IO: many small IOs, ranges across chunk boundaries, numpy buffers, per-item status, writes."""

from __future__ import annotations

import numpy as np
import pytest

from threefs.common.status import StatusCode, ThreeFSError

CS = 1 << 20


@pytest.fixture
def blob(fs, d, rng):
    data = rng.randbytes(8 * CS + 4321)
    fs.write_bytes(f"{d}/blob", data)
    return f"{d}/blob", data


def test_ten_thousand_small_reads(fs, blob, rng):
    path, data = blob
    attr = fs.stat(path)
    n, size = 10_000, 4096
    arena = np.zeros(n * size, dtype=np.uint8)  # one numpy arena, a slice per IO
    offsets = [rng.randrange(0, len(data) - size) for _ in range(n)]
    items = [(attr, off, arena[i * size:(i + 1) * size]) for i, off in enumerate(offsets)]
    assert fs.batch_read(items) == [size] * n
    view = arena.tobytes()
    for i, off in enumerate(offsets):
        assert view[i * size:(i + 1) * size] == data[off:off + size], i


def test_ranges_crossing_chunk_boundaries_and_eof(fs, blob, rng):
    path, data = blob
    items, expect = [], []
    for k in range(1, 8):
        for delta, length in ((-1, 2), (-4096, 8192), (-100, CS + 200), (-(CS // 2), 3 * CS)):
            off = k * CS + delta
            items.append((path, off, bytearray(length)))
            expect.append(data[off:off + length])
    items.append((path, len(data) - 10, bytearray(100)))  # short at the end of the file
    expect.append(data[-10:])
    items.append((path, len(data) + 5, bytearray(10)))  # past the end: nothing
    expect.append(b"")
    results = fs.batch_read(items)
    for (_, _, buf), want, got in zip(items, expect, results):
        assert got == len(want)
        assert bytes(buf[:got]) == want


def test_four_tuples_and_file_objects(fs, blob):
    path, data = blob
    buf = bytearray(100)
    with fs.open(path, "rb") as f:
        assert fs.batch_read([(path, 10, 50, buf), (f, CS - 5, 10, memoryview(buf)[60:])]) == [50, 10]
    assert bytes(buf[:50]) == data[10:60] and bytes(buf[60:70]) == data[CS - 5:CS + 5]


def test_per_item_status(fs, d, blob):
    path, data = blob
    good = bytearray(10)
    results = fs.batch_read([(path, 0, good), (f"{d}/missing", 0, bytearray(10)), (d, 0, bytearray(10))],
                            raise_on_error=False)
    assert results[0] == 10 and bytes(good) == data[:10]
    assert isinstance(results[1], FileNotFoundError)
    assert isinstance(results[2], ThreeFSError) and results[2].code == StatusCode.IS_DIRECTORY
    with pytest.raises(FileNotFoundError):
        fs.batch_read([(f"{d}/missing", 0, bytearray(1))])


def test_bad_items_are_rejected(fs, blob):
    path, _ = blob
    with pytest.raises(ThreeFSError) as e:
        fs.batch_read([(path, 0, b"read-only bytes")])
    assert e.value.code == StatusCode.INVALID_ARGUMENT
    with pytest.raises(ThreeFSError):
        fs.batch_read([(path, -1, bytearray(1))])
    with pytest.raises(ThreeFSError):
        fs.batch_read([(path, 0, 5, bytearray(1))])  # length larger than the buffer


def test_batch_write_ten_thousand_small_items(fs, d, rng):
    files = [f"{d}/w{i}" for i in range(4)]
    n, size = 10_000, 512
    payload = np.frombuffer(rng.randbytes(n * size), dtype=np.uint8)
    # a shuffled, non-overlapping layout: item i goes to file i % 4 at slot i // 4
    order = list(range(n))
    rng.shuffle(order)
    items = [(files[i % 4], (i // 4) * size, payload[i * size:(i + 1) * size]) for i in order]
    assert fs.batch_write(items, create=True) == [size] * n
    for k, path in enumerate(files):
        got = fs.read_bytes(path)
        want = b"".join(payload[i * size:(i + 1) * size].tobytes() for i in range(k, n, 4))
        assert len(got) == len(want) and got == want


def test_batch_write_across_chunks_and_into_open_file(fs, d, rng):
    a = rng.randbytes(3 * CS)
    b = rng.randbytes(1000)
    assert fs.batch_write([(f"{d}/x", CS // 2, a), (f"{d}/x", 0, b)], create=True) == [len(a), len(b)]
    data = fs.read_bytes(f"{d}/x")
    assert len(data) == CS // 2 + len(a) and data[:1000] == b and data[CS // 2:] == a
    with fs.open(f"{d}/y", "wb") as f:
        f.write(b"head")  # buffered; the batch flushes it first
        fs.batch_write([(f, 4, b"tail")])
        assert f.seek(0, 2) == 8
    assert fs.read_bytes(f"{d}/y") == b"headtail"


def test_batch_write_rejects_overlap_and_reports_items(fs, d):
    with pytest.raises(ThreeFSError) as e:
        fs.batch_write([(f"{d}/o", 0, b"abcd"), (f"{d}/o", 2, b"xy")], create=True)
    assert e.value.code == StatusCode.INVALID_ARGUMENT and "overlap" in e.value.message
    results = fs.batch_write([(f"{d}/o", 0, b"ok"), (f"{d}/nope/x", 0, b"no")], raise_on_error=False)
    assert results[0] == 2 and isinstance(results[1], FileNotFoundError)
    assert fs.read_bytes(f"{d}/o") == b"ok"


def test_batch_write_with_gaps_keeps_the_bytes_between(fs, d, rng):
    base = rng.randbytes(4 * CS)
    fs.write_bytes(f"{d}/g", base)
    model = bytearray(base)
    items = []
    for k in range(200):  # every 20 KiB a 1 KiB piece: never adjacent, many per chunk
        off = k * 20_480 + rng.randrange(0, 1000)
        piece = rng.randbytes(1024)
        items.append((f"{d}/g", off, piece))
        model[off:off + 1024] = piece
    rng.shuffle(items)
    assert fs.batch_write(items) == [1024] * 200
    assert fs.read_bytes(f"{d}/g") == bytes(model)
