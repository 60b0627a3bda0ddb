"""Write-behind for the FUSE daemon: kernel write requests fill chunk-aligned buffers, full buffers go
to storage in the background (their chunks in parallel), at most `bytes_max` in flight.

Runs on the daemon's event loop. Errors of background writes are kept and raised by the next write()
or by flush(), so close(2) / fsync(2) report them.
"""

from __future__ import annotations

import asyncio

from threefs.common.buffers import aligned_buffer
from threefs.rpc.schemas import meta as m

FREE_BUFFERS_MAX = 4


class WriteBehind:
    def __init__(self, aio, attr: m.InodeAttr, segment_bytes: int, bytes_max: int):
        assert segment_bytes > 0 and bytes_max >= segment_bytes
        self._aio = aio
        self.attr = attr
        self._seg = segment_bytes
        self._max = bytes_max
        self._buf: memoryview | None = None
        self._buf_off = 0
        self._buf_len = 0
        self._tasks: dict[asyncio.Task, tuple[int, int]] = {}  # task -> [begin, end)
        self._inflight_bytes = 0
        self._free: list[memoryview] = []
        self._error: BaseException | None = None
        self.acked_end = -1  # highest end storage acknowledged
        self._lock = asyncio.Lock()

    @property
    def dirty(self) -> bool:
        """Bytes buffered or in flight (a read must flush them first to see them)."""
        return self._buf is not None or bool(self._tasks)

    async def write(self, offset: int, data: bytes) -> None:
        # The kernel sends a handle's writes concurrently; they take turns here, in arrival order,
        # because a write may wait for room in flight while the buffer state must stay its own.
        async with self._lock:
            self._raise_error()
            view = memoryview(data)
            while view:
                taken = await self._piece(offset, view)
                view = view[taken:]
                offset += taken

    async def _piece(self, offset: int, view: memoryview) -> int:
        if self._buf is not None and offset != self._buf_off + self._buf_len:
            await self._send_buffer()  # not contiguous: the buffered bytes go out first
        if self._buf is None:
            if offset % self._seg == 0 and len(view) >= self._seg:  # bytes are immutable: no copy
                whole = len(view) // self._seg * self._seg
                await self._send(offset, view[:whole], None)
                return whole
            self._buf = self._free.pop() if self._free else aligned_buffer(self._seg)
            self._buf_off, self._buf_len = offset, 0
        room = self._seg - self._buf_off % self._seg - self._buf_len
        take = min(room, len(view))
        self._buf[self._buf_len:self._buf_len + take] = view[:take]
        self._buf_len += take
        if take == room:
            await self._send_buffer()
        return take

    async def _send_buffer(self) -> None:
        buf, off, n = self._buf, self._buf_off, self._buf_len
        self._buf = None
        if buf is not None and n:
            await self._send(off, buf[:n], buf)
        elif buf is not None:
            self._free.append(buf)

    async def _send(self, offset: int, data: memoryview, owned: memoryview | None) -> None:
        end = offset + len(data)
        overlapping = [t for t, (b, e) in self._tasks.items() if b < end and offset < e]
        if overlapping:  # a write to the same bytes still in flight must land first
            await asyncio.wait(overlapping)
        while self._tasks and self._inflight_bytes + len(data) > self._max:
            await asyncio.wait(list(self._tasks), return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.ensure_future(self._aio.write_at(self.attr, offset, data))
        self._tasks[task] = (offset, end)
        self._inflight_bytes += len(data)
        task.add_done_callback(lambda t: self._done(t, owned))

    def _done(self, task: asyncio.Task, owned: memoryview | None) -> None:
        begin, end = self._tasks.pop(task)
        self._inflight_bytes -= end - begin
        if task.cancelled():
            err: BaseException | None = asyncio.CancelledError()
        else:
            err = task.exception()
        if err is None:
            self.acked_end = max(self.acked_end, end)
        elif self._error is None:
            self._error = err
        if owned is not None and len(self._free) < FREE_BUFFERS_MAX:
            self._free.append(owned)

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    async def flush(self) -> None:
        """Everything written so far is on storage when this returns (or its error is raised)."""
        async with self._lock:
            await self._send_buffer()
            while self._tasks:
                await asyncio.wait(list(self._tasks))
            self._raise_error()

    def discard_before(self, length: int) -> None:
        """After a truncate to `length`, acknowledged ends past it no longer mean anything."""
        self.acked_end = min(self.acked_end, length)
