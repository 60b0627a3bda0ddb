"""Shared plumbing of client and server connections: a BufferedProtocol with write flow control."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

from threefs.rpc.frame import FilePayload, FrameError, FrameReader, Header, encode_frame_head

log = logging.getLogger(__name__)
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (SO_PEERCRED)


class FramedProtocol(asyncio.BufferedProtocol):
    """Reads frames with `FrameReader`; writes frames with back-pressure (`await send(...)`).

    With `batch_writes`, frames without a payload that are written while one `buffer_updated` is being
    handled (answers of handlers that finished inside it) are sent in one `transport.write`: one system call
    for all the answers to the requests one read delivered. That write happens as soon as the answer to the
    read's last frame is written (`write_frame`), else at the end of `buffer_updated`."""

    batch_writes = False

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader(self.frame_received, self.allocate_payload)
        self._paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._batch: list[bytes] | None = None  # header-only frames to write at the end of buffer_updated
        self.closed = asyncio.get_running_loop().create_future()

    # subclass hooks -------------------------------------------------------------------------------
    def frame_received(self, header: Header, payload: memoryview | None) -> None:
        raise NotImplementedError

    def allocate_payload(self, header: Header, nbytes: int) -> memoryview:
        return memoryview(bytearray(nbytes))

    def on_frame_error(self, exc: FrameError) -> None:
        pass

    # asyncio callbacks ----------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        # Pause as soon as anything is queued in user space: send() then returns only once the
        # kernel has taken the whole frame, so a pooled payload buffer can be reused right away.
        transport.set_write_buffer_limits(high=0, low=0)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self.batch_writes:
            self._batch = []
        try:
            self.reader.buffer_updated(nbytes)
        except FrameError as e:
            self._flush_batch()
            log.warning("closing connection %s: %s", self.peer, e)
            self.on_frame_error(e)
            self.transport.close()
        finally:
            if self._batch is not None:
                self._flush_batch()
                self._batch = None

    def _flush_batch(self) -> None:
        batch = self._batch
        if batch:
            self._batch = []
            if not self.is_closing():
                self.transport.write(batch[0] if len(batch) == 1 else b"".join(batch))

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)
        self._wake_writers(exc or ConnectionResetError("connection closed"))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_writers(None)

    def _wake_writers(self, exc) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for w in waiters:
            if not w.done():
                w.set_exception(exc) if exc else w.set_result(None)

    # writing --------------------------------------------------------------------------------------
    @property
    def peer(self) -> str:
        """host:port over TCP; "local pid P (uid U)" for a same-host client on a Unix socket (its kernel
        credentials), the server's socket name for a client's own Unix connection."""
        if self.transport is None:
            return "?"
        p = self.transport.get_extra_info("peername")
        if isinstance(p, tuple) and len(p) >= 2:
            return f"{p[0]}:{p[1]}"
        if p:  # a Unix socket's name (the server's, seen from its client): "@threefs-rpc/HOST:PORT"
            name = p.decode(errors="replace") if isinstance(p, bytes) else str(p)
            return "@" + name[1:] if name.startswith("\0") else name
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            try:
                pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                return f"local pid {pid} (uid {uid})"
            except OSError:
                return "local"
        return "?"

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def write_frame(self, header: Header, payload=None) -> bool:
        """Write one frame now if the transport takes it: True = written and nothing to wait for (the kernel
        has the bytes, or they wait in this callback's batch); False = nothing written, `send` must be used
        (a full kernel buffer, or a closed connection: send raises). A written frame never makes the caller
        wait afterwards here; a payload frame that did not fit is awaited by `send`."""
        if self._paused or self.is_closing():
            return False
        if payload is None:
            head = encode_frame_head(header, 0)
            batch = self._batch
            if batch is not None:
                if not self.reader.drained():
                    batch.append(head)
                    return True
                # The read's last frame: no later answer can join this write, so it goes out now, before
                # the rest of the request's bookkeeping (metrics, unwinding the reader): the caller gets
                # its answer that much sooner, and that work overlaps with the caller's.
                if batch:
                    batch.append(head)
                    head = b"".join(batch)
                    batch.clear()
            self.transport.write(head)
            return True
        return False

    async def send(self, header: Header, payload=None) -> None:
        """Write one frame; waits while the kernel buffer is full (bounded memory per connection)."""
        plen = len(payload) if payload is not None else 0
        head = encode_frame_head(header, plen)
        if plen and type(payload) is FilePayload:
            self._flush_batch()  # frames keep their order; a file-backed send needs an empty buffer (below)
        while self._paused and not self.is_closing():
            fut = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(fut)
            await fut
        if self.is_closing():
            raise ConnectionResetError(f"connection to {self.peer} is closed")
        if plen and type(payload) is FilePayload:  # zero-copy: the payload sends itself (rpc/frame.py)
            return await payload.send(self, head)
        if plen:
            self._flush_batch()  # frames keep their order
            self.transport.writelines((head, payload))
        elif self._batch is not None:
            self._batch.append(head)
            return  # written at the end of this buffer_updated; nothing of the caller's to hold
        else:
            self.transport.write(head)
        while self._paused and not self.is_closing():  # wait until the kernel has the bytes
            fut = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(fut)
            await fut
