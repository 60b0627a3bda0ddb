"""RPC server: token check on the first frame, typed dispatch, deadlines, bounded in-flight requests.

A service is a plain object whose handler methods are marked with `@rpc(RequestType)`:

    class StorageService:
        @rpc(schemas.storage.ReadReq)
        async def read(self, ctx: CallContext, req) -> ReadRsp | tuple[ReadRsp, payload]: ...

`RpcServer.add_service("storage", obj)` exposes it as method "storage.read".
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import socket
import time
from asyncio.tasks import _current_tasks, _enter_task, _leave_task
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec

from threefs.common import limits, local_socket
from threefs.common.buffers import BufferPool, Lease
from threefs.common.eager import Resumed
from threefs.common.spin import Spinner
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.frame import (KIND_GRANT, KIND_HELLO, KIND_REQUEST, KIND_RESPONSE, KIND_RTS, FilePayload,
                               FrameError, Header, body_encoder)
from threefs.rpc.schemas.common import PROTOCOL_VERSION, Hello, HelloRsp
from threefs.rpc.transport import FramedProtocol

log = logging.getLogger(__name__)

_RPC_ATTR = "__threefs_rpc__"
# The kernel send buffer of a connection over a Unix socket (same host). Linux's default (212,992 B) holds a
# fifth of a 1 MiB chunk sent zero-copy (rpc/frame.py FilePayload): the send then went to a thread and waited
# for the socket five times per chunk. With 4 MiB (capped by net.core.wmem_max) a chunk in the page cache goes
# out in one sendfile, inline. Sequential 1 MiB batch_read, 3 storage services on this host: storage CPU per
# chunk 480-610 -> 170-185 us, 1.4-1.7 -> 2.25 GB/s. It is a limit, not memory held: zero-copy sends queue
# page references. TCP keeps the kernel's autotuning (setting SO_SNDBUF would turn it off).
UNIX_SEND_BUFFER_BYTES = 4 * limits.MiB


def rpc(request_type: type, name: str | None = None):
    """Mark an async method as an RPC handler taking `request_type`."""

    def mark(fn):
        setattr(fn, _RPC_ATTR, (name or fn.__name__, request_type))
        return fn

    return mark


@dataclass(slots=True)
class CallContext:
    method: str
    peer: str
    principal: str  # who the token belongs to
    client_id: str
    payload: memoryview | None  # valid until the handler returns (pooled buffer): copy to keep
    deadline: float
    rid: int = 0  # loop.time() by which the caller gives up
    conn: "ServerConnection" = field(repr=False, default=None)

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    async def request_to_send(self, rid: int, timeout: float) -> bool:
        """Ask the caller for a transmission token before sending a large response (3FS's
        RDMAControl.apply, off by default). Returns False when no grant came in time: send anyway."""
        return await self.conn.request_to_send(rid, timeout)


Authenticator = Callable[[str], Awaitable[str | None]]  # token -> principal, None = refused
Handler = tuple[Callable[..., Awaitable[Any]], msgspec.msgpack.Decoder]


class _StandIn:
    """The current task while a request runs its first step inside the reader's callback (Python 3.11 has no
    eager tasks). What that step captures as "the current task" (asyncio.timeout, a TaskGroup) keeps
    working if the request then waits: the stand-in forwards to the Task that takes the request over."""

    __slots__ = ("task", "_cancels", "_cancel_msg")

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self._cancels = 0  # cancel() calls made before a Task existed (passed on to it)
        self._cancel_msg = None

    def cancel(self, msg=None) -> bool:
        if self.task is not None:
            return self.task.cancel(msg)
        self._cancels += 1
        self._cancel_msg = msg
        return True

    def cancelling(self) -> int:
        return self.task.cancelling() if self.task is not None else self._cancels

    def uncancel(self) -> int:
        if self.task is not None:
            return self.task.uncancel()
        self._cancels = max(0, self._cancels - 1)
        return self._cancels

    def done(self) -> bool:
        return self.task is not None and self.task.done()

    def hand_over(self, task: asyncio.Task) -> None:
        self.task = task
        if self._cancels:
            task.cancel(self._cancel_msg)


class ServerConnection(FramedProtocol):
    batch_writes = True  # the answers of handlers that finish inside one read go out in one write

    def __init__(self, server: "RpcServer"):
        super().__init__()
        self.server = server
        self.principal: str | None = None
        self.client_id = ""
        self.tasks: set[asyncio.Task] = set()
        self._leases: dict[int, Lease] = {}  # request id -> pooled payload buffer
        self._grants: dict[int, asyncio.Future] = {}  # request id -> the caller's transmission grant
        self._hello_seen = False
        self._hello_timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self._peer = "?"

    @property
    def peer(self) -> str:  # asked for by every call's context: looked up once per connection
        return self._peer

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._peer = FramedProtocol.peer.fget(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
            except OSError:  # (never on Linux: the value is capped, not refused) the default then
                pass
        self.server.connections.add(self)
        # An idle unauthenticated connection would hold a socket forever: it must say hello in time.
        self._hello_timer = asyncio.get_running_loop().call_later(limits.HELLO_TIMEOUT_S, self._hello_late)

    def _hello_late(self) -> None:
        if self.principal is None and not self.transport.is_closing():
            log.warning("closing connection %s: no hello within %.0f s", self.peer, limits.HELLO_TIMEOUT_S)
            self.on_frame_error(FrameError(StatusCode.AUTH_FAILED, "authentication failed: no hello "
                                           f"within {limits.HELLO_TIMEOUT_S:.0f} s of connecting"))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self.server.connections.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        for t in list(self.tasks):
            t.cancel()

    def allocate_payload(self, header: Header, nbytes: int) -> memoryview:
        if self.principal is None:  # nobody gets to make us allocate before authenticating
            raise FrameError(StatusCode.AUTH_FAILED, "payload sent before authentication")
        lease = self.server.pool.acquire(nbytes)
        self._leases[header.rid] = lease
        return lease.view

    def on_frame_error(self, exc: FrameError) -> None:
        # Tell the peer why, on request id 0, before closing: a readable error beats a reset.
        header = Header(KIND_RESPONSE, 0, status=int(exc.code), message=exc.message)
        try:
            from threefs.rpc.frame import encode_frame_head

            self.transport.write(encode_frame_head(header, 0))
        except Exception:  # the transport may already be gone; closing follows anyway
            pass

    def frame_received(self, header: Header, payload: memoryview | None) -> None:
        if self.principal is None:
            if self._hello_seen:  # a client waits for the hello's answer; this one floods us unheard
                raise FrameError(StatusCode.AUTH_FAILED, "request sent before authentication finished")
            self._hello_seen = True
            self._spawn(self._hello(header))
            return
        spinner = self.server.spinner
        if spinner is not None:
            spinner.arrived()
        if header.kind == KIND_GRANT:
            grant = self._grants.get(header.rid)
            if grant is not None and not grant.done():
                grant.set_result(True)
            return
        if header.kind != KIND_REQUEST:
            raise FrameError(StatusCode.PROTOCOL_ERROR, f"unexpected frame kind {header.kind}")
        if len(self.tasks) >= 2 * self.server.inflight_max:
            # The client sends faster than it reads our answers (even the refusals): stop reading its
            # requests until the backlog halves, so memory stays bounded and TCP pushes back on it.
            self.reader.paused = True
            self.transport.pause_reading()
        if len(self.tasks) >= self.server.inflight_max:
            self._spawn(
                self._reply_error(
                    header.rid,
                    status_error(
                        StatusCode.TOO_MANY_REQUESTS,
                        f"more than {self.server.inflight_max} requests in flight on one connection",
                    ),
                )
            )
            return
        # Without a payload there is no pooled buffer to give back: the handler runs without _dispatch's
        # wrapper (one coroutine less per request).
        self._run_eagerly(self._handle(header, None) if payload is None else self._dispatch(header, payload))

    def _spawn(self, coro) -> None:
        task = self._loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _run_eagerly(self, coro) -> None:
        """Run a request right here, in the reader's callback, up to its first wait; only a request that waits
        becomes a Task (3.12's eager tasks). Most metadata calls never wait: they cost no Task, no loop
        iteration and no done callback. A request in flight is one that waits (self.tasks), as before."""
        loop = self._loop
        stand_in = _StandIn()
        context = contextvars.copy_context()  # as a Task would: the request's own context
        if _current_tasks.get(loop) is not None:  # called from inside a task: the ordinary way
            self._spawn(coro)
            return
        _enter_task(loop, stand_in)
        try:
            first = context.run(coro.send, None)
        except StopIteration:
            return
        except BaseException as e:  # _dispatch answers every error itself; this is a bug (or an exit)
            if not isinstance(e, Exception):
                raise
            log.exception("request on %s failed outside its handler", self._peer)
            return
        finally:
            _leave_task(loop, stand_in)
        task = loop.create_task(Resumed(coro, first), context=context)
        stand_in.hand_over(task)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if self.reader.paused and len(self.tasks) < self.server.inflight_max and not self.is_closing():
            self.transport.resume_reading()
            try:
                self.reader.resume()
            except FrameError as e:  # a buffered frame turned out bad: same handling as on receipt
                log.warning("closing connection %s: %s", self.peer, e)
                self.on_frame_error(e)
                self.transport.close()

    async def request_to_send(self, rid: int, timeout: float) -> bool:
        grant = asyncio.get_running_loop().create_future()
        self._grants[rid] = grant
        try:
            await self.send(Header(KIND_RTS, rid))
            async with asyncio.timeout(timeout):
                return await grant
        except (TimeoutError, ConnectionError):
            return False
        finally:
            self._grants.pop(rid, None)

    async def _hello(self, header: Header) -> None:
        principal = None
        if header.kind == KIND_HELLO:
            try:
                hello = msgspec.msgpack.decode(header.body, type=Hello)
            except msgspec.DecodeError:
                hello = None
            if hello is not None and hello.protocol != PROTOCOL_VERSION:
                await self._send_quiet(Header(
                    KIND_HELLO, header.rid, status=int(StatusCode.PROTOCOL_ERROR),
                    message=f"{self.server.name} speaks threefs protocol {PROTOCOL_VERSION}, this peer "
                    f"{hello.protocol}: run the same threefs version on both sides"))
                self.transport.close()
                return
            if hello is not None:
                principal = await self.server.authenticate(hello.token)
                self.client_id = hello.client_id
        if principal is None:
            rsp = Header(KIND_HELLO, header.rid, status=int(StatusCode.AUTH_FAILED),
                         message="authentication failed: missing or invalid token (check the `token` "
                         "in client.toml matches the cluster's)")
            await self._send_quiet(rsp)
            self.transport.close()
            return
        same = sum(1 for c in self.server.connections
                   if c.principal is not None and c.client_id == self.client_id)
        if same >= self.server.connections_per_client_max:
            await self._send_quiet(Header(
                KIND_HELLO, header.rid, status=int(StatusCode.TOO_MANY_REQUESTS),
                message=f"client {self.client_id[:64]!r} already holds {same} connections to "
                f"{self.server.name} (limit {self.server.connections_per_client_max}); reuse them"))
            self.transport.close()
            return
        self.principal = principal
        body = msgspec.Raw(body_encoder.encode(HelloRsp(service=self.server.name)))
        await self._send_quiet(Header(KIND_HELLO, header.rid, body=body))

    async def _dispatch(self, header: Header, payload: memoryview | None) -> None:
        try:
            await self._handle(header, payload)
        finally:
            lease = self._leases.pop(header.rid, None)
            if lease is not None:  # handlers must not keep ctx.payload past their return
                lease.release()

    async def _handle(self, header: Header, payload: memoryview | None) -> None:
        loop = self._loop
        timeout = header.timeout_ms / 1000 if header.timeout_ms > 0 else limits.CALL_TIMEOUT_S_DEFAULT
        started = time.perf_counter()
        try:
            handler = self.server.handlers.get(header.method)
            if handler is None:
                raise status_error(StatusCode.UNKNOWN_METHOD,
                                   f"{self.server.name} has no method {header.method!r}")
            fn, decoder = handler
            try:
                req = decoder.decode(header.body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"bad {header.method} request: {e}")
            ctx = CallContext(header.method, self._peer, self.principal, self.client_id, payload,
                              loop.time() + timeout, conn=self, rid=header.rid)
            # The handler runs up to its first wait by hand; the deadline is armed only if it waits (a
            # timer per request costs as much as a small handler). It counts from the request's arrival.
            coro = fn(ctx, req)
            try:
                first = coro.send(None)
            except StopIteration as done:
                result = done.value
            else:
                async with asyncio.timeout_at(ctx.deadline):
                    result = await Resumed(coro, first)
            rsp, out = result if isinstance(result, tuple) else (result, None)
            rsp_header = Header(KIND_RESPONSE, header.rid, body=msgspec.Raw(body_encoder.encode(rsp)))
            if out is None:
                bytes_out = 0
                if not self.write_frame(rsp_header):
                    await self._send_quiet(rsp_header)
            else:
                out_view = out.view if isinstance(out, Lease) else out
                bytes_out = len(out_view) if isinstance(out_view, FilePayload) else memoryview(out_view).nbytes
                try:
                    await self._send_quiet(rsp_header, out_view)
                finally:
                    if isinstance(out, Lease):
                        out.release()
            self.server.observe(header.method, time.perf_counter() - started, None,
                                0 if payload is None else payload.nbytes, bytes_out)
        except ThreeFSError as e:
            self.server.observe(header.method, time.perf_counter() - started, e.code)
            await self._reply_error(header.rid, e)
        except TimeoutError:
            self.server.observe(header.method, time.perf_counter() - started, StatusCode.TIMEOUT)
            await self._reply_error(header.rid, status_error(
                StatusCode.TIMEOUT, f"{header.method} did not finish within {timeout:.1f} s"))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: report it, keep serving
            log.exception("internal error in %s", header.method)
            self.server.observe(header.method, time.perf_counter() - started, StatusCode.INTERNAL)
            await self._reply_error(header.rid, status_error(
                StatusCode.INTERNAL, f"internal error in {self.server.name} {header.method}: "
                f"{type(e).__name__}: {e}"))

    async def _reply_error(self, rid: int, e: ThreeFSError) -> None:
        header = Header(KIND_RESPONSE, rid, status=int(e.code), message=e.message)
        if not self.write_frame(header):
            await self._send_quiet(header)

    async def _send_quiet(self, header: Header, payload=None) -> None:
        try:
            await self.send(header, payload)
        except ConnectionError:
            pass  # the caller went away; nothing to tell


class RpcServer:
    def __init__(self, name: str, authenticate: Authenticator, *,
                 inflight_max: int = limits.INFLIGHT_REQUESTS_PER_CONNECTION_MAX,
                 connections_per_client_max: int = limits.CONNECTIONS_PER_CLIENT_MAX,
                 spin_us: float = 0.0):
        """spin_us > 0: after a request, poll for the next one up to that long instead of sleeping, while
        requests come that close together and the CPU is free (Spinner; common/spin.py)."""
        self.name = name
        self.authenticate = authenticate
        self.inflight_max = inflight_max
        self.connections_per_client_max = connections_per_client_max
        self.handlers: dict[str, Handler] = {}
        self.connections: set[ServerConnection] = set()
        self.pool = BufferPool()  # payload buffers, reused (fresh pages cost a fault per 4 KiB)
        self._server: asyncio.AbstractServer | None = None
        self._local_servers: list[asyncio.AbstractServer] = []  # the same-host Unix sockets (common/local_socket.py)
        self.local_addrs: list[str] = []  # the addresses whose local socket this server holds
        # metrics_hook(method, seconds, status or None, payload bytes in, payload bytes out)
        self.metrics_hook: Callable[[str, float, StatusCode | None, int, int], None] | None = None
        self.spinner: Spinner | None = Spinner(spin_us * 1e-6) if spin_us > 0 else None

    def add_service(self, prefix: str, obj: Any) -> None:
        for attr in dir(obj):
            fn = getattr(obj, attr)
            mark = getattr(fn, _RPC_ATTR, None)
            if mark is None:
                continue
            name, req_type = mark
            self.handlers[f"{prefix}.{name}"] = (fn, msgspec.msgpack.Decoder(req_type))

    def observe(self, method: str, seconds: float, code: StatusCode | None, bytes_in: int = 0,
                bytes_out: int = 0) -> None:
        if self.metrics_hook is not None:
            self.metrics_hook(method, seconds, code, bytes_in, bytes_out)

    async def start(self, host: str, port: int, *, advertise_host: str = "", local: bool = True) -> int:
        """Listen on TCP `host:port` (port 0: any free one; returned) and, with `local`, on the Unix socket
        of every address same-host clients may know this server by (common/local_socket.py)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: ServerConnection(self), host, port,
                                                reuse_address=True, backlog=1024)
        port = self._server.sockets[0].getsockname()[1]
        if local:
            try:
                socks = local_socket.listen_all(host, port, advertise_host)
            except BaseException:
                await self.stop()
                raise
            try:
                for addr, sock in socks:
                    self._local_servers.append(await loop.create_unix_server(lambda: ServerConnection(self),
                                                                             sock=sock, backlog=1024))
                    self.local_addrs.append(addr)
            except BaseException:
                for _, sock in socks[len(self._local_servers):]:  # not taken by a server yet
                    sock.close()
                await self.stop()
                raise
        return port

    async def stop(self) -> None:
        servers = [s for s in (self._server, *self._local_servers) if s is not None]
        for server in servers:
            server.close()
        if servers:
            for conn in list(self.connections):
                conn.transport.close()
            for server in servers:
                await server.wait_closed()


def token_authenticator(expected: str) -> Authenticator:
    """The cluster token check used by every service (per-user tokens build on this)."""

    async def check(token: str) -> str | None:
        if expected and hmac.compare_digest(token.encode(), expected.encode()):
            return "cluster"
        return None

    return check
