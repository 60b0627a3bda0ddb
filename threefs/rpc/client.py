"""RPC client: one multiplexed connection per peer, request ids, deadlines, typed errors.

    rsp, payload = await rpc.call("127.0.0.1:9000", "storage.read", req, ReadRsp,
                                  recv_into=memoryview(buf))

A response payload lands directly in `recv_into` when given (zero-copy read path; a frame.Scatter
spreads it over several buffers in order), otherwise in a fresh buffer. A response that arrives after its
caller gave up is drained into a throw-away buffer, so a caller's memory is never written after `call`
returned.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

import msgspec

from threefs.common import limits, local_socket
from threefs.common.spin import CLIENT_SPIN_S_MAX, LoopPoller
from threefs.common.status import StatusCode, ThreeFSError, UnavailableError, status_error
from threefs.rpc.frame import (KIND_GRANT, KIND_HELLO, KIND_REQUEST, KIND_RTS, Header, Scatter, body_encoder,
                               encode_frame_head)
from threefs.rpc.schemas.common import PROTOCOL_VERSION, Hello, HelloRsp
from threefs.rpc.transport import FramedProtocol

log = logging.getLogger(__name__)

_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def _decoder(t: type) -> msgspec.msgpack.Decoder:
    d = _decoders.get(t)
    if d is None:
        d = _decoders[t] = msgspec.msgpack.Decoder(t)
    return d


def as_bytes_view(buf) -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer (bytes, bytearray, numpy, mmap)."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


class _Pending:
    __slots__ = ("future", "recv_into", "token")

    def __init__(self, future: asyncio.Future, recv_into: memoryview | None):
        self.future = future
        self.recv_into = recv_into
        self.token: asyncio.Semaphore | None = None  # a transmission token held for this call


def _time_out(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class ClientConnection(FramedProtocol):
    def __init__(self, addr: str, senders: asyncio.Semaphore | None = None):
        super().__init__()
        self.addr = addr
        self.pending: dict[int, _Pending] = {}
        self.answer_s = CLIENT_SPIN_S_MAX / 2  # moving average of answer times (LoopSpin, when used)
        self._ids = itertools.count(1)
        self.senders = senders  # caps servers sending to us at once (request-to-send)
        self._tasks: set[asyncio.Task] = set()

    def allocate_payload(self, header: Header, nbytes: int) -> memoryview:
        p = self.pending.get(header.rid)
        if p is not None and p.recv_into is not None and not p.future.done():
            into = p.recv_into
            if len(into) >= nbytes:
                return into.head(nbytes) if type(into) is Scatter else into[:nbytes]
        return memoryview(bytearray(nbytes))

    def frame_received(self, header: Header, payload: memoryview | None) -> None:
        if header.kind == KIND_RTS:
            task = asyncio.ensure_future(self._grant(header.rid))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        if header.rid == 0 and header.status:  # connection-level error from the server
            self._fail_all(status_error(header.status, f"{self.addr}: {header.message}"))
            return
        p = self.pending.pop(header.rid, None)
        if p is None or p.future.done():
            return  # the caller gave up (deadline); payload was drained into a scratch buffer
        if header.status:
            p.future.set_exception(status_error(header.status, header.message))
        else:
            p.future.set_result((header, payload))

    async def _grant(self, rid: int) -> None:
        """A server asks to send request rid's response: wait for a transmission token, then grant."""
        p = self.pending.get(rid)
        if p is None or self.senders is None:
            return
        await self.senders.acquire()
        if self.pending.get(rid) is not p or p.future.done():
            self.senders.release()  # the call ended while we waited
            return
        p.token = self.senders
        try:
            await self.send(Header(KIND_GRANT, rid))
        except ConnectionError:
            pass  # the call fails with the connection; its token is released then

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self._fail_all(UnavailableError(StatusCode.UNAVAILABLE, f"connection to {self.addr} lost"
                                        + (f": {exc}" if exc else "")))

    def _fail_all(self, err: ThreeFSError) -> None:
        pending, self.pending = self.pending, {}
        for p in pending.values():
            if not p.future.done():
                p.future.set_exception(err)

    async def request(self, kind: int, method: str, body: bytes, payload, recv_into,
                      timeout: float) -> tuple[Header, memoryview | None]:
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = pending_entry = _Pending(fut, recv_into)
        header = Header(kind, rid, method=method, timeout_ms=int(timeout * 1000),
                        body=msgspec.Raw(body))
        try:
            await self.send(header, payload)
            return await fut
        except ConnectionError as e:
            raise UnavailableError(StatusCode.UNAVAILABLE, f"{method} to {self.addr}: {e}") from e
        finally:
            self.end_request(rid, pending_entry)

    def start_request(self, kind: int, method: str, body: bytes, recv_into, timeout: float) -> tuple[int, _Pending]:
        """`request` without a payload on a connection that is open and not held back by the kernel (the
        caller checked `ready()`), in plain code: the frame is written (or joins this turn's batch) now, and
        the caller awaits the returned entry's future, then calls end_request(rid, entry) whatever happened."""
        rid = next(self._ids)
        head = encode_frame_head(Header(kind, rid, method=method, timeout_ms=int(timeout * 1000),
                                        body=msgspec.Raw(body)), 0)
        self.pending[rid] = entry = _Pending(asyncio.get_running_loop().create_future(), recv_into)
        if self._batch is not None:
            self._batch.append(head)  # written at the end of this buffer_updated (as send does)
        else:
            self.transport.write(head)
        return rid, entry

    def ready(self) -> bool:
        """Open, and a frame written now goes out without waiting for the kernel's buffer (start_request)."""
        return not self._paused and not self.is_closing()

    def end_request(self, rid: int, pending_entry: _Pending) -> None:
        """A request is over (answered, failed, timed out, cancelled): forget it, stop receiving into the
        caller's buffer, give back its transmission token."""
        p = self.pending.pop(rid, None)
        if p is not None and pending_entry.recv_into is not None:
            self.reader.divert(rid)  # gave up (timeout, cancel): stop writing into recv_into
        entry = p or pending_entry
        if entry.token is not None:
            entry.token.release()
            entry.token = None


