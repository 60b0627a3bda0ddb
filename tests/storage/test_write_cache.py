"""Chunk engine v2 with write_cache = false: data written with RWF_DONTCACHE reads back the same and
leaves the page cache once on disk (checked with mincore on the data file); with the default it stays."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import pytest

from threefs.storage.chunk_engine_v2 import ChunkEngineV2

MiB = 1 << 20
CHUNK = 4 * MiB


def resident_fraction(path: str) -> float:
    """Share of the file's pages in the page cache (mincore on a mapping of it)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / len(vec)


def write_chunks(eng: ChunkEngineV2, n: int) -> dict[bytes, bytes]:
    out = {}
    for i in range(n):
        cid = bytes(8) + i.to_bytes(8, "big")
        data = os.urandom(CHUNK)
        eng.write(cid, update_ver=1, chain_ver=1, offset=0, data=data, chunk_size=CHUNK)
        eng.commit(cid, 1)
        out[cid] = data
    eng._sync_all()  # written back: dropped pages are gone by now
    return out


def data_files(path: str) -> list[str]:
    blocks = os.path.join(path, "blocks")
    return [os.path.join(blocks, name) for name in os.listdir(blocks) if os.path.getsize(os.path.join(blocks, name))]


@pytest.mark.parametrize("write_cache", [True, False])
def test_write_cache_setting(tmp_path, write_cache):
    path = str(tmp_path / "t")
    eng = ChunkEngineV2(path, write_cache=write_cache)
    try:
        written = write_chunks(eng, 4)
        if not write_cache and eng._wflags == 0:
            pytest.skip("this kernel or file system has no RWF_DONTCACHE (the engine fell back, as documented)")
        files = data_files(path)
        resident = sum(resident_fraction(f) * os.path.getsize(f) for f in files) / sum(map(os.path.getsize, files))
        if write_cache:
            assert resident > 0.9, resident
        else:
            assert resident < 0.1, resident
        for cid, data in written.items():  # the same bytes either way (from the disk when dropped)
            assert eng.read(cid, 0, CHUNK)[0] == data
            assert eng.verify(cid)
        # an in-place append and an overlay go through the same write path
        cid = next(iter(written))
        eng.write(cid, update_ver=2, chain_ver=1, offset=CHUNK // 2, data=b"x" * 4096, chunk_size=CHUNK)
        eng.commit(cid, 2)
        want = bytearray(written[cid])
        want[CHUNK // 2: CHUNK // 2 + 4096] = b"x" * 4096
        assert eng.read(cid, 0, CHUNK)[0] == bytes(want) and eng.verify(cid)
    finally:
        eng.close()
