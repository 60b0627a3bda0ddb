"""Aligned IO buffers (see limits.IO_BUFFER_ALIGN for why alignment matters here)."""

from __future__ import annotations

import numpy as np

from threefs.common.limits import IO_BUFFER_ALIGN


def aligned_buffer(nbytes: int, align: int = IO_BUFFER_ALIGN) -> memoryview:
    """A writable byte memoryview of `nbytes` whose first byte sits on an `align` boundary."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skip = (-raw.ctypes.data) % align
    view = memoryview(raw[skip:skip + nbytes]).cast("B")
    assert len(view) == nbytes
    return view


def align_up(n: int, align: int = IO_BUFFER_ALIGN) -> int:
    return (n + align - 1) // align * align


class BufferPool:
    """Reusable aligned buffers in power-of-two size classes.

    Fresh large allocations come from new anonymous pages, and touching them costs a page fault per
    4 KiB (measured: preadv of 1 MiB into fresh memory spent most of a storage server's read time).
    Buffers handed back are kept, up to `bytes_max` in total, and reused.
    Not thread-safe: use it from one event loop.
    """

    def __init__(self, bytes_max: int = 256 << 20, class_min: int = 64 << 10):
        self.bytes_max = bytes_max
        self.class_min = class_min
        self._free: dict[int, list[memoryview]] = {}
        self._pooled_bytes = 0

    def _class(self, nbytes: int) -> int:
        size = self.class_min
        while size < nbytes:
            size *= 2
        return size

    def acquire(self, nbytes: int) -> "Lease":
        size = self._class(nbytes)
        free = self._free.get(size)
        if free:
            buf = free.pop()
            self._pooled_bytes -= size
        else:
            buf = aligned_buffer(size)
        return Lease(self, buf, nbytes)

    def _give_back(self, buf: memoryview) -> None:
        size = len(buf)
        if self._pooled_bytes + size <= self.bytes_max:
            self._free.setdefault(size, []).append(buf)
            self._pooled_bytes += size


class Lease:
    """A pooled buffer lent out; `view` is exactly the bytes asked for. release() returns it once."""

    __slots__ = ("_pool", "_buf", "view")

    def __init__(self, pool: BufferPool, buf: memoryview, nbytes: int):
        self._pool = pool
        self._buf = buf
        self.view = buf[:nbytes]

    def release(self) -> None:
        if self._buf is not None:
            self._pool._give_back(self._buf)
            self._buf = None

