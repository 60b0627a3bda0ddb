"""Small batch reads from the caller's thread (client/storage_sync.py): same bytes as the event loop's path
(chunk boundaries, holes, the end of the file), many threads at once, and IOs of a dead storage service
handed to the loop's path, which reads them from another replica."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np

from threefs.client.client import Client

KiB = 1 << 10


def _sparse_file(fs, d, rng):
    """64 KiB chunks over 3 chains; 200 KiB of data, a 300 KiB hole, 50 KiB of data."""
    fs.mkdir(f"{d}/dir", chunk_size=64 * KiB, stripe=3)
    path = f"{d}/dir/f"
    head, tail = rng.randbytes(200 * KiB), rng.randbytes(50 * KiB)
    with fs.open(path, "wb") as f:
        f.write(head)
        f.seek(500 * KiB)
        f.write(tail)
    return path, head + bytes(300 * KiB) + tail


def _check_batches(fs, attr, data, rng, batches: int, n: int = 64) -> None:
    for _ in range(batches):
        items, want = [], []
        for _ in range(n):
            length = rng.choice([0, 1, 100, 4096, 5000, 64 * KiB - 1, 100 * KiB])
            off = rng.randrange(0, len(data) + 4 * KiB)  # a few start at or past the end
            buf = np.full(length, 0xAB, dtype=np.uint8)
            items.append((attr, off, buf))
            want.append(data[off:off + length])
        for (_, off, buf), w, got in zip(items, want, fs.batch_read(items)):
            assert got == len(w), (off, len(buf))
            assert buf[:got].tobytes() == w, (off, len(buf))
            assert (buf[got:] == 0xAB).all()  # past the end: untouched


def test_small_batches_read_from_the_callers_thread(fs, d, rng):
    path, data = _sparse_file(fs, d, rng)
    attr = fs.stat(path)
    sync = fs._storage_sync
    before, handed = sync.batches, sync.handed_over
    _check_batches(fs, attr, data, rng, batches=20)
    assert sync.batches - before == 20  # every batch took this path ...
    assert sync.handed_over == handed  # ... and needed nothing of the loop's
    # a batch with a big IO (one 300 KiB piece of a 1 MiB chunk) takes the loop's path: it is received
    # straight into the caller's buffer there
    fs.mkdir(f"{d}/big", chunk_size=1024 * KiB)
    big = rng.randbytes(400 * KiB)
    fs.write_bytes(f"{d}/big/f", big)
    buf = bytearray(300 * KiB)
    assert fs.batch_read([(f"{d}/big/f", 50, buf)]) == [300 * KiB]
    assert bytes(buf) == big[50:50 + 300 * KiB]
    assert sync.batches - before == 20


def test_threads_read_at_once(fs, d, rng):
    path, data = _sparse_file(fs, d, rng)
    attr = fs.stat(path)
    seeds = [rng.randrange(1 << 30) for _ in range(6)]
    errors = []

    def reader(seed):
        import random

        try:
            _check_batches(fs, attr, data, random.Random(seed), batches=15)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]


def test_dead_service_ios_fail_over_on_the_loop_path(private_cluster, rng):
    cluster = private_cluster(3, 3)
    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.mkdir("/d")
        path, data = _sparse_file(fs, "/d", rng)
        attr = fs.stat(path)
        _check_batches(fs, attr, data, rng, batches=3)  # connections to every service are pooled now
        sync = fs._storage_sync
        handed = sync.handed_over
        mgmtds = [pid for name, pid in cluster.running().items() if name.startswith("mgmtd")]
        # mgmtd frozen: the client's routing keeps listing the dead service's targets as SERVING, so
        # this path keeps choosing them and must hand their IOs over
        for pid in mgmtds:
            os.kill(pid, signal.SIGSTOP)
        try:
            cluster.kill("storage-2")
            _check_batches(fs, attr, data, rng, batches=6)
        finally:
            for pid in mgmtds:
                os.kill(pid, signal.SIGCONT)
        # a 64-IO batch goes to one service, the next batch to the next: some went to the dead one
        assert sync.handed_over > handed
