"""Zero-copy whole-chunk reads (storage.read_packed with zero_copy: the server sends a whole committed chunk
with os.sendfile from its data file, unchecked; the client checks it on arrival against the chunk's
write-time crc32c) and the batched read path of storage (one pass over a packed batch).

What they prove: the bytes are the same as without zero copy (whole chunks, a short last chunk, holes, the
slot tails of short reads); a chunk damaged on disk is sent unchecked by the server, caught by the client on
arrival whether check_arrival is on or off (it reads another replica), never returned, and the damaged
copies are repaired (the client reports them; the server checks its copy and repairs it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from threefs.client.client import Client
from threefs.common.ids import chunk_id
from threefs.testing.checks import replica_differences, wait_for
from threefs.testing.chunk_files import chunk_replicas, flip_bit

KiB, MiB = 1 << 10, 1 << 20
CS = MiB


def _whole_chunks(fs, path: str, size: int, check_arrival: bool = True) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    items = [(path, o, view[o:o + min(CS, size - o)]) for o in range(0, size, CS)]
    got = fs.batch_read(items, check_arrival=check_arrival)
    assert sum(got) == size
    return bytes(buf)


def test_zero_copy_reads_return_the_same_bytes(fs, d, rng):
    # 5 whole chunks and a short last one; a second file with a hole of two chunks and a short chunk
    data = rng.randbytes(5 * CS + 12345)
    fs.write_bytes(f"{d}/f", data)
    sparse = f"{d}/sparse"
    head, tail = rng.randbytes(CS + 1000), rng.randbytes(300 * KiB)
    with fs.open(sparse, "wb") as f:
        f.write(head)
        f.seek(4 * CS)
        f.write(tail)
    want_sparse = head + bytes(4 * CS - len(head)) + tail
    storage = fs.aio.storage
    for zero_copy in (True, False, True):
        storage.zero_copy = zero_copy
        try:
            assert _whole_chunks(fs, f"{d}/f", len(data)) == data
            assert _whole_chunks(fs, f"{d}/f", len(data), check_arrival=False) == data
            assert _whole_chunks(fs, sparse, len(want_sparse)) == want_sparse
            # buffers bigger than the chunk's bytes (the tail is zeros), and stale bytes in the destination
            buf = np.full(3 * CS, 0xAB, dtype=np.uint8)  # chunk 1 holds 1000 bytes, chunks 2-3 are a hole
            assert fs.batch_read([(sparse, CS, buf[:CS]), (sparse, 2 * CS, buf[CS:])]) == [CS, 2 * CS]
            assert buf.tobytes() == want_sparse[CS:4 * CS]
            buf = np.full(2 * CS, 0xAB, dtype=np.uint8)  # past the end of the file
            assert fs.batch_read([(sparse, 3 * CS, buf)]) == [CS + len(tail)]
            assert buf[:CS + len(tail)].tobytes() == want_sparse[3 * CS:]
            # batches of small IOs (the batched pass of storage), mixed with whole chunks
            items, want = [], []
            for _ in range(300):
                length = rng.choice([1, 4096, 5000, 64 * KiB, 200 * KiB, CS])
                off = rng.randrange(0, len(data) + 8 * KiB)
                items.append((f"{d}/f", off, np.full(length, 0xCD, dtype=np.uint8)))
                want.append(data[off:off + length])
            for (_, _, buf), w, got in zip(items, want, fs.batch_read(items)):
                assert got == len(w)
                assert buf[:got].tobytes() == w  # (past the end of the file: short, the rest untouched)
        finally:
            storage.zero_copy = True


def test_damaged_chunk_is_caught_on_arrival_and_repaired(private_cluster, rng):
    cluster = private_cluster()
    with Client.connect(str(cluster.client_config_path)) as fs:
        data = rng.randbytes(3 * CS)
        fs.write_bytes("/z", data)
        inode = fs.stat("/z").inode
        replicas = chunk_replicas(Path(cluster.dir, "data"), chunk_id(inode, 1))
        assert len(replicas) == 3
        for where in replicas[:2]:  # damage on disk in all replicas but one
            flip_bit(where, 777)
        for path, base in replicas:  # in the page cache (zero copy serves cached chunks only)
            with open(path, "rb") as f:
                f.seek(base)
                f.read(CS)
        storage = fs.aio.storage
        # a chunk sent zero-copy is checked by the client whatever check_arrival says: never returned damaged
        for _ in range(6):
            assert _whole_chunks(fs, "/z", len(data), False) == data, "a damaged chunk was returned"
        for _ in range(6):
            assert _whole_chunks(fs, "/z", len(data)) == data, "a damaged chunk was returned"
        assert storage.damaged_reads >= 1, "the servers checked the chunk: no zero-copy send"  # the client caught it
        # the clients' reports made the servers check their copies and repair them from the good one
        wait_for(lambda: replica_differences(fs, "/z") == [], "the damaged copies repaired", 60)
        damaged = storage.damaged_reads
        for _ in range(6):
            assert _whole_chunks(fs, "/z", len(data), False) == data
        assert storage.damaged_reads == damaged


def _drop_from_page_cache(data_dir: Path, inode: int, indices) -> None:
    """Chunks `indices` of file `inode` out of the page cache on every replica (written back first)."""
    import os

    for index in indices:
        for path, base in chunk_replicas(data_dir, chunk_id(inode, index)):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, base, CS, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def test_big_ios_to_one_service_go_together():
    from threefs.cluster.storage_client import BIG_IOS_PER_REQUEST, BIG_REQUEST_BYTES_MAX, _big_requests

    idx = np.arange(100, 130)
    positions = list(range(30))
    nodes = [k % 3 for k in range(30)]
    lengths = [CS] * 30
    lengths[4] = BIG_REQUEST_BYTES_MAX  # alone: as big as a request may be
    requests: list = []
    _big_requests(requests, idx, positions, nodes, lengths, ["a", "b", "c"])
    got = sorted(int(k) for _, part in requests for k in part)
    assert got == list(range(100, 130))  # every IO once
    for addr, part in requests:
        ks = [int(k) - 100 for k in part]
        assert {nodes[k] for k in ks} == {"abc".index(addr)}  # each on its node
        assert len(ks) <= BIG_IOS_PER_REQUEST and (len(ks) == 1 or sum(lengths[k] for k in ks) <= BIG_REQUEST_BYTES_MAX)
        assert ks == sorted(ks)
    assert max(len(part) for _, part in requests) == BIG_IOS_PER_REQUEST
    assert [a for a, _ in requests[:4]] == ["a", "b", "c", "a"]  # the nodes take turns


def test_several_whole_chunks_in_one_zero_copy_request(private_cluster, rng):
    """Whole chunks read together (one request per service carries several): cached ones sent from the data
    files, cold ones read with O_DIRECT, a hole, a short last chunk and a chunk damaged on disk, all in the
    same requests. The bytes are the caller's file's, the damaged chunk is caught on arrival and repaired."""
    cluster = private_cluster()
    with Client.connect(str(cluster.client_config_path)) as fs:
        n = 18
        data = bytearray(rng.randbytes(n * CS + 4321))
        data[5 * CS:6 * CS] = bytes(CS)  # chunk 5 never written: a hole
        with fs.open("/many", "wb") as f:
            f.write(data[:5 * CS])
            f.seek(6 * CS)
            f.write(data[6 * CS:])
        inode = fs.stat("/many").inode
        data_dir = Path(cluster.dir, "data")
        _drop_from_page_cache(data_dir, inode, (2, 3, 11))  # cold on every replica: read with O_DIRECT
        damaged = chunk_replicas(data_dir, chunk_id(inode, 7))
        for where in damaged[:2]:
            flip_bit(where, 4242)
        for path, base in damaged:  # cached: sent zero-copy, unchecked by the server
            with open(path, "rb") as f:
                f.seek(base)
                f.read(CS)
        storage = fs.aio.storage
        index_of = {chunk_id(inode, i): i for i in range(n + 1)}
        sizes, failed = [], []
        real = storage._read_request

        async def spy(addr, req, batch, idx, *args, **kw):
            # each request's own answers, before any retry: every IO's bytes right, or it failed (only the
            # damaged chunk may, caught on arrival)
            out = await real(addr, req, batch, idx, *args, **kw)
            sizes.append(len(idx))
            for k in idx.tolist():
                i = index_of[batch.ios["chunk"][k:k + 1].tobytes()]
                if k in batch.errors:
                    failed.append(i)
                    continue
                want = bytes(data[i * CS:(i + 1) * CS])
                got = int(batch.got[k])
                assert got == (0 if i == 5 else len(want)), f"chunk {i} in a request of {len(idx)}"
                assert bytes(batch.dest(k)[:len(want)]) == want, f"chunk {i} in a request of {len(idx)}"
            return out

        storage._read_request = spy
        try:
            for check_arrival in (False, True):
                assert _whole_chunks(fs, "/many", len(data), check_arrival) == bytes(data)
        finally:
            del storage._read_request
        assert max(sizes) > 1, "no request carried several chunks"
        assert set(failed) <= {7}
        assert storage.damaged_reads >= 1
        wait_for(lambda: replica_differences(fs, "/many") == [], "the damaged copies repaired", 60)


def test_parts_of_chunks_sent_from_the_data_files(cluster, fs, d, rng):
    """Batches with IOs of 32 KiB or more (random samples of 64 KiB, say) are zero-copy requests: a part
    of a chunk version the server has checked whole, in its page cache, goes out with sendfile from the data
    file, its crc32c taken from a read just before; the rest (first partial reads of a version, cold parts,
    holes, past the end, a short last chunk, IOs under 16 KiB) takes the ordinary path within the same requests. Through the
    caller-thread path (small batches) and the loop's (big ones), cold and warm: the bytes are the file's and
    no IO arrives damaged (a slot out of place would: it is checked on arrival, then read again)."""

    n = 12
    data = bytearray(rng.randbytes(n * CS + 777))
    data[4 * CS:5 * CS] = bytes(CS)  # chunk 4 never written: a hole
    path = f"{d}/parts"
    with fs.open(path, "wb") as f:
        f.write(data[:4 * CS])
        f.seek(5 * CS)
        f.write(data[5 * CS:])
    inode = fs.stat(path).inode
    storage = fs.aio.storage
    assert storage.zero_copy

    def batch(count: int, mixed: bool = False) -> list:
        items = []
        for _ in range(count):
            length = rng.choice([32 * KiB, 64 * KiB, 64 * KiB, 100 * KiB + 3, 127 * KiB]
                                + ([1, 4096, 5000, 20 * KiB] if mixed else []))
            off = rng.randrange(1, len(data) + 4 * KiB)
            if off % CS == 0:
                off += 1
            items.append((path, off, np.full(length, 0xCD, dtype=np.uint8)))
        return items

    def check(items) -> None:
        damaged = storage.damaged_reads
        for (_, off, buf), got in zip(items, fs.batch_read(items)):
            want = bytes(data[off:off + len(buf)])
            assert got == len(want) and buf[:got].tobytes() == want
        assert storage.damaged_reads == damaged, "an IO arrived damaged: a slot out of place"

    sync_before = fs._storage_sync.batches
    for rounds in range(3):
        if rounds == 1:
            _drop_from_page_cache(Path(cluster.dir, "data"), inode, range(n + 1))  # cold on every replica
        check(batch(40))  # under 8 MiB, no IO from a chunk's start: the caller-thread path
        check(batch(300))  # over 16 MiB: the loop's path, several requests per service
    for _ in range(3):  # warm and checked whole now: parts from the data files
        check(batch(40))
        check(batch(300))
        check(batch(40, mixed=True))  # with small IOs (copied into the payload) among them
        check(batch(300, mixed=True))
    assert fs._storage_sync.batches > sync_before  # (both paths were taken)
