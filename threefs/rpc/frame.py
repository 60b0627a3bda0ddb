"""Wire framing: a fixed 16-byte prefix, a msgpack header, then bulk payload bytes.

    prefix  = magic u16 | flags u16 | header_len u32 | payload_len u64     (little-endian)
    header  = msgpack Header (request id, method, status, deadline, body = the method's msgspec Struct)
    payload = raw bytes (chunk data), received straight into the caller's preallocated buffer

`FrameReader` is the incremental parser behind a `BufferedProtocol`: small frames are parsed out of a
scratch buffer; a large payload is received directly into its destination (`recv_into` by the event
loop), so the read path never copies bulk data through a reassembly buffer.
"""

from __future__ import annotations

import struct
from typing import Callable

import msgspec

from threefs.common import limits
from threefs.common.status import StatusCode, ThreeFSError, status_error

MAGIC = 0x3F53
PREFIX = struct.Struct("<HHIQ")
PREFIX_BYTES = PREFIX.size

KIND_REQUEST = 0
KIND_RESPONSE = 1
KIND_HELLO = 2
KIND_RTS = 3  # server -> client: the response to request `rid` is ready; may it be sent?
KIND_GRANT = 4  # client -> server: send the response to request `rid` now

SCRATCH_BYTES = 256 * 1024


class Header(msgspec.Struct, array_like=True):
    kind: int
    rid: int
    method: str = ""
    status: int = 0
    message: str = ""
    timeout_ms: int = 0
    body: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)
body_encoder = msgspec.msgpack.Encoder()


def encode_frame_head(header: Header, payload_len: int) -> bytes:
    """Prefix + header bytes; the payload is written separately (no concatenation of bulk data)."""
    head = _header_encoder.encode(header)
    if len(head) > limits.FRAME_HEADER_BYTES_MAX:
        raise status_error(
            StatusCode.FRAME_TOO_LARGE,
            f"request header of {len(head)} bytes exceeds {limits.FRAME_HEADER_BYTES_MAX}",
        )
    if payload_len > limits.FRAME_PAYLOAD_BYTES_MAX:
        raise status_error(
            StatusCode.FRAME_TOO_LARGE,
            f"payload of {payload_len} bytes exceeds the frame limit {limits.FRAME_PAYLOAD_BYTES_MAX}",
        )
    return PREFIX.pack(MAGIC, 0, len(head), payload_len) + head


class FrameError(ThreeFSError):
    """The byte stream cannot be trusted any more; the connection must be closed."""


class Scatter:
    """A payload destination made of several buffers, filled in order: a batch read's IOs received
    straight into their own destinations (no copy out of one receive buffer). `len()` is the bytes it holds;
    zero-length parts are dropped. With `digest` (e.g. crc32c), each part is digested as soon as it is full,
    while its bytes are still in the CPU's cache: `digests[i]` is that of parts[i] (for the parts filled)."""

    __slots__ = ("parts", "nbytes", "digest", "digests")

    def __init__(self, parts: list[memoryview], digest: Callable | None = None):
        self.parts = [p for p in parts if len(p)]
        self.nbytes = sum(map(len, self.parts))
        self.digest = digest
        self.digests: list = []

    def __len__(self) -> int:
        return self.nbytes

    def head(self, nbytes: int) -> "Scatter":
        """The first `nbytes` bytes (a payload shorter than the whole: the server trimmed its tail)."""
        out, left = [], nbytes
        for p in self.parts:
            if left <= 0:
                break
            out.append(p[:left])
            left -= len(p)
        return Scatter(out, self.digest)

    def filled(self, part: memoryview) -> None:
        """`part` (the next of `parts`) is full: digest it now, while its bytes are in cache."""
        if self.digest is not None:
            self.digests.append(self.digest(part))


# get_payload_buffer(header, payload_len) -> writable memoryview (or Scatter) of exactly payload_len bytes
PayloadAllocator = Callable[[Header, int], "memoryview | Scatter"]
FrameHandler = Callable[[Header, memoryview | None], None]


