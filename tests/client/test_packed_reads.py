"""The packed batch-read path (storage.read_packed): bulk split of ranges into chunk IOs across many files
and chunk sizes, holes, short reads, per-item errors, big and small IOs mixed, callers on many threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from threefs.common.status import StatusCode, ThreeFSError

KiB = 1 << 10


@pytest.fixture
def files(fs, d, rng):
    """Files of several chunk sizes and stripes, one with a hole (a chunk never written) in the middle."""
    out = {}
    for name, chunk_size, stripe, size in (("small", 64 * KiB, 3, 700 * KiB + 13),
                                           ("wide", 256 * KiB, 4, 3 * 1024 * KiB + 5),
                                           ("one", 1024 * KiB, 1, 2 * 1024 * KiB + 999)):
        fs.mkdir(f"{d}/{name}", chunk_size=chunk_size, stripe=stripe)
        data = rng.randbytes(size)
        path = f"{d}/{name}/f"
        fs.write_bytes(path, data)
        out[path] = data
    fs.mkdir(f"{d}/sparse", chunk_size=64 * KiB, stripe=2)
    path = f"{d}/sparse/f"
    head, tail = rng.randbytes(100 * KiB), rng.randbytes(30 * KiB)
    with fs.open(path, "wb") as f:
        f.write(head)
        f.seek(400 * KiB)
        f.write(tail)
    out[path] = head + bytes(300 * KiB) + tail
    return out


def test_random_ranges_across_files_chunks_and_holes(fs, files, rng):
    paths = sorted(files)
    attrs = {p: fs.stat(p) for p in paths}
    for round_ in range(3):
        items, expect = [], []
        for _ in range(600):
            p = rng.choice(paths)
            data = files[p]
            length = rng.choice([0, 1, 63, 4096, 5000, 65536, 65537, 200 * KiB, 700 * KiB])
            off = rng.randrange(0, len(data) + 2 * KiB)  # some start at or past the end
            buf = np.full(length, 0xAB, dtype=np.uint8)  # stale bytes must be overwritten or left alone
            items.append((attrs[p] if round_ % 2 else p, off, buf))
            expect.append(data[off:off + length])
        results = fs.batch_read(items)
        for (_, off, buf), want, got in zip(items, expect, results):
            assert got == len(want), (off, len(buf))
            assert buf[:got].tobytes() == want, (off, len(buf))
            assert (buf[got:] == 0xAB).all()  # past the end of the file: untouched


def test_per_item_errors_do_not_fail_the_batch(fs, files, d):
    path = sorted(files)[0]
    data = files[path]
    items = [(path, 0, bytearray(4096)), (f"{d}/missing", 0, bytearray(10)), (d, 0, bytearray(10)),
             (path, 5000, bytearray(100))]
    results = fs.batch_read(items, raise_on_error=False)
    assert results[0] == 4096 and bytes(items[0][2]) == data[:4096]
    assert isinstance(results[1], ThreeFSError) and results[1].code == StatusCode.NOT_FOUND
    assert isinstance(results[2], ThreeFSError)
    assert results[3] == 100 and bytes(items[3][2]) == data[5000:5100]
    with pytest.raises(ThreeFSError):
        fs.batch_read(items)


def test_many_threads_read_at_once(fs, files):
    """Callers on several threads share one client; every one gets its own bytes."""
    paths = sorted(files)
    attrs = [fs.stat(p) for p in paths]
    errors = []

    def caller(seed: int) -> None:
        r = np.random.default_rng(seed)
        try:
            for _ in range(15):
                items, expect = [], []
                for _ in range(200):
                    k = int(r.integers(len(paths)))
                    data = files[paths[k]]
                    length = int(r.choice([512, 4096, 65536, 300 * KiB]))
                    off = int(r.integers(0, max(1, len(data) - length)))
                    items.append((attrs[k], off, bytearray(length)))
                    expect.append(data[off:off + length])
                got = fs.batch_read(items)
                for (_, _, buf), want, n in zip(items, expect, got):
                    assert n == len(want) and bytes(buf[:n]) == want
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]


def test_file_objects_and_read_into_share_the_path(fs, files, rng):
    """read_into (File objects, FUSE's coalescer) goes through the same packed requests."""
    for path, data in files.items():
        with fs.open(path, "rb") as f:
            for _ in range(20):
                off, n = rng.randrange(0, len(data)), rng.choice([1, 4096, 100 * KiB])
                f.seek(off)
                assert f.read(n) == data[off:off + n]
