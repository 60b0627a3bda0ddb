"""Shared plumbing of client and server connections: a BufferedProtocol with write flow control."""

from __future__ import annotations

import asyncio
import logging

from threefs.rpc.frame import FilePayload, FrameError, FrameReader, Header, encode_frame_head

log = logging.getLogger(__name__)


class FramedProtocol(asyncio.BufferedProtocol):
    """Reads frames with `FrameReader`; writes frames with back-pressure (`await send(...)`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader(self.frame_received, self.allocate_payload)
        self._paused = False
        self._drain_waiters: list[asyncio.Future] = []
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
        try:
            self.reader.buffer_updated(nbytes)
        except FrameError as e:
            log.warning("closing connection %s: %s", self.peer, e)
            self.on_frame_error(e)
            self.transport.close()

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
        if self.transport is None:
            return "?"
        p = self.transport.get_extra_info("peername")
        return f"{p[0]}:{p[1]}" if p else "?"

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    async def send(self, header: Header, payload=None) -> None:
        """Write one frame; waits while the kernel buffer is full (bounded memory per connection)."""
        plen = len(payload) if payload is not None else 0
        head = encode_frame_head(header, plen)
        while self._paused and not self.is_closing():
            fut = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(fut)
            await fut
        if self.is_closing():
            raise ConnectionResetError(f"connection to {self.peer} is closed")
        if plen and type(payload) is FilePayload:  # zero-copy: the payload sends itself (rpc/frame.py)
            return await payload.send(self, head)
        if plen:
            self.transport.writelines((head, payload))
        else:
            self.transport.write(head)
        while self._paused and not self.is_closing():  # wait until the kernel has the bytes
            fut = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(fut)
            await fut
