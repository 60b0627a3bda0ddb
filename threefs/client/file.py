"""File objects over the client, so io, shutil, numpy, pandas and pyarrow work on threefs files.

`File` (what `Client.open` returns by default) is an `io.BufferedIOBase` with
- read-ahead: reads that continue where the last one ended prefetch the next bytes in chunk-aligned
  segments, several in flight, the window doubling up to `read_ahead_bytes`; a read of at least one
  segment that nothing prefetched goes straight into the caller's buffer (no copy);
- write-behind: writes fill chunk-aligned buffers; a full buffer is written to storage in the
  background (its chunks in parallel) while the caller goes on, up to `write_behind_bytes` in flight.
  Errors of background writes surface at the next write, flush() or close().
`RawFile` (`buffering=0`) sends every call straight to storage.

Both publish the file length to meta at close (and at fsync()); it is exact after close.

Like io's buffered files, a file object may be used from several threads: each call holds the object's
lock, so calls run one at a time (a read never sees another thread's seek half-way). A seek() followed
by a read() is still two calls; threads sharing one object without their own lock see each other's
position, as with any Python file.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import io
import os
import threading

import msgspec

from threefs.cluster.storage_client import RETRY_S
from threefs.common import limits
from threefs.common.buffers import aligned_buffer
from threefs.common.config import CLIENT_TIMEOUT_S_DEFAULT
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.client import as_bytes_view
from threefs.rpc.schemas import meta as m

READ_AHEAD_BYTES_DEFAULT = 16 * limits.MiB
WRITE_BEHIND_BYTES_DEFAULT = 64 * limits.MiB
SEGMENT_BYTES_MIN = 1 * limits.MiB  # smaller chunks are grouped into segments of at least this size
SEGMENT_BYTES_MAX = 8 * limits.MiB
PEEK_BYTES_MAX = 8 * limits.KiB
FREE_BUFFERS_MAX = 8  # segment buffers kept per file for reuse (fresh pages cost a fault per 4 KiB)
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


def segment_bytes(chunk_size: int) -> int:
    """IO unit of read-ahead and write-behind: whole chunks of at least SEGMENT_BYTES_MIN in total,
    or SEGMENT_BYTES_MAX of a larger chunk."""
    if chunk_size >= SEGMENT_BYTES_MAX:
        return SEGMENT_BYTES_MAX
    return -(-SEGMENT_BYTES_MIN // chunk_size) * chunk_size


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
        aio, inode, session = self._client.aio, self._attr.inode, self._session
        hint = self._written_end
        if hint >= 0 and (self._truncated or not end_session):
            self._attr = self._client.run(aio.sync_file(inode, session, hint, self._attr.truncate_ver))
            hint = -1
        if end_session and session:
            self._attr = self._client.run(aio.close_file(inode, session, hint))
        elif end_session and hint >= 0:  # written without a session (cannot happen via open())
            self._attr = self._client.run(aio.sync_file(inode, "", hint, self._attr.truncate_ver))


class RawFile(_Handle, io.RawIOBase):
    """Unbuffered: each read/write is one parallel storage operation on the caller's memory."""

    def __init__(self, client, path: str, rsp: m.OpenRsp, flags: int, readable: bool, writable: bool):
        io.RawIOBase.__init__(self)
        self._init_handle(client, path, rsp, flags, readable, writable)

    @_serialised
    def readinto(self, b) -> int:
        self._check_readable()
        n = self._client.run(self._client.aio.read_into(self._attr_now(), self._pos, b))
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


class _Segment:
    """Bytes [offset, offset + nbytes) of the file being prefetched into buf (or already there)."""

    __slots__ = ("offset", "nbytes", "buf", "future", "length")

    def __init__(self, offset: int, nbytes: int, buf: memoryview, future):
        self.offset, self.nbytes, self.buf, self.future = offset, nbytes, buf, future
        self.length = -1  # bytes read, known once the future is done

    def end(self) -> int:
        return self.offset + self.nbytes