class LoopSpin(LoopPoller):
    """While a call whose answer usually comes quickly is pending, keep the event loop polling instead of
    sleeping until the answer wakes it; the client side of common/spin.py's trade. Per connection, a moving
    average of its answers' times; a call polls the loop up to twice that, if it is under `spin_s_max` and
    the CPU is calm. Only for a loop that has nothing else to do while it waits (the FUSE daemon's): a loop
    sharing its thread's CPU with other threads would take the GIL from them."""

    def __init__(self, spin_s_max: float | None = None):
        super().__init__()
        self.spin_s_max = CLIENT_SPIN_S_MAX if spin_s_max is None else spin_s_max

    def started(self, conn: "ClientConnection") -> float:
        t0 = time.perf_counter()
        if conn.answer_s < self.spin_s_max:
            self.poll_until(t0 + 2 * conn.answer_s)
        return t0

    def answered(self, conn: "ClientConnection", t0: float) -> None:
        conn.answer_s = conn.answer_s * 0.75 + (time.perf_counter() - t0) * 0.25


class RpcClient:
    """Connection pool + typed calls. Safe to share by all tasks of one event loop."""

    def __init__(self, token: str, *, client_id: str | None = None,
                 connect_timeout: float = limits.CONNECT_TIMEOUT_S, senders_max: int = 0):
        """senders_max > 0 enables request-to-send: at most that many servers transmit to us at once."""
        self.token = token
        self.senders = asyncio.Semaphore(senders_max) if senders_max > 0 else None
        self.client_id = client_id or uuid.uuid4().hex
        self.connect_timeout = connect_timeout
        # LoopSpin: keep the event loop polling while a quick answer is due (a process whose loop does
        # nothing else meanwhile: the FUSE daemon); None: the loop sleeps until the answer wakes it
        self.spin: LoopSpin | None = None
        self._conns: dict[str, ClientConnection] = {}
        self._connecting: dict[str, asyncio.Task] = {}

    async def _connect(self, addr: str) -> ClientConnection:
        host, _, port = addr.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                sock = local_socket.connect_nonblocking(addr)  # a same-host server's Unix socket, else TCP
                if sock is not None:
                    _, conn = await loop.create_unix_connection(lambda: ClientConnection(addr, self.senders),
                                                                sock=sock)
                else:
                    _, conn = await loop.create_connection(lambda: ClientConnection(addr, self.senders),
                                                           host, int(port))
                body = body_encoder.encode(Hello(token=self.token, client_id=self.client_id))
                header, _ = await conn.request(KIND_HELLO, "hello", body, None, None, self.connect_timeout)
                rsp = msgspec.msgpack.decode(header.body, type=HelloRsp)
                if rsp.protocol != PROTOCOL_VERSION:
                    conn.transport.close()
                    raise status_error(StatusCode.PROTOCOL_ERROR,
                                       f"{addr} ({rsp.service}) speaks threefs protocol {rsp.protocol}, "
                                       f"this client {PROTOCOL_VERSION}: run the same threefs version")
        except (OSError, TimeoutError) as e:
            if isinstance(e, ThreeFSError) and e.code in (StatusCode.AUTH_FAILED, StatusCode.PROTOCOL_ERROR,
                                                          StatusCode.TOO_MANY_REQUESTS):
                raise
            raise UnavailableError(StatusCode.UNAVAILABLE, f"cannot connect to {addr}: "
                                   f"{type(e).__name__} {e}".rstrip()) from e
        return conn

    async def connection(self, addr: str) -> ClientConnection:
        conn = self._conns.get(addr)
        if conn is not None and not conn.is_closing():
            return conn
        task = self._connecting.get(addr)
        if task is None:
            task = asyncio.ensure_future(self._connect(addr))
            self._connecting[addr] = task
            task.add_done_callback(lambda t, a=addr: self._connect_done(a, t))
        conn = await asyncio.shield(task)
        self._conns[addr] = conn
        return conn

    def _connect_done(self, addr: str, task: asyncio.Task) -> None:
        self._connecting.pop(addr, None)
        # Every waiter may have given up first (its call's timeout is shorter than the connect timeout):
        # the failure is then nobody's, and asyncio logged it as "Task exception was never retrieved"
        # with a traceback at every connect that failed during a link cut (seen in the soak's logs).
        if not task.cancelled():
            task.exception()

    async def call(self, addr: str, method: str, req: msgspec.Struct, rsp_type: type, *,
                   payload=None, recv_into=None, timeout: float | None = None):
        """Call `method` at `addr`; returns (response, payload view or None). Raises ThreeFSError."""
        timeout = timeout or limits.CALL_TIMEOUT_S_DEFAULT
        if payload is not None:
            payload = as_bytes_view(payload)
        if recv_into is not None and type(recv_into) is not Scatter:
            recv_into = as_bytes_view(recv_into)
        conn = self._conns.get(addr)
        try:
            if payload is None and conn is not None and conn.ready():
                # The common call: connected, nothing to send but the frame, so the only wait is for the
                # answer; its deadline is a timer on the answer's future, not asyncio.timeout around the
                # whole call (which costs ~2 us more per call; measured, uvloop: 4.4 us against 2.4)
                rid, entry = conn.start_request(KIND_REQUEST, method, body_encoder.encode(req), recv_into, timeout)
                timer = asyncio.get_running_loop().call_later(timeout, _time_out, entry.future)
                spin = self.spin
                t0 = spin.started(conn) if spin is not None else 0.0
                try:
                    header, out = await entry.future
                finally:
                    timer.cancel()
                    conn.end_request(rid, entry)
                    if spin is not None:
                        spin.answered(conn, t0)
            else:
                async with asyncio.timeout(timeout):
                    conn = await self.connection(addr)
                    header, out = await conn.request(KIND_REQUEST, method, body_encoder.encode(req),
                                                     payload, recv_into, timeout)
        except TimeoutError as e:
            raise status_error(StatusCode.TIMEOUT,
                               f"{method} to {addr} timed out after {timeout:.1f} s") from e
        try:
            return _decoder(rsp_type).decode(header.body), out
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise status_error(StatusCode.PROTOCOL_ERROR, f"bad {method} response from {addr}: {e}")

    def drop(self, addr: str) -> None:
        conn = self._conns.pop(addr, None)
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    async def close(self) -> None:
        connecting = list(self._connecting.values())
        for task in connecting:
            task.cancel()
        await asyncio.gather(*connecting, return_exceptions=True)
        for addr in list(self._conns):
            self.drop(addr)
        await asyncio.sleep(0)
