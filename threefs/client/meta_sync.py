"""Meta calls from the caller's own thread: blocking sockets, no trip through the client's event loop.

A synchronous `Client` call used to be `loop.run(aio.meta_call(...))`: the caller's thread hands a coroutine
to the loop thread (a self-pipe write and a wakeup), the loop encodes and sends, wakes again for the reply,
and wakes the caller through a condition variable. For a metadata call that round of thread hops cost about
as much CPU as the call's own client work (docs/meta.md, "Where a call's time goes"). Here the caller's
thread encodes the frame, `sendall`s it on a blocking socket and reads the reply itself: one send and one
receive system call, no other thread involved.

The wire is the RPC framing of rpc/frame.py unchanged (hello with the client's token and client id, then
request frames), so meta servers see an ordinary connection of the same client id: write sessions opened
here belong to that client, its keepalives cover them. Connections are pooled per meta server (at most
SYNC_CONNECTIONS_PER_SERVER, well under the servers' per-client limit); a thread takes an idle one, or opens
one, and gives it back after its call. When all are busy, `call` returns NOT_TAKEN and the caller uses the
event loop's multiplexed connection instead, so any number of threads still works.

Failover is the async path's: the next live meta server (from the routing the client's loop keeps fresh)
with the same request id, so a retried mutation never acts twice. A pooled connection the server closed
(restart) is noticed before use by a zero-timeout poll, and a call that fails on a reused connection is
retried once on a fresh one to the same server.

After a fork the child never touches the parent's sockets: the pool belongs to one process id.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import threading

import msgspec

from threefs.common.status import StatusCode, status_error
from threefs.common import limits
from threefs.rpc.frame import (KIND_GRANT, KIND_HELLO, KIND_REQUEST, KIND_RTS, MAGIC, PREFIX, PREFIX_BYTES,
                               Header, body_encoder, encode_frame_head)
from threefs.rpc.schemas.common import PROTOCOL_VERSION, Hello, HelloRsp
from threefs.rpc.client import _decoder  # one decoder cache per process, shared with the async client
from threefs.rpc.schemas.mgmtd import META

SYNC_CONNECTIONS_PER_SERVER = 8  # blocking connections per meta server (servers allow 64 per client id)
RECV_BYTES = 64 * 1024
NOT_TAKEN = object()  # call() could not run this call here (no routing yet, every connection busy)

_header_decoder = msgspec.msgpack.Decoder(Header)
class _Broken(Exception):
    """The connection cannot be used any more (closed, timed out, garbled); the call may go elsewhere."""


class _Conn:
    """One blocking, authenticated connection to one server, used by one thread at a time."""

    def __init__(self, addr: str, token: str, client_id: str, timeout: float):
        self.addr = addr
        host, _, port = addr.rpartition(":")
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=min(timeout,
                                                                                limits.CONNECT_TIMEOUT_S))
        except OSError as e:
            raise _Broken(f"cannot connect to {addr}: {type(e).__name__} {e}".rstrip()) from e
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(timeout)
        self._buf = bytearray(RECV_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._rids = itertools.count(1)
        self.used = False
        try:
            hello = body_encoder.encode(Hello(token=token, client_id=client_id))
            header = self.exchange(KIND_HELLO, "hello", hello, timeout)
        except BaseException:
            self.close()
            raise
        if header.status:
            self.close()
            raise status_error(header.status, f"{addr}: {header.message}")
        rsp = msgspec.msgpack.decode(header.body, type=HelloRsp)
        if rsp.protocol != PROTOCOL_VERSION:
            self.close()
            raise status_error(StatusCode.PROTOCOL_ERROR,
                               f"{addr} ({rsp.service}) speaks threefs protocol {rsp.protocol}, this client "
                               f"{PROTOCOL_VERSION}: run the same threefs version")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def alive(self) -> bool:
        """An idle connection has nothing to read: readable means closed by the server (or garbage)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def exchange(self, kind: int, method: str, body: bytes, timeout: float) -> Header:
        """Send one request frame and return the response's header (raises _Broken on transport trouble)."""
        rid = next(self._rids)
        head = encode_frame_head(Header(kind, rid, method=method, timeout_ms=int(timeout * 1000),
                                        body=msgspec.Raw(body)), 0)
        try:
            self.sock.sendall(head)
            while True:
                header, payload_len = self._read_frame()
                if payload_len:
                    self._skip(payload_len)  # meta answers carry no payload; never keep one
                if header.kind == KIND_RTS:  # a server asking to send a large answer: let it
                    self.sock.sendall(encode_frame_head(Header(KIND_GRANT, header.rid), 0))
                    continue
                if header.rid == 0 and header.status:  # a connection-level error: the server closes
                    raise status_error(header.status, f"{self.addr}: {header.message}")
                if header.rid == rid:
                    return header
                # an answer to an earlier call that gave up (timeout): drop it
        except (OSError, EOFError, msgspec.DecodeError) as e:
            raise _Broken(f"{method} to {self.addr}: {type(e).__name__} {e}".rstrip()) from e

    def _fill(self, need: int) -> None:
        """Make at least `need` unread bytes available in the buffer."""
        if len(self._buf) - self._start < need:
            pending = self._end - self._start
            buf = bytearray(max(len(self._buf), need))
            buf[:pending] = self._view[self._start:self._end]
            self._buf, self._view, self._start, self._end = buf, memoryview(buf), 0, pending
        while self._end - self._start < need:
            if self._end == len(self._buf):  # compact: move the unread bytes to the front
                pending = self._end - self._start
                self._buf[:pending] = self._view[self._start:self._end]
                self._start, self._end = 0, pending
            n = self.sock.recv_into(self._view[self._end:])
            if n == 0:
                raise EOFError("connection closed by the server")
            self._end += n

    def _read_frame(self) -> tuple[Header, int]:
        self._fill(PREFIX_BYTES)
        magic, _flags, hlen, plen = PREFIX.unpack_from(self._buf, self._start)
        if magic != MAGIC or hlen > limits.FRAME_HEADER_BYTES_MAX:
            raise EOFError(f"bad frame (magic 0x{magic:04x}, header {hlen} B)")
        self._fill(PREFIX_BYTES + hlen)
        hstart = self._start + PREFIX_BYTES
        header = _header_decoder.decode(self._view[hstart:hstart + hlen])
        self._start = hstart + hlen
        if self._start == self._end:
            self._start = self._end = 0
        return header, plen

    def _skip(self, nbytes: int) -> None:
        while nbytes:
            have = min(nbytes, self._end - self._start)
            if have:
                self._start += have
                nbytes -= have
                continue
            self._start = self._end = 0
            n = self.sock.recv_into(self._view)
            if n == 0:
                raise EOFError("connection closed by the server")
            self._end = n


