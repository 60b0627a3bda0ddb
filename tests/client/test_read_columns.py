"""Client.read_columns: batch reads given as arrays into one destination buffer (what the FFRecord reader
uses). Same bytes and results as batch_read (chunk boundaries, holes, the end of the file, several files),
bad columns refused with a clear error, and a dead service's IOs read from another replica."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from threefs.client.client import Client
from threefs.common.status import StatusCode, ThreeFSError

KiB = 1 << 10


def _files(fs, d, rng):
    """Two files of 64 KiB chunks over 3 chains: one with a hole, one short."""
    fs.mkdir(f"{d}/dir", chunk_size=64 * KiB, stripe=3)
    head, tail = rng.randbytes(200 * KiB), rng.randbytes(50 * KiB)
    with fs.open(f"{d}/dir/a", "wb") as f:
        f.write(head)
        f.seek(500 * KiB)
        f.write(tail)
    b = rng.randbytes(70 * KiB + 3)
    fs.write_bytes(f"{d}/dir/b", b)
    return [fs.stat(f"{d}/dir/a"), fs.stat(f"{d}/dir/b")], [head + bytes(300 * KiB) + tail, b]


def _columns(rng, datas, n):
    file_of, offsets, lengths = [], [], []
    for _ in range(n):
        f = rng.randrange(len(datas))
        file_of.append(f)
        offsets.append(rng.randrange(0, len(datas[f]) + 4 * KiB))  # a few start at or past the end
        lengths.append(rng.choice([0, 1, 100, 4096, 5000, 64 * KiB - 1, 64 * KiB + 1, 100 * KiB]))
    dest_offsets = np.cumsum([0] + lengths[:-1]) + 7  # not aligned
    return [np.array(c, dtype=np.int64) for c in (file_of, offsets, lengths)] + [dest_offsets]


def _check(fs, attrs, datas, rng, batches: int, n: int = 64) -> None:
    for _ in range(batches):
        file_of, offsets, lengths, dest_offsets = _columns(rng, datas, n)
        dest = np.full(int(dest_offsets[-1] + lengths[-1]) + 9, 0xAB, dtype=np.uint8)
        results = fs.read_columns(attrs, file_of, offsets, lengths, dest, dest_offsets)
        items = [(attrs[f], o, bytearray(ln)) for f, o, ln in zip(file_of.tolist(), offsets.tolist(),
                                                                  lengths.tolist())]
        assert results == fs.batch_read(items)  # the same results as batch_read
        covered = np.zeros(len(dest), dtype=bool)
        for f, o, ln, p, got in zip(file_of.tolist(), offsets.tolist(), lengths.tolist(), dest_offsets.tolist(),
                                    results):
            want = datas[f][o:o + ln]
            assert got == len(want), (f, o, ln)
            assert dest[p:p + got].tobytes() == want, (f, o, ln)
            covered[p:p + got] = True
        assert (dest[~covered] == 0xAB).all()  # nothing written outside what was read


def test_columns_read_the_same_bytes_as_batch_read(fs, d, rng):
    attrs, datas = _files(fs, d, rng)
    sync = fs._storage_sync
    before = sync.batches
    _check(fs, attrs, datas, rng, batches=12)
    assert sync.batches > before  # small batches took the caller-thread path
    assert fs.read_columns(attrs, [], [], [], bytearray(0), []) == []


def test_bad_columns_get_clear_errors(fs, d, rng):
    attrs, datas = _files(fs, d, rng)
    dest = bytearray(100)
    cases = [
        (([0, 1], [0], [10], [0]), "flat integer arrays of one length"),
        (([0.5], [0], [10], [0]), "flat integer arrays"),
        (([2], [0], [10], [0]), r"file_of outside \[0, 2\)"),
        (([0], [-1], [10], [0]), "negative offset or length"),
        (([0], [0], [-10], [0]), "negative offset or length"),
        (([0], [0], [10], [95]), "ends past the destination's 100 bytes"),
    ]
    for cols, message in cases:
        with pytest.raises(ThreeFSError, match=message) as e:
            fs.read_columns(attrs, *cols[:3], dest, cols[3])
        assert e.value.code == StatusCode.INVALID_ARGUMENT
    with pytest.raises(ThreeFSError, match="read-only"):
        fs.read_columns(attrs, [0], [0], [10], bytes(100), [0])
    with pytest.raises(ThreeFSError, match="not a regular file") as e:
        fs.read_columns([fs.stat(f"{d}/dir")], [0], [0], [10], dest, [0])
    assert e.value.code == StatusCode.IS_DIRECTORY


def test_dead_service_ios_are_read_from_another_replica(private_cluster, rng):
    cluster = private_cluster(3, 3)
    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.mkdir("/d")
        attrs, datas = _files(fs, "/d", rng)
        sync = fs._storage_sync
        sync.sticky = False  # batches take turns over the services, so some go to the dead one
        _check(fs, attrs, datas, rng, batches=3)  # connections to every service are pooled now
        handed = sync.handed_over
        mgmtds = [pid for name, pid in cluster.running().items() if name.startswith("mgmtd")]
        for pid in mgmtds:  # routing keeps listing the dead service's targets as SERVING
            os.kill(pid, signal.SIGSTOP)
        try:
            cluster.kill("storage-2")
            _check(fs, attrs, datas, rng, batches=6)
        finally:
            for pid in mgmtds:
                os.kill(pid, signal.SIGCONT)
        assert sync.handed_over > handed


def test_small_reads_of_one_file(fs, d, rng):
    """Reads of one file that each lie in one chunk (FFRecord samples) are cut into IOs by a shorter path:
    the same IO records as the general one, and the file's bytes."""
    attrs, datas = _files(fs, d, rng)
    attr, data = attrs[0], datas[0]
    routing = fs.run(fs.aio.mgmtd.get())
    for trial in range(20):
        n = rng.randrange(1, 100)
        offsets = np.array([rng.randrange(len(data) - 2 * KiB) for _ in range(n)], dtype=np.int64)
        lengths = np.array([rng.randrange(1, 2 * KiB) for _ in range(n)], dtype=np.int64)
        lengths = np.minimum(lengths, 64 * KiB - offsets % (64 * KiB))  # each inside its chunk
        zeros = np.zeros(n, dtype=np.int64)
        fast = fs.aio._chunk_ios(routing, [attr], zeros, offsets, lengths)
        general = fs.aio._chunk_ios(routing, [attr, attr], zeros, offsets, lengths)  # two files: the general path
        assert fast[0].tobytes() == general[0].tobytes(), trial
        assert fast[1].tolist() == general[1].tolist() and fast[2].tolist() == general[2].tolist()
        dest_offsets = np.cumsum(lengths) - lengths
        dest = bytearray(int(lengths.sum()))
        got = fs.read_columns([attr], zeros, offsets, lengths, dest, dest_offsets)
        assert got == lengths.tolist()
        assert bytes(dest) == b"".join(data[o:o + ln] for o, ln in zip(offsets.tolist(), lengths.tolist()))


