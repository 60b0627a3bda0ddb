"""The streaming engine: read-ahead and write-behind for one open file, on one event loop, over the
async client (`fs.aio`). Both streaming data paths use it: File objects (client/file.py; they drive it
from the caller's thread through the client's loop) and the FUSE daemon (client/fuse.py; in its loop).

Segments. The IO unit is `segment_bytes(chunk_size)`: whole chunks of at least 1 MiB, or 8 MiB of a
larger chunk. Segment i is bytes [i * S, (i + 1) * S) of the file, so its reads and writes are whole
chunk IOs and never straddle one more chunk than they must.

ReadAhead. A request continues the stream when it starts within `slack_bytes` of where the stream has
been read up to (File: exactly there; FUSE: within a segment, since the kernel's requests arrive
concurrently and a little out of order) or when prefetched segments cover all of it; the start of a file
begins a stream. In a stream the window doubles per request from `window_start_bytes` up to
`window_bytes`, and every segment up to the stream's end plus the window is in flight at once. A request
that does not continue the stream drops what was prefetched, restarts the window and is read on its own
(straight into the caller's memory when it has some). A rest of at least one segment that nothing
prefetched is read straight into the caller's memory too.
Buffers are leases of a BufferPool: they go back to it when a segment has been served in full, when it
is dropped (a segment still being read is cancelled, and its buffer goes back only once its task is over:
storage may still write into it until then), or when the last request reading it is done (a reply may be
a view of it). A failed segment is forgotten, so the next request reads it again. `hold`, and
`read_into(hold=True)`, lend segments (read, or still being read: Held.wait) to the caller until
`release` or `advance` (which gives some back and lends the next): File serves reads from them in its
caller's thread without a trip to the loop.

WriteBehind. Writes fill segment-aligned buffers; a full buffer goes to storage in the background (its
chunks in parallel), at most `bytes_max` in flight. `bytes` of whole segments are sent without a copy. A
write waits for any write in flight that overlaps it, so the last write to a byte wins. An error of a
background write is kept and raised by the next write() or flush(). `acked_end` is the highest end storage
acknowledged; after a failure only that counts for the length (`acknowledged`).

Not thread-safe: use an engine from its loop (File's `stage` and `hold`-ed views are the documented
exceptions: see there).
"""

from __future__ import annotations

import asyncio
import concurrent.futures

from threefs.common import limits
from threefs.common.buffers import BufferPool, aligned_buffer
from threefs.rpc.schemas import meta as m

SEGMENT_BYTES_MIN = 1 * limits.MiB  # smaller chunks are grouped into segments of at least this size
SEGMENT_BYTES_MAX = 8 * limits.MiB
SEGMENTS_SLACK = 4  # segments kept beyond twice the window (requests still on their way)
WRITE_FREE_BUFFERS_MAX = 8  # write buffers kept per file for reuse (fresh pages cost a fault per 4 KiB)


