"""File objects over the client, so io, shutil, numpy, pandas and pyarrow work on threefs files.

`File` (what `Client.open` returns by default) is an `io.BufferedIOBase` with
- read-ahead: reads that continue where the last one ended prefetch the next bytes in chunk-aligned
  segments, several in flight, the window doubling up to `read_ahead_bytes`; a read of at least one
  segment that nothing prefetched goes straight into the caller's buffer (no copy);
- write-behind: writes fill chunk-aligned buffers; a full buffer is written to storage in the
  background (its chunks in parallel) while the caller goes on, up to `write_behind_bytes` in flight.
  Errors of background writes surface at the next write, flush() or close().
Both are the streaming engine of client/stream.py (the FUSE daemon uses it too), run on the client's
event loop: a call that needs the engine makes one trip to the loop (waited for at most IO_WAIT_S);
reads served from the segments the engine lent the file (waiting for their reads in the caller's
thread, handing them back without waiting) and small writes that fit the open write buffer make none.
`RawFile` (`buffering=0`) sends every call straight to storage.

Both publish the file length to meta at close (and at fsync()); it is exact after close.

Like io's buffered files, a file object may be used from several threads: each call holds the object's
lock, so calls run one at a time (a read never sees another thread's seek half-way). A seek() followed
by a read() is still two calls; threads sharing one object without their own lock see each other's
position, as with any Python file.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import io
import os
import threading

import msgspec

from threefs.client.stream import SEGMENT_BYTES_MIN, Held, ReadAhead, WriteBehind, segment_bytes
from threefs.cluster.storage_client import RETRY_S
from threefs.common import limits
from threefs.common.buffers import BufferPool
from threefs.common.config import CLIENT_TIMEOUT_S_DEFAULT
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.client import as_bytes_view
from threefs.rpc.schemas import meta as m

READ_AHEAD_BYTES_DEFAULT = 16 * limits.MiB
# A read that does not continue the previous one (a jump: random access) and is at most this long is read from
# the caller's thread (Client._read_at: the blocking storage path batch_read takes), not on the loop
JUMP_READ_BYTES_MAX = 4 * limits.MiB
WRITE_BEHIND_BYTES_DEFAULT = 64 * limits.MiB
PEEK_BYTES_MAX = 8 * limits.KiB
FREE_BUFFERS_MAX = 8  # read segment buffers kept per file for reuse (fresh pages cost a fault per 4 KiB)
# The longest a caller waits for an IO in flight: the storage client's retry window plus two calls of the
# default timeout. The IO's own deadlines end it sooner; this bounds the wait even if they did not.
IO_WAIT_S = RETRY_S + 2 * CLIENT_TIMEOUT_S_DEFAULT


def _result(fut, what: str):
    """The result of a concurrent future of the client's loop, waited for at most IO_WAIT_S."""
    import concurrent.futures

    try:
        return fut.result(timeout=IO_WAIT_S)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        raise status_error(StatusCode.TIMEOUT, f"{what} did not finish in {IO_WAIT_S:.0f} s") from None