def test_fixed_size_records_are_received_in_place(cluster, fs, d, rng):
    """Reads whose lengths are multiples of 64 B, back to back in one buffer (fixed-size samples), are
    received from the socket straight into it (no scratch buffer, no copy), holes included; other layouts
    are copied out of the connection's buffer as before. Same bytes either way."""
    attrs, datas = _files(fs, d, rng)
    attr, data = attrs[0], datas[0]  # 200 KiB, a hole to 500 KiB, 50 KiB
    with Client.connect(str(cluster.client_config_path)) as c:  # a client of its own: fresh connections

        def scratch_bytes() -> int:
            return sum(len(conn._scratch) for conns in c._storage_sync._pool._idle.values() for conn in conns)

        for size, gap in [(1 * KiB, 0), (4 * KiB, 0), (64 * KiB, 0), (1 * KiB, 7)]:
            for _ in range(6):
                n = min(64, (4 << 20) // size)
                # (inside the file: a read cut short by its end would shift the ones after it)
                offsets = np.array([rng.randrange(0, len(data) - size) // 64 * 64 for _ in range(n)], dtype=np.int64)
                # 64 KiB chunks: one IO each, multiples of 64 B
                lengths = np.minimum(np.full(n, size, dtype=np.int64), 64 * KiB - offsets % (64 * KiB))
                dest_offsets = np.cumsum(lengths + gap) - lengths - gap
                dest = np.full(int(dest_offsets[-1] + lengths[-1]), 0xAB, dtype=np.uint8)
                got = c.read_columns([attr], np.zeros(n, dtype=np.int64), offsets, lengths, dest, dest_offsets)
                for o, ln, p, g in zip(offsets.tolist(), lengths.tolist(), dest_offsets.tolist(), got):
                    want = data[o:o + ln]
                    assert g == len(want) and dest[p:p + g].tobytes() == want, (size, o, ln)
            if gap:  # not laid out as the payload: received into the connection's buffer
                assert scratch_bytes() > 0
            else:
                assert scratch_bytes() == 0, size
