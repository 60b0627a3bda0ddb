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