class FrameReader:
    def __init__(self, on_frame: FrameHandler, allocate: PayloadAllocator):
        self._on_frame = on_frame
        self._allocate = allocate
        self._scratch = bytearray(SCRATCH_BYTES)
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        self._direct: memoryview | None = None  # payload destination (or its current part) being filled
        self._direct_pos = 0
        self._direct_header: Header | None = None
        self._parts: list[memoryview] | None = None  # a Scatter's parts still to fill, last first
        self._payload = None  # what the frame delivers: the memoryview, or the Scatter
        self.paused = False  # set by the owner to stop delivering frames (back-pressure); see resume()

    # -- BufferedProtocol plumbing ---------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None:
            return self._direct[self._direct_pos :]
        if self._end == len(self._scratch):
            self._make_room(0)
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct is not None:
            self._direct_pos += nbytes
            if self._direct_pos == len(self._direct):
                if self._parts is not None:  # a Scatter's part is full
                    self._payload.filled(self._direct)
                if self._parts:  # on to its next part
                    self._direct, self._direct_pos = self._parts.pop(), 0
                    return
                header, payload = self._direct_header, self._payload
                self._direct = self._direct_header = self._payload = self._parts = None
                self._on_frame(header, payload)
            return
        self._end += nbytes
        self._parse()

    def drained(self) -> bool:
        """Whether every byte received so far has been delivered as frames (in `on_frame`: the frame being
        handled is the last one of this read)."""
        return self._start == self._end and self._direct is None

    def divert(self, rid: int) -> None:
        """If frame `rid`'s payload is being received directly, send its remaining bytes elsewhere.

        Called when a caller gives up on a request: its buffer must not be written after that."""
        if self._direct is not None and self._direct_header.rid == rid:
            rest = len(self._direct) - self._direct_pos + sum(map(len, self._parts or ()))
            self._direct, self._direct_pos, self._parts = memoryview(bytearray(rest)), 0, None
            self._payload = self._direct

    def resume(self) -> None:
        """Deliver frames again, starting with those already buffered while paused."""
        self.paused = False
        self._parse()

    # -- parsing ---------------------------------------------------------------------------------
    def _make_room(self, needed: int) -> None:
        """Move unparsed bytes to the front; grow the scratch when a header needs more room."""
        pending = self._end - self._start
        size = max(len(self._scratch), needed)
        if pending == len(self._scratch) and needed <= size:
            size *= 2
        if size != len(self._scratch):
            scratch = bytearray(size)
            scratch[:pending] = self._view[self._start : self._end]
            self._view.release()
            self._scratch, self._view = scratch, memoryview(scratch)
        elif self._start:
            self._scratch[:pending] = self._scratch[self._start : self._end]
        self._start, self._end = 0, pending

    def _parse(self) -> None:
        view = self._view
        while not self.paused and self._end - self._start >= PREFIX_BYTES:
            magic, _flags, hlen, plen = PREFIX.unpack_from(self._scratch, self._start)
            if magic != MAGIC:
                raise FrameError(StatusCode.PROTOCOL_ERROR, f"bad frame magic 0x{magic:04x}")
            if hlen > limits.FRAME_HEADER_BYTES_MAX or plen > limits.FRAME_PAYLOAD_BYTES_MAX:
                raise FrameError(
                    StatusCode.FRAME_TOO_LARGE,
                    f"frame with header {hlen} B / payload {plen} B exceeds the limits "
                    f"({limits.FRAME_HEADER_BYTES_MAX} B / {limits.FRAME_PAYLOAD_BYTES_MAX} B)",
                )
            hstart = self._start + PREFIX_BYTES
            pstart = hstart + hlen
            if self._end < pstart:
                if pstart - self._start > len(self._scratch):
                    self._make_room(pstart - self._start)
                return
            try:
                # bytes(): the header's Raw body would otherwise point into the scratch buffer,
                # which the next recv overwrites (msgspec.Raw is zero-copy).
                header = _header_decoder.decode(bytes(view[hstart:pstart]))
            except msgspec.DecodeError as e:
                raise FrameError(StatusCode.PROTOCOL_ERROR, f"undecodable frame header: {e}") from e
            have = min(plen, self._end - pstart)
            if plen == 0:
                self._start = pstart
                self._on_frame(header, None)
                continue
            dest = self._allocate(header, plen)
            assert len(dest) == plen
            if type(dest) is Scatter:
                parts = dest.parts[::-1]
                part, pos, at = parts.pop(), 0, pstart
                while at < pstart + have:  # the bytes already here, into the parts they belong to
                    n = min(len(part) - pos, pstart + have - at)
                    part[pos:pos + n] = view[at:at + n]
                    pos, at = pos + n, at + n
                    if pos == len(part):
                        dest.filled(part)
                        if parts:
                            part, pos = parts.pop(), 0
            else:
                dest[:have] = view[pstart : pstart + have]
                part, pos, parts = dest, have, None
            if have == plen:
                self._start = pstart + plen
                self._on_frame(header, dest)
                continue
            self._direct, self._direct_pos, self._direct_header = part, pos, header
            self._parts, self._payload = parts, dest
            self._start = self._end = 0
            return
        if self._start == self._end:
            self._start = self._end = 0


