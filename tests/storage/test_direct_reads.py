"""Whole cold chunks read with O_DIRECT (storage/service.py `_read_direct`, ChunkEngineV2.read_direct): a zero-copy
read of a whole committed chunk not in the page cache is read from the disk past the page cache into a pooled
page-aligned buffer and sent from there; the client checks it on arrival against the chunk's write-time crc32c.

What they prove, on real storage processes and real files: the bytes are the same as written (chunk lengths
that are and are not multiples of the 4 KiB O_DIRECT unit, short last chunks, holes); the read really went past
the page cache (the chunk's pages are still not cached afterwards; the same read with direct reads off leaves
them cached, so the check can fail); a chunk damaged on disk is never returned (caught on arrival, read from
another replica) and the damaged copies are repaired; a data file cut short under a running service (a short
O_DIRECT read) is never returned short: the ordinary path answers (an IO error naming the file). And the engine function alone:
alignment refused with -1, reads at the file's end short, a closed engine refuses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from threefs.client.client import Client
from threefs.common.ids import chunk_id
from threefs.testing.checks import replica_differences, wait_for
from threefs.testing.chunk_files import chunk_replicas, flip_bit
from threefs.testing.page_cache import drop_cache, skip_unless_cold_reads

KiB, MiB = 1 << 10, 1 << 20
CS = MiB


def _cached_pages(where: tuple[Path, int], length: int) -> int:
    """How many of the chunk's 4 KiB pages at `where` (file, base) are in the page cache (cachestat(2): no IO,
    unlike an RWF_NOWAIT probe, whose miss starts a readahead)."""
    from threefs.storage.service import page_cache_holds

    path, base = where
    fd = os.open(path, os.O_RDONLY)
    try:
        if page_cache_holds(fd, base, 1) is None:
            pytest.skip("no cachestat(2) on this kernel: page-cache residency cannot be observed without IO")
        return sum(bool(page_cache_holds(fd, at, 1)) for at in range(base, base + length, 4096))
    finally:
        os.close(fd)


def _read_chunks(fs, path: str, size: int, check_arrival: bool = True) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = fs.batch_read([(path, o, view[o:o + min(CS, size - o)]) for o in range(0, size, CS)],
                        check_arrival=check_arrival)
    assert sum(got) == size
    return bytes(buf)


def _services(cluster) -> list:
    return [p for n, p in sorted(cluster.running().items()) if n.startswith("storage")]


@pytest.fixture(scope="module")
def direct_cluster(tmp_path_factory):
    from tests.conftest import start_cluster

    c = start_cluster(tmp_path_factory.mktemp("direct"), heartbeat_timeout_s=3.0)
    yield c
    c.down()


def test_cold_whole_chunks_come_past_the_page_cache(direct_cluster, rng):
    cluster = direct_cluster
    data_dir = Path(cluster.dir, "data")
    skip_unless_cold_reads(data_dir)
    with Client.connect(str(cluster.client_config_path)) as fs:
        # whole chunks, a last chunk of 200 KiB + 5 bytes (not a multiple of 4 KiB), a file with holes
        data = rng.randbytes(4 * CS + 200 * KiB + 5)
        fs.write_bytes("/f", data)
        with fs.open("/sparse", "wb") as f:
            f.write(rng.randbytes(CS))
            f.seek(3 * CS)
            f.write(rng.randbytes(300 * KiB + 17))
        sparse = fs.read_bytes("/sparse")
        inode = fs.stat("/f").inode
        chunks = [(chunk_replicas(data_dir, chunk_id(inode, k)), min(CS, len(data) - k * CS)) for k in range(5)]
        assert all(len(r) == 3 for r, _ in chunks)
        for check_arrival in (True, False):
            drop_cache(data_dir)
            assert _read_chunks(fs, "/f", len(data), check_arrival) == data
            assert _read_chunks(fs, "/sparse", len(sparse), check_arrival) == sparse
            # every replica read was direct: no page of any chunk came into the page cache
            cached = [_cached_pages(where, n) for replicas, n in chunks for where in replicas]
            assert cached == [0] * len(cached), f"pages cached by the reads: {cached}"
        # read again while cached (the page-cache probe finds them): sendfile, same bytes
        for replicas, n in chunks:
            for path, base in replicas:
                with open(path, "rb") as fh:
                    fh.seek(base)
                    fh.read(n)
        assert _read_chunks(fs, "/f", len(data)) == data


def test_direct_reads_off_reads_through_the_page_cache(private_cluster, rng):
    # the control of the test above: with direct_reads = false in storage's config the same cold read
    # caches the pages
    cluster = private_cluster(storage=1, replicas=1, direct_reads=False)
    data_dir = Path(cluster.dir, "data")
    skip_unless_cold_reads(data_dir)
    with Client.connect(str(cluster.client_config_path)) as fs:
        data = rng.randbytes(2 * CS)
        fs.write_bytes("/f", data)
        drop_cache(data_dir)
        assert _read_chunks(fs, "/f", len(data)) == data
        where = chunk_replicas(data_dir, chunk_id(fs.stat("/f").inode, 0))[0]
        assert _cached_pages(where, CS) == CS // 4096


def test_damaged_cold_chunk_is_caught_and_repaired(private_cluster, rng):
    cluster = private_cluster()
    data_dir = Path(cluster.dir, "data")
    with Client.connect(str(cluster.client_config_path)) as fs:
        data = rng.randbytes(3 * CS)
        fs.write_bytes("/z", data)
        replicas = chunk_replicas(data_dir, chunk_id(fs.stat("/z").inode, 1))
        assert len(replicas) == 3
        for where in replicas[:2]:  # damage on disk in all replicas but one
            flip_bit(where, 5000)
        storage = fs.aio.storage
        for check_arrival in (False, True):
            for _ in range(4):
                drop_cache(data_dir)  # cold every time: the direct path reads the damaged bytes off the disk
                assert _read_chunks(fs, "/z", len(data), check_arrival) == data, "a damaged chunk was returned"
        assert storage.damaged_reads >= 1  # caught on arrival (the server sends direct reads unchecked)
        wait_for(lambda: replica_differences(fs, "/z") == [], "the damaged copies repaired", 60)
        damaged = storage.damaged_reads
        for _ in range(3):
            drop_cache(data_dir)
            assert _read_chunks(fs, "/z", len(data), False) == data
        assert storage.damaged_reads == damaged


def test_short_direct_read_is_never_returned(private_cluster, rng):
    # a data file cut short under a running service: the O_DIRECT read comes back short, and the ordinary
    # path answers instead (its IO_ERROR names the cut data file); the short bytes are never returned
    from threefs.common.status import StatusCode, ThreeFSError

    cluster = private_cluster(storage=2, replicas=2)
    data_dir = Path(cluster.dir, "data")
    with Client.connect(str(cluster.client_config_path)) as fs:
        data = rng.randbytes(CS)
        fs.write_bytes("/s", data)
        replicas = chunk_replicas(data_dir, chunk_id(fs.stat("/s").inode, 0))
        assert len(replicas) == 2
        path, base = replicas[0]
        os.truncate(path, base + 8192)  # the data file now ends 8 KiB into the chunk's block
        good = errors = 0
        for _ in range(6):  # reads alternate between the two replicas
            drop_cache(data_dir)
            try:
                assert _read_chunks(fs, "/s", len(data)) == data
                good += 1
            except ThreeFSError as e:
                assert e.code == StatusCode.IO_ERROR and "beyond the end of its data file" in e.message, e
                errors += 1
        assert good and errors, (good, errors)


# -- the engine function ---------------------------------------------------------------------------
def test_engine_read_direct(tmp_path, rng):
    from threefs.common.buffers import aligned_buffer
    from threefs.storage.chunk_engine_v2 import DIRECT_ALIGN, ChunkEngineV2

    eng = ChunkEngineV2(str(tmp_path / "t"))
    try:
        cid = chunk_id(7, 0)
        data = rng.randbytes(300 * KiB + 3)
        eng.write(cid, update_ver=1, chain_ver=1, offset=0, data=data, chunk_size=CS)
        eng.commit(cid, 1)
        (loc,), epoch = eng.read_locations([cid])
        try:
            fd, base, size, _, crc = loc
            assert size == len(data) and base % DIRECT_ALIGN == 0
            buf = aligned_buffer(512 * KiB, DIRECT_ALIGN)
            got = eng.read_direct(fd, base, buf[:(size + DIRECT_ALIGN - 1) // DIRECT_ALIGN * DIRECT_ALIGN])
            assert got >= size and bytes(buf[:size]) == data
            assert eng.read_direct(fd, base + 512, buf[:DIRECT_ALIGN]) == -1  # unaligned offset
            assert eng.read_direct(fd, base, buf[:DIRECT_ALIGN + 512]) == -1  # unaligned length
            assert eng.read_direct(fd + 10_000, base, buf[:DIRECT_ALIGN]) == -1  # not a data file of it
            end = os.fstat(fd).st_size
            assert eng.read_direct(fd, end, buf[:DIRECT_ALIGN]) == 0  # at the file's end: nothing
        finally:
            eng.end_reads(epoch)
    finally:
        eng.close()
    with pytest.raises(Exception) as err:
        eng.read_direct(fd, base, buf[:DIRECT_ALIGN])
    assert "closed" in str(err.value)



def test_a_buffered_chunk_read_caches_no_other_chunks_block(tmp_path, rng):
    """Kernel read-ahead is off on the data files: a buffered read of one chunk (the ordinary path: a
    partial read, a chunk with an overlay, direct reads off) brings only its own bytes into the page
    cache, never the next block's (another chunk). With read-ahead a whole-chunk read also cached all of
    the next block, and a cold load then found that chunk's pages cached (test_cold_load flaked)."""
    from threefs.storage.chunk_engine_v2 import ChunkEngineV2

    skip_unless_cold_reads(tmp_path)
    eng = ChunkEngineV2(str(tmp_path / "t"))
    try:
        ids = [chunk_id(7, k) for k in range(4)]
        for cid in ids:
            eng.write(cid, update_ver=1, chain_ver=1, offset=0, data=rng.randbytes(CS), chunk_size=CS)
            eng.commit(cid, 1)
        where = {}
        for cid in ids:
            (loc,), epoch = eng.read_locations([cid])
            where[cid] = loc[:2]
            eng.end_reads(epoch)
        at = {loc: cid for cid, loc in where.items()}
        fd0, base0 = min(where.values())
        assert all((fd0, base0 + k * CS) in at for k in range(4)), "the blocks are not consecutive in one file"
        path = Path(os.readlink(f"/proc/self/fd/{fd0}"))
        drop_cache(tmp_path)
        for k in range(2):  # one block, then the next: the pattern read-ahead follows (and ramps up)
            data, _ = eng.read(at[(fd0, base0 + k * CS)], 0, CS)
            assert len(data) == CS
            assert _cached_pages((path, base0 + k * CS), CS) == CS // 4096
            assert [_cached_pages((path, base0 + j * CS), CS) for j in range(k + 1, 4)] == [0] * (3 - k)
    finally:
        eng.close()
