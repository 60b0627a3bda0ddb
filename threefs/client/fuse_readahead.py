"""Read-ahead for the FUSE daemon: a sequential reader's next segments are fetched before the kernel
asks for them, many at once, so storage round trips overlap however few requests the kernel keeps in
flight (its read-ahead window and background-request limit are small).

Segments are `segment_bytes` long and aligned to it (whole chunks). A kernel request inside one segment
is answered with a view of the segment's buffer (no copy); one that spans segments is copied together.
A request that does not continue the stream is read on its own, and the prefetch window starts over.
"""

from __future__ import annotations

import asyncio

from threefs.common.buffers import BufferPool
from threefs.rpc.schemas import meta as m

SEGMENTS_SLACK = 4  # segments kept beyond twice the window (requests still on their way)


class _Segment:
    __slots__ = ("index", "lease", "task", "served", "readers")

    def __init__(self, index: int, lease, task: asyncio.Task):
        self.index, self.lease, self.task = index, lease, task
        self.served = 0  # bytes handed to the kernel; the segment is dropped once all are
        self.readers = 0  # requests waiting on it: its buffer must outlive them


class ReadAhead:
    def __init__(self, aio, pool: BufferPool, segment_bytes: int, window_bytes: int, reader=None):
        """window_bytes = 0 turns prefetching off (every request is read on its own). reader: what
        reads a request on its own (a batch.ReadCoalescer shares round trips); default aio."""
        assert segment_bytes > 0
        self._aio = aio
        self._reader = reader or aio
        self._pool = pool
        self._seg = segment_bytes
        self._enabled = window_bytes > 0
        self._window_max = max(segment_bytes, window_bytes)
        self._window = 0
        self._segments: dict[int, _Segment] = {}
        self._stream_end = -1  # where the sequential stream has been read up to

    def drop(self) -> None:
        """Forget everything prefetched (the file changed, or the reader jumped)."""
        for s in list(self._segments.values()):
            self._evict(s)
        self._window = 0

    def _evict(self, s: _Segment) -> None:
        del self._segments[s.index]
        if s.readers:
            return  # the last request reading it releases it (see _serve)
        if s.task.done():
            s.lease.release()
        else:  # storage may still write into the buffer: cancel, and free it only when it is over
            s.task.cancel()
            s.task.add_done_callback(lambda _t, lease=s.lease: lease.release())

    async def read(self, attr: m.InodeAttr, offset: int, size: int, release_later) -> memoryview:
        """Bytes [offset, offset + size) of the file (size already clamped to its length).
        release_later(fn) must run fn once the reply has been sent (the reply may be a view)."""
        end = offset + size
        covered = self._covers(offset, end)
        # The stream goes on where the last request ended (give or take a segment: the kernel's own
        # read-ahead requests arrive concurrently and a little out of order).
        adjacent = self._stream_end >= 0 and abs(offset - self._stream_end) <= self._seg
        if not self._enabled or not (covered or adjacent):
            if self._segments:
                self.drop()
            self._stream_end = end
            return await self._read_direct(attr, offset, size, release_later)
        self._window = min(self._window_max, max(2 * self._window, 4 * self._seg))
        self._stream_end = max(self._stream_end, end)
        self._schedule(attr, offset, self._stream_end + self._window)
        return await self._serve(offset, end, release_later)

    def _covers(self, offset: int, end: int) -> bool:
        return all(i in self._segments for i in range(offset // self._seg, (end - 1) // self._seg + 1))

    async def _read_direct(self, attr, offset: int, size: int, release_later) -> memoryview:
        lease = self._pool.acquire(size)
        try:
            got = await self._reader.read_into(attr, offset, lease.view)
        except asyncio.CancelledError:
            raise  # the batch it joined may still fill the buffer: never reuse it (the GC frees it)
        except BaseException:
            lease.release()
            raise
        release_later(lease.release)
        return lease.view[:got]

    def _schedule(self, attr: m.InodeAttr, offset: int, until: int) -> None:
        """Segments in flight from offset's segment up to `until` (clamped to the file length)."""
        until = min(until, attr.length)
        for index in range(offset // self._seg, -(-until // self._seg)):
            if index not in self._segments:
                start = index * self._seg
                n = min(self._seg, attr.length - start)
                lease = self._pool.acquire(n)
                task = asyncio.ensure_future(self._aio.read_into(attr, start, lease.view))
                self._segments[index] = _Segment(index, lease, task)
        excess = len(self._segments) - (2 * self._window_max // self._seg + SEGMENTS_SLACK)
        for s in sorted(self._segments.values(), key=lambda s: s.index)[:max(0, excess)]:
            self._evict(s)  # the oldest, which the kernel did not ask for (it jumped or stopped)

    async def _serve(self, offset: int, end: int, release_later) -> memoryview:
        first, last = offset // self._seg, (end - 1) // self._seg
        segs = [self._segments[i] for i in range(first, last + 1)]
        for s in segs:
            s.readers += 1
        try:
            got = await asyncio.gather(*(asyncio.shield(s.task) for s in segs))
        except BaseException:
            for s in segs:
                if self._segments.get(s.index) is s and s.task.done():
                    del self._segments[s.index]  # a failed segment is read again next time
            raise
        finally:
            for s in segs:
                s.readers -= 1
        pieces = []
        for s, n in zip(segs, got):
            base = s.index * self._seg
            pieces.append(s.lease.view[max(offset, base) - base:max(0, min(end, base + n) - base)])
        out = pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))
        for s, piece in zip(segs, pieces):
            s.served += len(piece)
            if self._segments.get(s.index) is s and s.served < len(s.lease.view):
                continue  # more of it is still to be asked for
            if self._segments.get(s.index) is s:
                del self._segments[s.index]
            if s.readers == 0:
                release_later(s.lease.release)  # after this reply, which may be a view of it
        return out