# -- file-backed payloads (zero-copy sends) ------------------------------------------------------
SEND_THREADS = 8  # threads that run file-backed sends (each blocks while its socket is full)
_send_pool = None


class FilePayload:
    """A response payload that is `count` bytes of an open file at `offset`, sent with os.sendfile from the
    page cache to the socket: no copy through user space, no read into a buffer first. `of_parts` makes one
    of several parts in a row, each a file region (fd, offset, count) or a buffer (bytes in memory: a chunk
    read with O_DIRECT, zeros): the payload of a packed read of several whole chunks.

    The wire is the same as for a buffer payload (prefix, header, then the bytes); only the sender differs.
    FramedProtocol.send hands a FilePayload to `send()` below, which takes the connection for itself (no
    other frame is written until it is done: the protocol counts as paused), writes the frame's head and
    the parts from a thread of its own (a read of bytes not in the page cache waits for the disk there, not
    in the event loop; a full socket is waited for with poll), and gives the connection back. Parts the
    sender found in the page cache (`cached`) first go out inline, as many bytes as the socket takes at
    once; only the rest, if any, goes to the thread (the hop cost more than the send: see rpc/server.py
    UNIX_SEND_BUFFER_BYTES).
    A send that fails or times out midway leaves a partial frame: the connection is aborted.

    `on_done` runs once the bytes are sent or the send gave up (e.g. to let the chunk engine reuse the
    blocks: see FileLease)."""

    __slots__ = ("parts", "count", "deadline_s", "cached")

    def __init__(self, fd: int, offset: int, count: int, deadline_s: float = 60.0, cached: bool = False):
        self.parts: list = [(fd, offset, count)]
        self.count, self.deadline_s = count, deadline_s
        self.cached = cached  # the sender found all the file bytes in the page cache: try sending them inline

    @classmethod
    def of_parts(cls, parts: list, deadline_s: float = 60.0, cached: bool = False) -> "FilePayload":
        """Parts in order: (fd, offset, count) of a file, or a buffer."""
        self = cls.__new__(cls)
        self.parts = [p if type(p) is tuple else memoryview(p).cast("B") for p in parts]
        self.count = sum(p[2] if type(p) is tuple else len(p) for p in self.parts)
        self.deadline_s, self.cached = deadline_s, cached
        return self

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.count

    async def send(self, protocol, head: bytes) -> None:
        import asyncio
        import concurrent.futures

        global _send_pool
        if _send_pool is None:
            _send_pool = concurrent.futures.ThreadPoolExecutor(max_workers=SEND_THREADS,
                                                               thread_name_prefix="sendfile")
        transport = protocol.transport
        sock = transport.get_extra_info("socket")
        if sock is None or transport.get_write_buffer_size():  # (never: send() waits for an empty buffer)
            raise ConnectionResetError("file-backed payload on a connection without a free socket")
        import os
        import socket

        parts = [memoryview(head)] + self.parts
        if self.cached:  # in the page cache: as much as the socket takes now, right here (no thread hop)
            try:
                parts = _send_now(sock.fileno(), parts)
            except BaseException:
                transport.abort()  # (the peer went away) a partial frame may have gone out
                raise
            if not parts:
                return
        # The thread sends on duplicates of the descriptors: if the transport closes the socket meanwhile
        # (the peer went away, an abort) or the engine closes its data file, their numbers may be reused by
        # the next open; the duplicates keep the thread's writes on this connection and reads from this file.
        out = socket.socket(fileno=os.dup(sock.fileno()))
        dups: dict[int, int] = {}  # one per file (a batch's regions mostly share a few data files)
        try:
            for k, part in enumerate(parts):
                if type(part) is tuple:
                    fd = dups.get(part[0])
                    if fd is None:
                        fd = dups[part[0]] = os.dup(part[0])
                    parts[k] = (fd, part[1], part[2])
        except BaseException:
            out.close()
            for fd in dups.values():
                os.close(fd)
            raise
        protocol.pause_writing()  # other frames wait (FramedProtocol.send) until this one is out
        try:
            fut = asyncio.get_running_loop().run_in_executor(_send_pool, _send_blocking, out.fileno(), parts,
                                                             self.deadline_s)
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                # Cancelled (a deadline, the connection closing): stop the thread's send and wait until it
                # has stopped, so that whatever the caller releases after this (the engine's read epoch of
                # the blocks being sent) is released only once nothing reads them any more.
                try:
                    out.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                while not fut.done():
                    try:
                        await asyncio.shield(fut)
                    except asyncio.CancelledError:
                        continue
                    except BaseException:
                        break
                if not fut.cancelled():
                    fut.exception()  # retrieved (the cancellation is what propagates)
                raise
        except BaseException:
            transport.abort()  # a partial frame went out: the stream cannot be trusted any more
            raise
        finally:
            out.close()
            for fd in dups.values():
                os.close(fd)
            protocol.resume_writing()


