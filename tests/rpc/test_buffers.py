"""Aligned buffers, the buffer pool and prefaulting of fresh memory."""

from __future__ import annotations

import mmap

import numpy as np

from threefs.common.buffers import BufferPool, aligned_buffer, prefault
from threefs.common.limits import IO_BUFFER_ALIGN


def _rss_of_mapping(address: int) -> int:
    """Resident bytes of the mapping of this process that contains `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_prefault_backs_fresh_memory_before_it_is_touched():
    size = 64 << 20
    region = mmap.mmap(-1, size)  # its own mapping: nothing else shares its Rss
    address = np.frombuffer(region, dtype=np.uint8).ctypes.data
    assert _rss_of_mapping(address) < size // 2  # fresh: not backed yet
    assert prefault(address, size)  # this machine's kernel (>= 5.14) supports MADV_POPULATE_WRITE
    assert _rss_of_mapping(address) >= size
    view = np.frombuffer(region, dtype=np.uint8)
    assert not view.any()  # still zeros, and writable
    view[::4096] = 7
    assert int(view.sum()) == 7 * (size // 4096)
    del view
    region.close()


def test_prefault_skips_small_regions():
    buf = np.empty(4096, dtype=np.uint8)
    assert prefault(buf.ctypes.data, buf.nbytes) is False


def test_aligned_buffer_and_pool_reuse():
    view = aligned_buffer(10_000)
    assert len(view) == 10_000 and np.frombuffer(view, dtype=np.uint8).ctypes.data % IO_BUFFER_ALIGN == 0
    pool = BufferPool(bytes_max=1 << 20)
    lease = pool.acquire(100_000)
    first = np.frombuffer(lease.view, dtype=np.uint8).ctypes.data
    lease.release()
    again = pool.acquire(90_000)
    assert np.frombuffer(again.view, dtype=np.uint8).ctypes.data == first  # the same buffer, reused
    again.release()
