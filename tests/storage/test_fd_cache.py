"""The v1 engine's read descriptor cache (storage/version_files.py FdCache): reads never see a replaced or
removed version through a cached descriptor, removed files are not kept open, the cache is bounded."""

from __future__ import annotations

import os
import random
import threading

import pytest

from threefs.common.ids import chunk_id
from threefs.common.status import StatusCode, ThreeFSError
from threefs.storage.chunk_engine import ChunkEngine
from threefs.storage.version_files import FdCache

CS = 64 * 1024


def deleted_fds(under) -> list[str]:
    """Descriptors of this process that point at unlinked files under `under`."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(" (deleted)") and target.startswith(str(under)):
            out.append(target)
    return out


def put(engine: ChunkEngine, cid: bytes, ver: int, offset: int, data: bytes) -> None:
    engine.write(cid, update_ver=ver, chain_ver=1, offset=offset, data=memoryview(data), chunk_size=CS)
    engine.commit(cid, ver)


def read(engine: ChunkEngine, cid: bytes, offset: int = 0, length: int = CS) -> bytes:
    out = memoryview(bytearray(length))
    data, _ = engine.read(cid, offset, length, out)
    return bytes(data)


def test_replaced_and_removed_versions_are_never_read(tmp_path):
    rng = random.Random(5)
    with ChunkEngine(str(tmp_path / "t")) as engine:
        cid = chunk_id(7, 0)
        put(engine, cid, 1, 0, b"a" * 1000)
        assert read(engine, cid) == b"a" * 1000
        assert len(engine._files.fds) == 1  # the descriptor stays open for the next read
        put(engine, cid, 2, 0, b"b" * 500)  # copy-on-write: a new version file, the old one unlinked
        assert read(engine, cid) == b"b" * 500 + b"a" * 500
        put(engine, cid, 3, 1000, b"c" * 10)  # in place, past the committed end: same file, longer
        assert read(engine, cid) == b"b" * 500 + b"a" * 500 + b"c" * 10
        assert not deleted_fds(tmp_path)
        engine.write(cid, update_ver=4, chain_ver=1, offset=0, data=memoryview(b""), chunk_size=CS,
                     full_replace=False)
        engine.commit(cid, 4)
        for ver in range(5, 40):  # a random mix of writes, every read checked against a model
            model = bytearray(read(engine, cid))
            off, n = rng.randrange(0, 2000), rng.randrange(1, 3000)
            data = rng.randbytes(n)
            put(engine, cid, ver, off, data)
            model[len(model):off] = bytes(max(0, off - len(model)))
            model[off:off + n] = data
            assert read(engine, cid) == bytes(model)
            assert not deleted_fds(tmp_path)
        engine.remove(cid, update_ver=40, chain_ver=1)
        engine.commit(cid, 40)
        with pytest.raises(ThreeFSError) as e:
            read(engine, cid)
        assert e.value.code == StatusCode.CHUNK_NOT_FOUND
        assert not deleted_fds(tmp_path)
    assert len(engine._files.fds) == 0  # close() closes the cached descriptors


def test_bounded_and_closed_only_when_unused(tmp_path):
    paths = []
    for i in range(10):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * 10)
        paths.append(str(p))
    cache = FdCache(entries_max=4)
    for p in paths:
        cache.release(cache.acquire(p))
    assert len(cache) == 4
    held = cache.acquire(paths[-1])
    cache.forget(paths[-1])  # unlinked while a read holds it: the descriptor stays valid until released
    assert os.pread(held.fd, 10, 0) == bytes([9]) * 10
    cache.release(held)
    with pytest.raises(OSError):
        os.fstat(held.fd)  # closed once the last user let go (or reused: then it is not this file)
    os.unlink(paths[0])
    with pytest.raises(FileNotFoundError):
        cache.acquire(paths[0])  # evicted earlier and gone now: the open fails as without a cache
    cache.close()
    assert len(cache) == 0


def test_reads_race_overwrites(tmp_path):
    """Readers on threads while a writer replaces the version over and over: every read returns one
    whole committed version, never a mix or a removed file's bytes."""
    with ChunkEngine(str(tmp_path / "t")) as engine:
        cid = chunk_id(9, 3)
        put(engine, cid, 1, 0, bytes([1]) * 4096)
        stop = threading.Event()
        bad = []

        def reader() -> None:
            while not stop.is_set():
                try:
                    got = read(engine, cid, 0, 4096)
                except ThreeFSError as e:  # the version's file went between lookup and open, twice
                    assert e.code == StatusCode.IO_ERROR, e
                    continue
                if len(set(got)) != 1 or len(got) != 4096:
                    bad.append(got[:16])

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for ver in range(2, 300):
                put(engine, cid, ver, 0, bytes([ver % 256]) * 4096)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not bad, bad[:3]
        assert not deleted_fds(tmp_path)