def segment_bytes(chunk_size: int) -> int:
    """IO unit of read-ahead and write-behind: whole chunks of at least SEGMENT_BYTES_MIN in total,
    or SEGMENT_BYTES_MAX of a larger chunk."""
    if chunk_size >= SEGMENT_BYTES_MAX:
        return SEGMENT_BYTES_MAX
    return -(-SEGMENT_BYTES_MIN // chunk_size) * chunk_size


# -- read-ahead ----------------------------------------------------------------------------------
class _Segment:
    __slots__ = ("index", "lease", "task", "served", "readers")

    def __init__(self, index: int, lease, task: asyncio.Task):
        self.index, self.lease, self.task = index, lease, task
        self.served = 0  # bytes handed out; the segment is dropped once all are
        self.readers = 0  # requests (and holders) using its buffer: it must outlive them


class Held:
    """A read segment lent out by ReadAhead (hold, read_into(hold=True), advance): bytes [offset, end) of
    the file are `view` once its read is over: wait() for that (from any thread; it raises the read's
    error). Nothing reuses the buffer until ReadAhead.release(held)."""

    __slots__ = ("offset", "view", "_seg", "_ready")

    def __init__(self, offset: int, view: memoryview, seg: _Segment):
        self.offset, self.view, self._seg = offset, view, seg
        self._ready = concurrent.futures.Future()  # set on the loop when the segment's read is over
        if seg.task.done():
            _settle_future(seg.task, self._ready)
        else:
            seg.task.add_done_callback(lambda t: _settle_future(t, self._ready))

    @property
    def end(self) -> int:
        return self.offset + len(self.view)

    def covers(self, pos: int) -> bool:
        return self.offset <= pos < self.offset + len(self.view)

    def wait(self, timeout: float | None = None) -> None:
        """Until the bytes are there (concurrent.futures.TimeoutError after timeout seconds)."""
        self._ready.result(timeout)

    async def ready(self) -> None:
        """wait() for a borrower on the engine's own loop."""
        await asyncio.wrap_future(self._ready)


def _settle_future(task: asyncio.Task, fut: concurrent.futures.Future) -> None:
    if task.cancelled():
        fut.set_exception(asyncio.CancelledError())
    elif task.exception() is not None:
        fut.set_exception(task.exception())
    else:
        fut.set_result(None)


async def read_leased(pool: BufferPool, reader, attr, offset: int, size: int):
    """(lease, bytes read): up to size bytes at offset read through `reader` into a buffer of `pool`. The
    caller releases the lease once the bytes are used."""
    lease = pool.acquire(size)
    try:
        return lease, await reader.read_into(attr, offset, lease.view)
    except asyncio.CancelledError:
        raise  # the batch it joined may still fill the buffer: never reuse it (the GC frees it)
    except BaseException:
        lease.release()
        raise


class ReadAhead:
    def __init__(self, aio, pool: BufferPool, segment_bytes: int, window_bytes: int, *, reader=None,
                 slack_bytes: int | None = None, window_start_bytes: int | None = None):
        """window_bytes = 0 turns prefetching off (every request is read on its own; `hold` still reads
        the segment it is asked for). reader: what reads a request on its own (default aio; the FUSE
        daemon passes a batch.ReadCoalescer, which shares round trips). slack_bytes: how far from the
        stream's end a request may start and still continue it (default one segment).
        window_start_bytes: the window of a new stream (default four segments)."""
        assert segment_bytes > 0
        self._aio = aio
        self._reader = reader or aio
        self._pool = pool
        self._seg = segment_bytes
        self._enabled = window_bytes > 0
        self._window_max = max(segment_bytes, window_bytes)
        self._window_start = min(self._window_max, window_start_bytes or 4 * segment_bytes)
        self._slack = segment_bytes if slack_bytes is None else slack_bytes
        self._window = 0
        self._segments: dict[int, _Segment] = {}
        self._stream_end = 0  # where the stream has been read up to (a file's start begins one)
        self._cancelled: set[asyncio.Task] = set()  # dropped reads still running: owned until over

    @property
    def active(self) -> bool:
        """Segments are prefetched (or being read)."""
        return bool(self._segments)

    def drop(self) -> None:
        """Forget everything prefetched (the file changed, or the reader jumped)."""
        for s in list(self._segments.values()):
            self._evict(s)
        self._window = 0

    def release(self, held: Held) -> None:
        """The holder is done with a held segment: its buffer may be reused."""
        s = held._seg
        assert s.readers > 0, "a held segment is released once"
        s.readers -= 1
        if s.readers == 0 and self._segments.get(s.index) is not s:
            self._free_when_over(s)

    def advance(self, attr: m.InodeAttr, pos: int, done_with: list[Held]) -> list[Held]:
        """A borrower reading on its own has reached pos and is done with done_with: give those back,
        grow the window, lend what follows (so it stays up to half a window ahead) and prefetch on."""
        for h in done_with:
            self.release(h)
        if not self._enabled or pos > self._stream_end:
            return []
        self._window = min(self._window_max, max(2 * self._window, self._window_start))
        return self._lend(attr, self._stream_end, self._window_max // 2 - (self._stream_end - pos))

    def _evict(self, s: _Segment) -> None:
        del self._segments[s.index]
        if s.readers:
            return  # the last request reading it releases it (see _served / release)
        self._free_when_over(s)

    def _free_when_over(self, s: _Segment) -> None:
        if s.task.done():
            s.lease.release()
        else:  # storage may still write into the buffer: cancel, and free it only when it is over
            s.task.cancel()
            self._cancelled.add(s.task)
            s.task.add_done_callback(self._cancelled.discard)
            s.task.add_done_callback(lambda _t, lease=s.lease: lease.release())

    def _continues(self, offset: int, end: int) -> bool:
        """Whether [offset, end) continues the stream (then the window grows); if not, what was
        prefetched is dropped and the stream starts over at end."""
        if self._enabled and (abs(offset - self._stream_end) <= self._slack or self._covers(offset, end)):
            self._window = min(self._window_max, max(2 * self._window, self._window_start))
            self._stream_end = max(self._stream_end, end)
            return True
        if self._segments:
            self.drop()
        self._window = 0
        self._stream_end = end
        return False

    def restart_at(self, end: int) -> None:
        """A read served without this engine (the caller's own) ended at `end`: the stream starts over there,
        as after a read that did not continue it (_continues), so a read from `end` on continues it."""
        if self._segments:
            self.drop()
        self._window = 0
        self._stream_end = end

    def _covers(self, offset: int, end: int) -> bool:
        return all(i in self._segments for i in range(offset // self._seg, (end - 1) // self._seg + 1))

    # -- the three ways to read ------------------------------------------------------------------
    async def read(self, attr: m.InodeAttr, offset: int, size: int, release_later) -> memoryview:
        """Bytes [offset, offset + size) of the file (size already clamped to its length), maybe a view
        of a segment buffer: release_later(fn) must run fn once the reply has been sent (FUSE)."""
        end = offset + size
        if not self._continues(offset, end):
            return await self._read_direct(attr, offset, size, release_later)
        self._schedule(attr, offset, self._stream_end + self._window, offset, end)
        pieces, segs = await self._gather(offset, end)
        out = pieces[0] if len(pieces) == 1 else memoryview(b"".join(pieces))
        self._served(segs, pieces, release_later)
        return out

    async def read_into(self, attr: m.InodeAttr, offset: int, dest: memoryview,
                        hold: bool = False) -> tuple[int, list[Held]]:
        """Up to len(dest) bytes at offset (clamped to attr's length) into dest; returns (bytes read,
        held segments). hold: lend the caller the rest of the last segment read from and the segments
        after it that are already read (up to half the window), so it serves the next reads itself."""
        n = max(0, min(len(dest), attr.length - offset))
        if n == 0:
            return 0, []
        end = offset + n
        if not self._continues(offset, end):
            return await self._reader.read_into(attr, offset, dest[:n]), []
        seg = self._seg
        cut = offset  # [offset, cut): prefetched already
        while cut < end and cut // seg in self._segments:
            cut = (cut // seg + 1) * seg
        cut = min(cut, end)
        direct = end - cut >= seg  # a large rest nothing prefetched: straight into dest
        self._schedule(attr, end if direct else offset, self._stream_end + self._window, offset, end)
        held: list[Held] = []
        done = 0
        if cut > offset or not direct:
            pieces, segs = await self._gather(offset, cut if direct else end)
            for p in pieces:
                dest[done:done + len(p)] = p
                done += len(p)
            h = self._served(segs, pieces, _now, end, hold=hold and not direct)
            held += [h] if h is not None else []
        if direct:
            done += await self._reader.read_into(attr, cut, dest[cut - offset:n])
        if hold:
            held += self._lend(attr, held[-1].end if held else end, self._window_max // 2)
        return done, held

    def _lend(self, attr: m.InodeAttr, offset: int, budget: int) -> list[Held]:
        """Lend the segments from offset's on (contiguous, read or being read, up to budget bytes), and
        prefetch on past them: the borrower reads them without asking, so the stream moves on."""
        out: list[Held] = []
        index = offset // self._seg
        while budget > 0 and offset < attr.length:
            s = self._segments.get(index)
            if s is None or s.task.done() and (s.task.cancelled() or s.task.exception() is not None):
                break  # not prefetched, or failed (read again when asked for)
            del self._segments[index]
            s.readers += 1
            out.append(Held(index * self._seg, s.lease.view, s))
            budget -= self._seg
            index += 1
        if out:
            last = out[-1].end
            self._stream_end = max(self._stream_end, last)
            self._schedule(attr, last, self._stream_end + self._window, last, last + 1)
        return out

    async def hold(self, attr: m.InodeAttr, offset: int, size: int = 1) -> Held | None:
        """Lend the segment that holds byte offset (prefetching on as a read of [offset, offset + size)
        would); None at or past the end of the file. Give it back with release()."""
        end = min(attr.length, offset + max(1, size))
        if offset >= end:
            return None
        until = self._stream_end + self._window if self._continues(offset, end) else end
        self._schedule(attr, offset, until, offset, offset + 1)
        pieces, segs = await self._gather(offset, offset + 1)
        return self._served(segs, pieces, _now, offset + 1, hold=True, always=True)

    # -- plumbing --------------------------------------------------------------------------------
    async def _read_direct(self, attr, offset: int, size: int, release_later) -> memoryview:
        lease, got = await read_leased(self._pool, self._reader, attr, offset, size)
        release_later(lease.release)
        return lease.view[:got]

    def _schedule(self, attr: m.InodeAttr, offset: int, until: int, first: int, end: int) -> None:
        """Segments in flight from offset's segment up to `until` (clamped to the file length); then the
        oldest beyond the limit are dropped, never those of the request [first, end)."""
        until = min(until, attr.length)
        for index in range(offset // self._seg, -(-until // self._seg)):
            if index not in self._segments:
                start = index * self._seg
                lease = self._pool.acquire(min(self._seg, attr.length - start))
                task = asyncio.ensure_future(self._aio.read_into(attr, start, lease.view))
                self._segments[index] = _Segment(index, lease, task)
        excess = len(self._segments) - (2 * self._window_max // self._seg + SEGMENTS_SLACK)
        if excess > 0:
            lo, hi = first // self._seg, (end - 1) // self._seg
            for s in sorted(self._segments.values(), key=lambda s: s.index):
                if excess <= 0:
                    break
                if not lo <= s.index <= hi:  # the oldest, which nobody asked for (a jump, or a stop)
                    self._evict(s)
                    excess -= 1

    async def _gather(self, offset: int, end: int) -> tuple[list[memoryview], list[_Segment]]:
        """Wait for the segments of [offset, end) (all scheduled) and return their pieces of it."""
        seg = self._seg
        segs = [self._segments[i] for i in range(offset // seg, (end - 1) // seg + 1)]
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
            base = s.index * seg
            pieces.append(s.lease.view[max(offset, base) - base:max(0, min(end, base + n) - base)])
        return pieces, segs

    def _served(self, segs: list[_Segment], pieces: list[memoryview], release_later, end: int = 0,
                hold: bool = False, always: bool = False) -> Held | None:
        """Account the pieces handed out (of a read that ended at `end`); segments served in full go
        back to the pool after the reply. hold: lend the last segment to the caller if bytes of it
        remain past `end` (or always)."""
        held = None
        for k, (s, piece) in enumerate(zip(segs, pieces)):
            s.served += len(piece)
            mine = self._segments.get(s.index) is s
            if hold and k == len(segs) - 1:
                base = s.index * self._seg
                view = s.lease.view[:s.task.result()]  # done: _gather waited for it
                if always or end < base + len(view):
                    if mine:
                        del self._segments[s.index]
                    s.readers += 1
                    held = Held(base, view, s)
                    self._stream_end = max(self._stream_end, held.end)
                    continue
            if mine and s.served < len(s.lease.view):
                continue  # more of it is still to be asked for
            if mine:
                del self._segments[s.index]
            if s.readers == 0:
                release_later(s.lease.release)  # after this reply, which may be a view of it
        return held


def _now(fn) -> None:
    fn()


# -- write-behind --------------------------------------------------------------------------------
class WriteBehind:
    def __init__(self, aio, attr: m.InodeAttr, segment_bytes: int, bytes_max: int):
        assert segment_bytes > 0
        self._aio = aio
        self.attr = attr  # the file written (its layout and inode); keep it current after a truncate
        self._seg = segment_bytes
        self._max = max(segment_bytes, bytes_max)
        self._buf: memoryview | None = None  # the open buffer: bytes [_buf_off, _buf_off + _buf_len)
        self._buf_off = 0
        self._buf_len = 0
        self._tasks: dict[asyncio.Task, tuple[int, int]] = {}  # writes in flight -> [begin, end)
        self._inflight_bytes = 0
        self._unsent = 0  # pieces taken out of the buffer, not yet a write in flight (_send waits)
        self._free: list[memoryview] = []
        self._error: BaseException | None = None
        self.acked_end = -1  # highest end storage acknowledged
        self.failed = False  # a background write failed: only acknowledged bytes count for the length
        self._lock = asyncio.Lock()

    @property
    def dirty(self) -> bool:
        """Bytes buffered, on their way to storage or in flight (a read must flush them first to see
        them). On their way: _send took a piece out of the buffer and waits for an overlapping write or
        for room before it becomes a write in flight; the buffer is empty then, and once the write it
        waits for is over nothing is in flight either (the FUSE daemon's read of a page skipped the flush
        there, read the bytes from before it, and the kernel wrote them back: docs/fuse.md)."""
        return self._buf is not None or bool(self._tasks) or self._unsent > 0

    def acknowledged(self, written_end: int) -> int:
        """The length a writer that wrote up to written_end may publish: all of it, or after a failed
        write only what storage acknowledged."""
        return min(written_end, self.acked_end) if self.failed else written_end

    def discard_before(self, length: int) -> None:
        """After a truncate to `length`, acknowledged ends past it no longer mean anything."""
        self.acked_end = min(self.acked_end, length)

    def raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def stage(self, offset: int, data: memoryview, immutable: bool = False) -> int:
        """Copy the longest prefix of data into the open buffer that continues it without filling it;
        returns its size (0: write() must take it, which needs the loop). No await, so File calls it
        from its caller's thread, which is safe while no coroutine of this writer runs (File's lock)."""
        if self._buf is None:
            if immutable and offset % self._seg == 0 and len(data) >= self._seg:
                return 0  # goes out uncopied
            self._buf, self._buf_off, self._buf_len = self._new_buffer(), offset, 0
        elif offset != self._buf_off + self._buf_len:
            return 0
        room = self._seg - self._buf_off % self._seg - self._buf_len
        take = min(room - 1, len(data))
        if take <= 0:
            return 0
        assert self._buf_len + take < self._seg, "a staged buffer never fills (write() sends it)"
        self._buf[self._buf_len:self._buf_len + take] = data[:take]
        self._buf_len += take
        return take

    async def write(self, offset: int, data, immutable: bool = True) -> None:
        """Buffer data at offset (sending what fills a segment). immutable: data cannot change after
        the call (bytes), so whole segments of it go out uncopied."""
        # The kernel sends a handle's writes concurrently; they take turns here, in arrival order,
        # because a write may wait for room in flight while the buffer state must stay its own.
        async with self._lock:
            self.raise_error()
            view = data if isinstance(data, memoryview) else memoryview(data)
            while view:
                taken = await self._piece(offset, view, immutable)
                view = view[taken:]
                offset += taken

    async def flush(self) -> None:
        """Everything written so far is on storage when this returns (or its error is raised)."""
        async with self._lock:
            await self._send_buffer()
            while self._tasks:
                await asyncio.wait(list(self._tasks))
            self.raise_error()

    def _new_buffer(self) -> memoryview:
        return self._free.pop() if self._free else aligned_buffer(self._seg)

    async def _piece(self, offset: int, view: memoryview, immutable: bool) -> int:
        if self._buf is not None and offset != self._buf_off + self._buf_len:
            await self._send_buffer()  # not contiguous: the buffered bytes go out first
        if self._buf is None:
            if immutable and offset % self._seg == 0 and len(view) >= self._seg:
                whole = len(view) // self._seg * self._seg
                await self._send(offset, view[:whole], None)
                return whole
            self._buf, self._buf_off, self._buf_len = self._new_buffer(), offset, 0
        room = self._seg - self._buf_off % self._seg - self._buf_len  # buffers end on a segment boundary
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
        self._unsent += 1  # dirty until it is a write in flight
        try:
            overlapping = [t for t, (b, e) in self._tasks.items() if b < end and offset < e]
            if overlapping:  # a write to the same bytes still in flight must land first
                await asyncio.wait(overlapping)
            while self._tasks and self._inflight_bytes + len(data) > self._max:
                await asyncio.wait(list(self._tasks), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._unsent -= 1
        task = asyncio.ensure_future(self._aio.write_at(self.attr, offset, data))
        self._tasks[task] = (offset, end)
        self._inflight_bytes += len(data)
        task.add_done_callback(lambda t: self._done(t, owned))

    def _done(self, task: asyncio.Task, owned: memoryview | None) -> None:
        begin, end = self._tasks.pop(task)
        self._inflight_bytes -= end - begin
        err = asyncio.CancelledError() if task.cancelled() else task.exception()
        if err is None:
            self.acked_end = max(self.acked_end, end)
        else:
            self.failed = True
            if self._error is None:
                self._error = err
        if owned is not None and len(self._free) < WRITE_FREE_BUFFERS_MAX:
            self._free.append(owned)


__all__ = ["Held", "ReadAhead", "SEGMENT_BYTES_MAX", "SEGMENT_BYTES_MIN", "WriteBehind", "segment_bytes"]