def _serialised(method):
    """Run a file method under the object's lock (see the module docstring). A file opened before a
    fork is not locked in the child: the method refuses or ignores it without waiting for a lock some
    thread of the parent may have held at the fork."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        if self._other_process():
            return method(self, *args, **kwargs)
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


def _with_length(a: m.InodeAttr, length: int) -> m.InodeAttr:
    return msgspec.structs.replace(a, length=length)


class _Handle:
    """What both file classes share: the open session, position, length bookkeeping, close."""

    def _init_handle(self, client, path: str, rsp: m.OpenRsp, flags: int, readable: bool,
                     writable: bool) -> None:
        self._lock = threading.RLock()
        self._client = client
        self._generation = client._generation  # a forked child must reopen (see Client)
        self.name = path
        self.mode_flags = flags
        self._attr = rsp.attr
        self._session = rsp.session
        self._readable, self._writable = readable, writable
        self._pos = self._attr.length if flags & os.O_APPEND else 0
        self._written_end = -1  # highest byte end written through this object (-1: none)
        self._truncated = False

    @property
    def attr(self) -> m.InodeAttr:
        return self._attr

    def _other_process(self) -> bool:
        """Opened by the parent of a fork: its session and in-flight IO belong to the parent."""
        return self._client._forked or self._client._generation != self._generation

    def _checkClosed(self, *args) -> None:
        super()._checkClosed(*args)
        if self._other_process():
            raise status_error(StatusCode.BAD_FILE_HANDLE, f"{self.name} was opened before this "
                               "process was forked; reopen it here (the client reconnects by itself)")

    def readable(self) -> bool:
        return self._readable

    def writable(self) -> bool:
        return self._writable

    def seekable(self) -> bool:
        return True

    def _length(self) -> int:
        return max(self._attr.length, self._written_end)

    def _attr_now(self) -> m.InodeAttr:
        """The attr with our own writes' length, so reads see them."""
        if self._written_end > self._attr.length:
            return _with_length(self._attr, self._written_end)
        return self._attr

    def _check_readable(self) -> None:
        self._checkClosed()
        if not self._readable:
            raise io.UnsupportedOperation("file not open for reading")

    def _check_writable(self) -> None:
        self._checkClosed()
        if not self._writable:
            raise io.UnsupportedOperation("file not open for writing")

    def _seek_to(self, offset: int, whence: int) -> int:
        self._checkClosed()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length()}.get(whence)
        if base is None:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"invalid whence {whence}")
        if base + offset < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    @_serialised
    def tell(self) -> int:
        self._checkClosed()
        return self._pos

    def fileno(self) -> int:
        raise io.UnsupportedOperation("threefs files have no OS file descriptor (use the FUSE mount)")

    def _truncate_meta(self, size: int | None) -> int:
        self._check_writable()
        size = self._pos if size is None else size
        if size < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"negative size {size}")
        # by inode: the file may have been renamed since it was opened
        self._attr = self._client.run(self._client.aio.setattr("", parent=self._attr.inode, length=size))
        self._written_end = -1  # the new length is in meta; a later close must not re-extend it
        self._truncated = True  # the session's truncate version is stale now: hints go with attr's
        return size

    def _publish_length(self, end_session: bool) -> None:
        """Tell meta the length we wrote up to (valid for the truncate version we know), and end
        the write session if asked."""
        client, inode, session = self._client, self._attr.inode, self._session
        hint = self._written_end
        if hint >= 0 and (self._truncated or not end_session):
            self._attr = client._sync_file(inode, session, hint, self._attr.truncate_ver)
            hint = -1
        if end_session and session and hint < 0:  # nothing (more) to publish: only the session ends
            client._end_session_later(inode, session)
        elif end_session and session:
            self._attr = client._close_file(inode, session, hint)
        elif end_session and hint >= 0:  # written without a session (cannot happen via open())
            self._attr = client._sync_file(inode, "", hint, self._attr.truncate_ver)


class RawFile(_Handle, io.RawIOBase):
    """Unbuffered: each read/write is one parallel storage operation on the caller's memory."""

    def __init__(self, client, path: str, rsp: m.OpenRsp, flags: int, readable: bool, writable: bool):
        io.RawIOBase.__init__(self)
        self._init_handle(client, path, rsp, flags, readable, writable)

    @_serialised
    def readinto(self, b) -> int:
        self._check_readable()
        dest = as_bytes_view(b)
        n = max(0, min(len(dest), self._length() - self._pos))
        if n:
            n = self._client._read_at(self._attr_now(), self._pos, dest[:n])  # from this thread where it can
        self._pos += n
        return n

    @_serialised
    def write(self, b) -> int:
        self._check_writable()
        if self.mode_flags & os.O_APPEND:
            self._pos = self._length()
        n = self._client.run(self._client.aio.write_at(self._attr, self._pos, b))
        self._pos += n
        self._written_end = max(self._written_end, self._pos)
        return n

    @_serialised
    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._seek_to(offset, whence)

    @_serialised
    def truncate(self, size: int | None = None) -> int:
        return self._truncate_meta(size)

    @_serialised
    def fsync(self) -> None:
        """Publish the length written so far to meta (the data is already on storage)."""
        self._checkClosed()
        self._publish_length(end_session=False)

    @_serialised
    def close(self) -> None:
        if self.closed:
            return
        if self._other_process():  # the parent's session: leave it to the parent
            io.RawIOBase.close(self)
            return
        try:
            self._publish_length(end_session=True)
        finally:
            io.RawIOBase.close(self)