def _send_now(sock_fd: int, parts: list) -> list:
    """Write the parts (buffers, and file regions (fd, offset, count)) to a non-blocking socket until it is
    full; returns what is left (the first part possibly begun). Only for file bytes in the page cache:
    sendfile does not wait for the socket, but it would for the disk."""
    import os

    for k, part in enumerate(parts):
        try:
            if type(part) is tuple:
                fd, offset, count = part
                while count:
                    sent = os.sendfile(sock_fd, fd, offset, count)
                    if sent == 0:  # the file ends short: the thread's loop says so
                        break
                    offset += sent
                    count -= sent
                if count:
                    return [(fd, offset, count)] + parts[k + 1:]
            else:
                while len(part):
                    part = part[os.write(sock_fd, part):]
        except BlockingIOError:
            return [(fd, offset, count) if type(part) is tuple else part] + parts[k + 1:]
    return []


def _send_blocking(sock_fd: int, parts: list, deadline_s: float) -> None:
    """Write the parts (buffers, and file regions (fd, offset, count)) to a non-blocking socket (runs in a
    thread)."""
    import os
    import select
    import time

    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    deadline = time.monotonic() + deadline_s

    def wait() -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"file-backed send stalled for {deadline_s:.0f} s")
        for _, ev in poller.poll(max(1, int(left * 1000))):
            if ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                raise ConnectionResetError("connection closed during a file-backed send")

    for part in parts:
        if type(part) is not tuple:
            view = part
            while len(view):
                try:
                    view = view[os.write(sock_fd, view):]
                except BlockingIOError:
                    wait()
            continue
        fd, offset, count = part
        end = offset + count
        if count >= 1 << 20:  # bytes not cached yet: one readahead of all of them, not one per sendfile piece
            os.posix_fadvise(fd, offset, count, os.POSIX_FADV_WILLNEED)
        while offset < end:
            try:
                sent = os.sendfile(sock_fd, fd, offset, end - offset)
            except BlockingIOError:
                wait()
                continue
            if sent == 0:
                raise ConnectionResetError(f"file-backed send: the file ends {end - offset} bytes short")
            offset += sent