class File(_Handle, io.BufferedIOBase):
    """Buffered file with read-ahead and write-behind (see the module docstring)."""

    def __init__(self, client, path: str, rsp: m.OpenRsp, flags: int, readable: bool, writable: bool,
                 *, read_ahead_bytes: int = READ_AHEAD_BYTES_DEFAULT,
                 write_behind_bytes: int = WRITE_BEHIND_BYTES_DEFAULT):
        io.BufferedIOBase.__init__(self)
        self._init_handle(client, path, rsp, flags, readable, writable)
        self._seg_bytes = segment_bytes(rsp.attr.layout.chunk_size) if rsp.attr.layout else 0
        self._ra_max = max(0, read_ahead_bytes)
        self._wb_max = max(self._seg_bytes, write_behind_bytes)
        self._free: list[memoryview] = []
        # read-ahead
        self._segments: collections.deque[_Segment] = collections.deque()
        self._seq_pos = 0  # where a sequential reader's next read starts
        self._window = 0
        # write-behind
        self._wbuf: memoryview | None = None
        self._wbuf_off = 0
        self._wbuf_len = 0
        self._inflight: collections.deque = collections.deque()  # (future, begin, end, buffer)
        self._inflight_bytes = 0
        self._acked_end = -1  # highest end of a write storage acknowledged
        self._write_failed = False  # then only acknowledged bytes count for the length
        self._error: BaseException | None = None

    # -- plumbing --------------------------------------------------------------------------------
    def _submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._client._loop.loop)

    def _buffer(self) -> memoryview:
        return self._free.pop() if self._free else aligned_buffer(self._seg_bytes)

    def _recycle(self, buf: memoryview) -> None:
        if len(buf) == self._seg_bytes and len(self._free) < FREE_BUFFERS_MAX:
            self._free.append(buf)

    @_serialised
    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._seek_to(offset, whence)

    def detach(self):
        raise io.UnsupportedOperation("threefs files cannot be detached")

    # -- write-behind ----------------------------------------------------------------------------
    @_serialised
    def write(self, b) -> int:
        self._check_writable()
        self._raise_error()
        if self.mode_flags & os.O_APPEND:
            self._pos = self._length()
        data = as_bytes_view(b)
        n = len(data)
        if n and self._segments:
            self._drop_read_ahead()
        while data:
            taken = self._write_piece(data, immutable=isinstance(b, bytes))
            data = data[taken:]
            self._pos += taken
        self._written_end = max(self._written_end, self._pos)
        return n

    def _write_piece(self, data: memoryview, immutable: bool) -> int:
        """Put a prefix of data into the write-behind buffer (or send it as is); returns its size."""
        seg = self._seg_bytes
        if self._wbuf is not None and self._pos != self._wbuf_off + self._wbuf_len:
            self._send_buffer()  # not contiguous: what is buffered goes out first
        if self._wbuf is None:
            if immutable and self._pos % seg == 0 and len(data) >= seg:
                whole = len(data) // seg * seg  # bytes cannot change under us: send them uncopied
                self._send(self._pos, data[:whole], None)
                return whole
            self._wbuf, self._wbuf_off, self._wbuf_len = self._buffer(), self._pos, 0
        room = seg - (self._wbuf_off % seg) - self._wbuf_len  # buffers end on a segment boundary
        take = min(room, len(data))
        self._wbuf[self._wbuf_len:self._wbuf_len + take] = data[:take]
        self._wbuf_len += take
        if take == room:
            self._send_buffer()
        return take

    def _send_buffer(self) -> None:
        if self._wbuf is None:
            return
        buf, off, n = self._wbuf, self._wbuf_off, self._wbuf_len
        self._wbuf = None
        if n:
            self._send(off, buf[:n], buf)
        else:
            self._recycle(buf)

    def _send(self, offset: int, data: memoryview, owned: memoryview | None) -> None:
        """Start writing data at offset in the background, keeping writes to one range in order."""
        end = offset + len(data)
        for fut, begin, e, _ in list(self._inflight):  # an overlapping write in flight goes first
            if begin < end and offset < e and not fut.done():
                self._wait_until(fut)
        while self._inflight and self._inflight_bytes + len(data) > self._wb_max:
            self._reap_oldest()
        fut = self._submit(self._client.aio.write_at(self._attr, offset, data))
        self._inflight.append((fut, offset, end, owned))
        self._inflight_bytes += len(data)

    def _wait_until(self, fut) -> None:
        while self._inflight and not fut.done():
            self._reap_oldest()
        self._reap_done()

    def _reap_oldest(self) -> None:
        fut, begin, end, owned = self._inflight.popleft()
        self._inflight_bytes -= end - begin
        try:
            _result(fut, "a write-behind write")
            self._acked_end = max(self._acked_end, end)
        except BaseException as e:  # kept, raised at the next call: the caller's write() returned
            self._write_failed = True
            if self._error is None:
                self._error = e
        if owned is not None:
            self._recycle(owned)

    def _reap_done(self) -> None:
        while self._inflight and self._inflight[0][0].done():
            self._reap_oldest()

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _drain_writes(self) -> None:
        self._send_buffer()
        while self._inflight:
            self._reap_oldest()

    @_serialised
    def flush(self) -> None:
        """Wait until every byte written so far is on storage (raises a failed background write)."""
        if self.closed or self._other_process():
            return
        self._drain_writes()
        self._raise_error()

    @_serialised
    def fsync(self) -> None:
        """flush(), then publish the length to meta so other clients see it before close."""
        self.flush()
        self._publish_length(end_session=False)

    def _publish_length(self, end_session: bool) -> None:
        if self._write_failed:
            self._written_end = min(self._written_end, self._acked_end)
        super()._publish_length(end_session)

    @_serialised
    def truncate(self, size: int | None = None) -> int:
        self.flush()
        self._drop_read_ahead()
        return self._truncate_meta(size)

    # -- read-ahead ------------------------------------------------------------------------------
    @_serialised
    def read(self, size: int | None = -1) -> bytes:
        self._check_readable()
        self._before_read()
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
        self._before_read()
        return self._read_into(as_bytes_view(b))

    readinto1 = readinto

    @_serialised
    def peek(self, size: int = 0) -> bytes:
        """Bytes at the position without moving it: at least one unless at the end of the file, at
        most PEEK_BYTES_MAX (io's readline() peeks once per line)."""
        self._check_readable()
        self._before_read()
        if self._pos >= self._length():
            return b""
        head = self._segments[0] if self._segments else None
        if head is None or not head.offset <= self._pos < head.end():
            self._drop_read_ahead()
            self._schedule(self._pos, max(size, 1))
            head = self._segments[0]
        self._seq_pos = self._pos
        start = self._pos - head.offset
        stop = min(self._segment_length(head), start + max(size, PEEK_BYTES_MAX))
        return bytes(head.buf[start:stop])

    def _before_read(self) -> None:
        if self._wbuf is not None or self._inflight:  # reads must see our own buffered writes
            self.flush()

    def _read_into(self, dest: memoryview) -> int:
        """Serve from prefetched segments; read a jump or a large request straight into dest."""
        n = max(0, min(len(dest), self._length() - self._pos))
        sequential = self._pos == self._seq_pos
        if not sequential:  # what was prefetched is for somewhere else
            self._drop_read_ahead()
            self._window = 0
        done = 0
        while done < n:
            head = self._segments[0] if self._segments else None
            if head is not None and head.offset <= self._pos < head.end():
                done += self._copy_from(head, dest[done:n])
                continue
            if head is not None:
                self._drop_read_ahead()
            if not sequential or n - done >= self._seg_bytes:
                got = self._client.run(self._client.aio.read_into(self._attr_now(), self._pos,
                                                                   dest[done:n]))
                self._pos += got
                done += got
                break
            self._schedule(self._pos, n - done)
        self._seq_pos = self._pos
        if sequential and done and self._ra_max:
            self._window = min(self._ra_max, max(self._window * 2, 2 * self._seg_bytes))
            self._schedule(self._pos, self._window)
        return done

    def _copy_from(self, seg: _Segment, dest: memoryview) -> int:
        start = self._pos - seg.offset
        have = self._segment_length(seg) - start
        assert have > 0, "segments are read up to the length they were scheduled for"
        take = min(have, len(dest))
        dest[:take] = seg.buf[start:start + take]
        self._pos += take
        if self._pos >= seg.end():
            self._segments.popleft()
            self._recycle(seg.buf)
        return take

    def _segment_length(self, seg: _Segment) -> int:
        if seg.length < 0:
            seg.length = _result(seg.future, "a read-ahead read")
        return seg.length

    def _schedule(self, pos: int, nbytes: int) -> None:
        """Have segments in flight covering [pos, pos + nbytes), clamped to the file length."""
        seg = self._seg_bytes
        end = min(self._length(), pos + nbytes)
        next_off = self._segments[-1].end() if self._segments else pos
        attr = self._attr_now()
        while next_off < end:
            seg_end = min((next_off // seg + 1) * seg, self._length())
            buf = self._buffer()
            fut = self._submit(self._client.aio.read_into(attr, next_off, buf[:seg_end - next_off]))
            self._segments.append(_Segment(next_off, seg_end - next_off, buf, fut))
            next_off = seg_end

    def _drop_read_ahead(self) -> None:
        while self._segments:
            s = self._segments.popleft()
            if s.future.done():
                self._recycle(s.buf)
            else:  # the loop may still write into s.buf: let it finish, never reuse that buffer
                s.future.cancel()

    # -- close -----------------------------------------------------------------------------------
    @_serialised
    def close(self) -> None:
        if self.closed:
            return
        if self._other_process():  # the parent's session and in-flight IO: leave them to the parent
            io.BufferedIOBase.close(self)
            return
        try:
            self._drop_read_ahead()
            err = None
            try:
                self._drain_writes()
            except BaseException as e:
                err = e
            err = err or self._error
            self._error = None
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