class File(_Handle, io.BufferedIOBase):
    """Buffered file with read-ahead and write-behind (see the module docstring): the streaming engine
    of client/stream.py, driven from the caller's thread on the client's loop, one hop per call at
    most. Small reads are served from a segment the engine lends (`Held`) and small writes are staged
    into the open write buffer, both without a hop."""

    def __init__(self, client, path: str, rsp: m.OpenRsp, flags: int, readable: bool, writable: bool,
                 *, read_ahead_bytes: int = READ_AHEAD_BYTES_DEFAULT,
                 write_behind_bytes: int = WRITE_BEHIND_BYTES_DEFAULT):
        io.BufferedIOBase.__init__(self)
        self._init_handle(client, path, rsp, flags, readable, writable)
        layout = rsp.attr.layout
        seg = segment_bytes(layout.chunk_size) if layout else SEGMENT_BYTES_MIN
        self._seg_bytes = seg
        aio = client.aio
        # exact continuation (one thread's calls, in order); the window starts at two segments
        self._reader = ReadAhead(aio, BufferPool(bytes_max=FREE_BUFFERS_MAX * seg), seg,
                                 max(0, read_ahead_bytes), slack_bytes=0, window_start_bytes=2 * seg)
        self._writer = WriteBehind(aio, rsp.attr, seg, write_behind_bytes) if writable else None
        self._held: collections.deque[Held] = collections.deque()  # read segments lent by the engine
        # lent by the engine's advance() on the loop, tagged with the epoch they were asked for in: an
        # entry from before the last let-go (a write, a jump, a truncate) is given back unused
        self._incoming: collections.deque[tuple[int, Held]] = collections.deque()
        self._epoch = 0
        self._advancing: concurrent.futures.Future | None = None  # the last advance sent to the loop
        self._to_release: list[Held] = []  # held segments to give back at the next hop
        self._stale = False  # written since the last read: what was prefetched is dropped first
        self._last_end = 0  # where the last read ended: a read starting elsewhere is a jump
        self._jump_end: int | None = None  # a jump read from this thread ended here: the engine's stream restarts there
        self._hopped = False  # [meta] the engine ran on the loop for this file (else close needs no hop)

    # -- plumbing --------------------------------------------------------------------------------
    def _hop(self, coro, what: str):
        """Run a coroutine of the engine on the client's loop and wait for it (IO_WAIT_S at most)."""
        lt = self._client._loop
        if lt is None:
            coro.close()
            raise status_error(StatusCode.INVALID_ARGUMENT, "client is closed")
        self._hopped = True
        return _result(lt.submit(coro), what)

    def _let_go_of_held(self) -> None:
        self._epoch += 1
        self._advancing = None
        self._to_release.extend(self._held)
        self._held.clear()
        while self._incoming:
            self._to_release.append(self._incoming.popleft()[1])

    def _settle(self) -> None:
        """On the loop, first thing in a hop: give back held segments, drop stale read-ahead."""
        for h in self._to_release:
            self._reader.release(h)
        self._to_release.clear()
        if self._stale:
            self._reader.drop()
            self._stale = False

    @_serialised
    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._seek_to(offset, whence)

    def detach(self):
        raise io.UnsupportedOperation("threefs files cannot be detached")

    # -- write-behind ----------------------------------------------------------------------------
    @_serialised
    def write(self, b) -> int:
        self._check_writable()
        w = self._writer
        w.raise_error()
        if self.mode_flags & os.O_APPEND:
            self._pos = self._length()
        data = as_bytes_view(b)
        n = len(data)
        if n:
            self._let_go_of_held()  # what was read ahead may be old now
            self._stale = True
            immutable = isinstance(b, bytes)  # bytes cannot change under us: whole segments go uncopied
            taken = w.stage(self._pos, data, immutable)
            if taken < n:
                self._hop(w.write(self._pos + taken, data[taken:], immutable), "a write")
            self._pos += n
            self._written_end = max(self._written_end, self._pos)
        return n

    @_serialised
    def flush(self) -> None:
        """Wait until every byte written so far is on storage (raises a failed background write)."""
        if self.closed or self._other_process() or self._writer is None:
            return
        if self._writer.dirty:
            self._hop(self._writer.flush(), "flushing writes")
        else:
            self._writer.raise_error()

    @_serialised
    def fsync(self) -> None:
        """flush(), then publish the length to meta so other clients see it before close."""
        self.flush()
        self._publish_length(end_session=False)

    def _publish_length(self, end_session: bool) -> None:
        if self._writer is not None:  # after a failed write only acknowledged bytes count
            self._written_end = self._writer.acknowledged(self._written_end)
        super()._publish_length(end_session)

    @_serialised
    def truncate(self, size: int | None = None) -> int:
        self.flush()
        self._let_go_of_held()
        self._stale = True
        size = self._truncate_meta(size)
        self._writer.discard_before(size)
        self._writer.attr = self._attr
        return size

    # -- read-ahead ------------------------------------------------------------------------------
    @_serialised
    def read(self, size: int | None = -1) -> bytes:
        self._check_readable()
        n = self._length() - self._pos if size is None or size < 0 else size
        n = max(0, min(n, self._length() - self._pos))
        buf = bytearray(n)
        got = self._read_into(memoryview(buf))
        del buf[got:]
        return bytes(buf)

    @_serialised
    def read1(self, size: int = -1) -> bytes:
        return self.read(size)

    @_serialised
    def readinto(self, b) -> int:
        self._check_readable()
        return self._read_into(as_bytes_view(b))

    readinto1 = readinto

    @_serialised
    def peek(self, size: int = 0) -> bytes:
        """Bytes at the position without moving it: at least one unless at the end of the file, at
        most PEEK_BYTES_MAX (io's readline() peeks once per line)."""
        self._check_readable()
        if self._pos >= self._length():
            return b""
        h = self._head()
        if h is None or not h.covers(self._pos):
            self._let_go_of_held()
            h = self._hop(self._hold_step(self._attr_now(), self._pos, max(size, 1)), "a read-ahead read")
            if h is None:
                return b""
            self._held.append(h)
        self._wait_for(h)
        start = self._pos - h.offset
        return bytes(h.view[start:start + max(size, PEEK_BYTES_MAX)])

    def _skip_held(self) -> None:
        """Held segments the position has moved past exactly (a sequential reader) are done with: the
        engine gets them back and lends what follows, without the caller waiting for the loop."""
        while self._incoming:  # one consumer (this, under the lock); the loop only appends
            epoch, h = self._incoming.popleft()
            (self._held if epoch == self._epoch else self._to_release).append(h)
        done_with = []
        while self._held and self._pos == self._held[0].end:
            done_with.append(self._held.popleft())
        lt = self._client._loop
        if done_with and lt is not None:
            self._advancing = fut = concurrent.futures.Future()
            lt.loop.call_soon_threadsafe(self._advance, self._epoch, self._attr_now(), self._pos, done_with,
                                         fut)
        elif done_with:
            self._to_release.extend(done_with)

    def _advance(self, epoch: int, attr: m.InodeAttr, pos: int, done_with: list[Held],
                 fut: concurrent.futures.Future) -> None:
        """On the loop: give lent segments back, have the next ones lent (they arrive in _incoming)."""
        try:
            self._incoming.extend((epoch, h) for h in self._reader.advance(attr, pos, done_with))
        finally:
            fut.set_result(None)

    def _head(self) -> Held | None:
        """The first held segment, once past the ones read through; when they ran out, the segments the
        last advance lends (waiting for the loop once costs less than a trip there and back)."""
        self._skip_held()
        if not self._held and self._advancing is not None:
            fut, self._advancing = self._advancing, None
            try:
                fut.result(IO_WAIT_S)
            except concurrent.futures.TimeoutError:
                return None  # then the caller's trip to the loop reads on
            self._skip_held()
        return self._held[0] if self._held else None

    def _read_into(self, dest: memoryview) -> int:
        """From the held segments what they have, the rest in one hop (read-ahead, or straight into
        dest)."""
        n = max(0, min(len(dest), self._length() - self._pos))
        done = 0
        while done < n:
            h = self._head()
            if h is None or not h.covers(self._pos):
                break
            self._wait_for(h)
            start = self._pos - h.offset
            take = min(n - done, len(h.view) - start)
            dest[done:done + take] = h.view[start:start + take]
            self._pos += take
            done += take
        if done < n and self._jump_here(n - done):
            got = self._client._read_at(self._attr_now(), self._pos, dest[done:n])
            self._pos += got
            done += got
            self._jump_end = self._pos
        elif done < n:
            self._let_go_of_held()
            got, held = self._hop(self._read_step(self._attr_now(), self._pos, dest[done:n]), "a read")
            self._held.extend(held)
            self._pos += got
            done += got
        self._last_end = self._pos
        return done

    def _jump_here(self, size: int) -> bool:
        """Whether the read of `size` bytes at the position is a jump to read from this thread: it does not
        start where the last read ended (the engine would not prefetch for it: random access, a footer),
        nothing lent or to give back is pending with the engine, and no write of ours is buffered (reads see
        them: the engine's path flushes first). A read from here takes no trip to the loop thread (about
        half the CPU of a small read). The engine learns where it ended at its next read (_before_read), so
        a reader going on sequentially from there starts a prefetching stream as before."""
        return (self._pos != self._last_end and size <= JUMP_READ_BYTES_MAX and not self._held
                and not self._incoming and self._advancing is None and not self._to_release and not self._stale
                and (self._writer is None or not self._writer.dirty))

    def _wait_for(self, h: Held) -> None:
        """A lent segment may still be being read: wait (IO_WAIT_S at most); its error is the read's."""
        try:
            h.wait(IO_WAIT_S)
        except concurrent.futures.TimeoutError:
            self._let_go_of_held()
            raise status_error(StatusCode.TIMEOUT, f"a read-ahead read did not finish in {IO_WAIT_S:.0f} s") \
                from None
        except BaseException:
            self._let_go_of_held()  # read again at the next call
            raise

    async def _before_read(self) -> None:
        self._settle()
        if self._jump_end is not None:  # the last read was served from the caller's thread
            self._reader.restart_at(self._jump_end)
            self._jump_end = None
        if self._writer is not None and self._writer.dirty:  # reads see our own buffered writes
            await self._writer.flush()

    async def _read_step(self, attr: m.InodeAttr, pos: int, dest: memoryview):
        await self._before_read()
        return await self._reader.read_into(attr, pos, dest, hold=True)

    async def _hold_step(self, attr: m.InodeAttr, pos: int, size: int):
        await self._before_read()
        return await self._reader.hold(attr, pos, size)

    # -- close -----------------------------------------------------------------------------------
    async def _close_step(self) -> None:
        self._let_go_of_held()
        self._settle()
        self._reader.drop()
        if self._writer is not None:
            await self._writer.flush()

    @_serialised
    def close(self) -> None:
        if self.closed:
            return
        if self._other_process():  # the parent's session and in-flight IO: leave them to the parent
            io.BufferedIOBase.close(self)
            return
        try:
            err = None
            try:
                if self._hopped or self._written_end >= 0:  # [meta] else the engine holds nothing
                    self._hop(self._close_step(), "closing")
            except BaseException as e:
                err = e
            self._publish_length(end_session=True)  # only acknowledged bytes if a write failed
            if err is not None:
                raise err
        finally:
            io.BufferedIOBase.close(self)

    def __del__(self):
        # io's finaliser would close() too, but not once the client (its event loop) is gone.
        if (not self.closed and getattr(self._client, "_loop", None) is not None
                and not self._other_process()):
            try:
                self.close()
            except Exception:
                pass


def check_buffer_writable(buf) -> memoryview:
    view = as_bytes_view(buf)
    if view.readonly:
        raise status_error(StatusCode.INVALID_ARGUMENT, "read buffer is read-only (pass a bytearray, "
                           "memoryview or writable numpy array)")
    return view


__all__ = ["File", "RawFile", "ThreeFSError", "check_buffer_writable", "segment_bytes"]
