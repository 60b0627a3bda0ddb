"""RPC server: token check on the first frame, typed dispatch, deadlines, bounded in-flight requests.

A service is a plain object whose handler methods are marked with `@rpc(RequestType)`:

    class StorageService:
        @rpc(schemas.storage.ReadReq)
        async def read(self, ctx: CallContext, req) -> ReadRsp | tuple[ReadRsp, payload]: ...

`RpcServer.add_service("storage", obj)` exposes it as method "storage.read".
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec

from threefs.common import limits
from threefs.common.buffers import BufferPool, Lease
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.frame import KIND_HELLO, KIND_REQUEST, KIND_RESPONSE, FrameError, Header, body_encoder
from threefs.rpc.schemas.common import Hello, HelloRsp
from threefs.rpc.transport import FramedProtocol

log = logging.getLogger(__name__)

_RPC_ATTR = "__threefs_rpc__"


def rpc(request_type: type, name: str | None = None):
    """Mark an async method as an RPC handler taking `request_type`."""

    def mark(fn):
        setattr(fn, _RPC_ATTR, (name or fn.__name__, request_type))
        return fn

    return mark


@dataclass
class CallContext:
    method: str
    peer: str
    principal: str  # who the token belongs to
    client_id: str
    payload: memoryview | None  # valid until the handler returns (pooled buffer): copy to keep
    deadline: float  # loop.time() by which the caller gives up
    conn: "ServerConnection" = field(repr=False, default=None)

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())


Authenticator = Callable[[str], Awaitable[str | None]]  # token -> principal, None = refused
Handler = tuple[Callable[..., Awaitable[Any]], msgspec.msgpack.Decoder]


class ServerConnection(FramedProtocol):
    def __init__(self, server: "RpcServer"):
        super().__init__()
        self.server = server
        self.principal: str | None = None
        self.client_id = ""
        self.tasks: set[asyncio.Task] = set()
        self._leases: dict[int, Lease] = {}  # request id -> pooled payload buffer

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.server.connections.add(self)

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        self.server.connections.discard(self)
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
            self._spawn(self._hello(header))
            return
        if header.kind != KIND_REQUEST:
            raise FrameError(StatusCode.PROTOCOL_ERROR, f"unexpected frame kind {header.kind}")
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
        self._spawn(self._dispatch(header, payload))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _hello(self, header: Header) -> None:
        principal = None
        if header.kind == KIND_HELLO:
            try:
                hello = msgspec.msgpack.decode(header.body, type=Hello)
                principal = await self.server.authenticate(hello.token)
                self.client_id = hello.client_id
            except msgspec.DecodeError:
                principal = None
        if principal is None:
            rsp = Header(KIND_HELLO, header.rid, status=int(StatusCode.AUTH_FAILED),
                         message="authentication failed: missing or invalid token (check the `token` "
                         "in client.toml matches the cluster's)")
            await self._send_quiet(rsp)
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
        loop = asyncio.get_running_loop()
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
            ctx = CallContext(header.method, self.peer, self.principal, self.client_id, payload,
                              loop.time() + timeout, self)
            async with asyncio.timeout(timeout):
                result = await fn(ctx, req)
            rsp, out = result if isinstance(result, tuple) else (result, None)
            body = msgspec.Raw(body_encoder.encode(rsp))
            try:
                await self._send_quiet(Header(KIND_RESPONSE, header.rid, body=body),
                                       out.view if isinstance(out, Lease) else out)
            finally:
                if isinstance(out, Lease):
                    out.release()
            self.server.observe(header.method, time.perf_counter() - started, None)
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
        await self._send_quiet(Header(KIND_RESPONSE, rid, status=int(e.code), message=e.message))

    async def _send_quiet(self, header: Header, payload=None) -> None:
        try:
            await self.send(header, payload)
        except ConnectionError:
            pass  # the caller went away; nothing to tell


class RpcServer:
    def __init__(self, name: str, authenticate: Authenticator, *,
                 inflight_max: int = limits.INFLIGHT_REQUESTS_PER_CONNECTION_MAX):
        self.name = name
        self.authenticate = authenticate
        self.inflight_max = inflight_max
        self.handlers: dict[str, Handler] = {}
        self.connections: set[ServerConnection] = set()
        self.pool = BufferPool()  # payload buffers, reused (fresh pages cost a fault per 4 KiB)
        self._server: asyncio.AbstractServer | None = None
        self.metrics_hook: Callable[[str, float, StatusCode | None], None] | None = None

    def add_service(self, prefix: str, obj: Any) -> None:
        for attr in dir(obj):
            fn = getattr(obj, attr)
            mark = getattr(fn, _RPC_ATTR, None)
            if mark is None:
                continue
            name, req_type = mark
            self.handlers[f"{prefix}.{name}"] = (fn, msgspec.msgpack.Decoder(req_type))

    def observe(self, method: str, seconds: float, code: StatusCode | None) -> None:
        if self.metrics_hook is not None:
            self.metrics_hook(method, seconds, code)

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: ServerConnection(self), host, port,
                                                reuse_address=True, backlog=1024)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.transport.close()
            await self._server.wait_closed()


def token_authenticator(expected: str) -> Authenticator:
    """The cluster token check used by every service (per-user tokens build on this)."""

    async def check(token: str) -> str | None:
        if expected and hmac.compare_digest(token.encode(), expected.encode()):
            return "cluster"
        return None

    return check