class SyncMetaCalls:
    """Pooled blocking connections to the meta servers of one AsyncClient (its token, client id, request ids,
    routing). Safe to use from any number of threads; belongs to the process that made it."""

    def __init__(self, aio, timeout: float):
        self._aio = aio
        self._timeout = timeout
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Conn]] = {}
        self._count: dict[str, int] = {}  # open connections per server (idle + in use)
        self._closed = False

    def call(self, method: str, req, rsp_type):
        """The response, or NOT_TAKEN when the call must take the event loop's path instead."""
        aio = self._aio
        routing = aio.mgmtd.routing
        if routing is None or self._closed or os.getpid() != self._pid:
            return NOT_TAKEN
        servers = routing.nodes_of_type(META)
        if not servers:
            return NOT_TAKEN  # the async path refreshes the routing and says what is wrong
        if getattr(req, "request_id", None) == 0:  # one id per call: failover retries reuse it
            req.request_id = next(aio._meta_request_ids)
        if aio.acting_user is not None and getattr(req, "user", 0) is None:
            req.user = aio.acting_user
        body = body_encoder.encode(req)
        name = "meta." + method
        start = next(aio._meta_rr)
        errors = []
        for i in range(len(servers)):
            node = servers[(start + i) % len(servers)]
            for fresh in (False, True):
                conn = self._take(node.addr, fresh)
                if conn is None:  # every connection busy: the loop's path (same request id)
                    return NOT_TAKEN
                try:
                    if isinstance(conn, _Broken):
                        raise conn
                    header = conn.exchange(KIND_REQUEST, name, body, self._timeout)
                except _Broken as e:
                    reused = not isinstance(conn, _Broken) and conn.used
                    self._discard(node.addr, conn)
                    if reused and not fresh:
                        continue  # a pooled connection the server dropped: once more on a new one
                    errors.append(f"meta {node.node_id} at {node.addr}: {e}")
                    break
                except BaseException:
                    self._discard(node.addr, conn)
                    raise
                conn.used = True
                self._give_back(node.addr, conn)
                if header.status:
                    if header.status in (StatusCode.UNAVAILABLE, StatusCode.TIMEOUT):
                        errors.append(f"meta {node.node_id} at {node.addr}: {header.message}")
                        break
                    raise status_error(header.status, header.message)
                try:
                    return _decoder(rsp_type).decode(header.body)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise status_error(StatusCode.PROTOCOL_ERROR, f"bad {name} response from {node.addr}: {e}")
        raise status_error(StatusCode.UNAVAILABLE, "; ".join(errors))

    def _take(self, addr: str, fresh: bool):
        """An idle live connection to addr, a new one, a _Broken (cannot connect), or None (all busy)."""
        with self._lock:
            idle = self._idle.get(addr)
            while idle and not fresh:
                conn = idle.pop()
                if conn.alive():
                    return conn
                self._count[addr] -= 1
                conn.close()
            if self._count.get(addr, 0) >= SYNC_CONNECTIONS_PER_SERVER:
                return None
            self._count[addr] = self._count.get(addr, 0) + 1
        try:
            return _Conn(addr, self._aio.config.token, self._aio.rpc.client_id, self._timeout)
        except _Broken as e:
            with self._lock:
                self._count[addr] -= 1
            return e
        except BaseException:
            with self._lock:
                self._count[addr] -= 1
            raise

    def _give_back(self, addr: str, conn: _Conn) -> None:
        with self._lock:
            if self._closed:
                self._count[addr] -= 1
                conn.close()
                return
            self._idle.setdefault(addr, []).append(conn)

    def _discard(self, addr: str, conn) -> None:
        if isinstance(conn, _Broken):
            return  # never counted
        conn.close()
        with self._lock:
            self._count[addr] -= 1

    def close(self) -> None:
        """Close the idle connections; those in use close when their call gives them back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
            for addr, conns in idle.items():
                self._count[addr] -= len(conns)
        if os.getpid() != self._pid:
            return  # a forked child's copies: the parent's sockets, never ours to touch
        for conns in idle.values():
            for conn in conns:
                conn.close()

