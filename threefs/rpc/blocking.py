"""Blocking RPC connections, used from a caller's own thread (no event loop): meta calls (client/meta_sync.py)
and small batch reads (client/storage_sync.py).

The wire is the framing of rpc/frame.py unchanged: a hello with the client's token and client id, then
request frames; servers see an ordinary connection of that client id. `BlockingPool` keeps at most
`per_server` connections per server address; a thread takes an idle one (or opens one), uses it alone, and
gives it back. A pooled connection the server closed is noticed before use by a zero-timeout poll; a pool
made with `recent_s` skips that poll (a system call) for a connection given back less than `recent_s` ago,
for callers that retry a call that failed on a reused connection once on a fresh one (meta_sync does). After
a fork the child never touches the parent's sockets: a pool belongs to one process id.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import struct
import threading
import time

import msgspec

from threefs.common import limits, local_socket
from threefs.common.spin import AnswerWait
from threefs.common.status import StatusCode, status_error
from threefs.rpc.frame import (KIND_GRANT, KIND_HELLO, KIND_RTS, MAGIC, PREFIX, PREFIX_BYTES, Header, Scatter,
                               body_encoder, encode_frame_head)
from threefs.rpc.schemas.common import PROTOCOL_VERSION, Hello, HelloRsp

RECV_BYTES = 64 * 1024

_header_decoder = msgspec.msgpack.Decoder(Header)
# This process's id, kept current by a fork hook: os.getpid() is a system call, and usable() runs per call.
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


class Broken(Exception):
    """The connection cannot be used any more (closed, timed out, garbled); the call may go elsewhere."""


def _why(e: BaseException, timeout: float) -> str:
    if isinstance(e, (BlockingIOError, TimeoutError)):  # the kernel's SO_RCVTIMEO / SO_SNDTIMEO
        return f"timed out after {timeout:.1f} s"
    return f"{type(e).__name__} {e}".rstrip()


class BlockingConnection:
    """One blocking, authenticated connection to one server, used by one thread at a time."""

    def __init__(self, addr: str, token: str, client_id: str, timeout: float):
        self.addr = addr
        host, _, port = addr.rpartition(":")
        connect_timeout = min(timeout, limits.CONNECT_TIMEOUT_S)
        try:
            # A same-host server's Unix socket when it has one (common/local_socket.py), else TCP.
            self.sock = local_socket.connect_blocking(addr, connect_timeout)
            if self.sock is None:
                self.sock = socket.create_connection((host, int(port)), timeout=connect_timeout)
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise Broken(f"cannot connect to {addr}: {type(e).__name__} {e}".rstrip()) from e
        # A blocking socket whose timeouts the kernel keeps (SO_RCVTIMEO/SO_SNDTIMEO): with Python's own
        # socket timeout every send and receive is a poll() first and then the call, twice the system
        # calls of a round trip. A call that times out raises BlockingIOError (EAGAIN), as Python's
        # timeout raised TimeoutError; either is Broken.
        self.timeout = timeout
        self.sock.settimeout(None)
        tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1_000_000))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        # Answers are waited for in poll(POLLIN), not in recv(): a Unix socket wakes a reader blocked in
        # recv() when the server reads our request, not only when the answer comes (unix_write_space wakes
        # every sleeper on the socket): the caller would be woken twice per call, a context switch each.
        # Quick answers are waited for by spinning first (common/spin.py AnswerWait).
        self._answer = AnswerWait(self.sock.fileno())
        self._poll_ms = max(1, int(timeout * 1000))
        self._buf = bytearray(RECV_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._rids = itertools.count(1)
        self._scratch = memoryview(bytearray(0))  # payloads received without a destination of the caller's
        self.used = False
        self.given_back_s = 0.0  # time.monotonic() of the last give_back
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
        """Send one request frame and return the response's header; a payload is dropped (raises Broken
        on transport trouble). The header's body is valid until this connection's next call."""
        rid = self.send(kind, method, body, timeout)
        # The common case in one piece: nothing buffered, and the answer, header only, in one recv.
        if self._start == self._end:
            try:
                self._wait_readable()
                n = self.sock.recv_into(self._view)
            except OSError as e:
                raise Broken(f"response from {self.addr}: {_why(e, self.timeout)}") from e
            if n >= PREFIX_BYTES:
                magic, _flags, hlen, plen = PREFIX.unpack_from(self._buf, 0)
                if (n == PREFIX_BYTES + hlen and plen == 0 and magic == MAGIC
                        and hlen <= limits.FRAME_HEADER_BYTES_MAX):
                    try:
                        header = _header_decoder.decode(self._view[PREFIX_BYTES:n])
                    except msgspec.DecodeError as e:
                        raise Broken(f"response from {self.addr}: {_why(e, self.timeout)}") from e
                    if header.rid == rid and header.kind != KIND_RTS:
                        return header
            if n == 0:
                raise Broken(f"response from {self.addr}: EOFError connection closed by the server")
            self._start, self._end = 0, n  # anything else: the general path, from these bytes on
        header, _ = self.receive({rid: None})
        return header

    def send(self, kind: int, method: str, body: bytes, timeout: float) -> int:
        """Send one request frame (no payload); returns its request id for `receive`."""
        rid = next(self._rids)
        head = encode_frame_head(Header(kind, rid, method=method, timeout_ms=int(timeout * 1000),
                                        body=msgspec.Raw(body)), 0)
        try:
            self.sock.sendall(head)
        except OSError as e:
            raise Broken(f"{method} to {self.addr}: {_why(e, self.timeout)}") from e
        return rid

    def receive(self, expect: dict[int, memoryview | Scatter | None]) -> tuple[Header, memoryview | Scatter | None]:
        """The next response to one of the requests in `expect` ({request id: where its payload goes, or
        None}; requests may be answered in any order): its header and its payload, received into the
        given buffer (or Scatter: part by part, each digested as it fills) when that is large enough, else
        into a scratch buffer of this connection that stays valid until its next receive."""
        try:
            while True:
                header, payload_len = self._read_frame()
                if header.kind == KIND_RTS:  # a server asking to send a large answer: let it
                    self.sock.sendall(encode_frame_head(Header(KIND_GRANT, header.rid), 0))
                    continue
                if header.rid == 0 and header.status:  # a connection-level error: the server closes
                    raise status_error(header.status, f"{self.addr}: {header.message}")
                if header.rid not in expect:  # an answer to an earlier call that gave up (timeout): drop it
                    self._skip(payload_len)
                    continue
                if not payload_len:
                    return header, None
                recv_into = expect[header.rid]
                if type(recv_into) is Scatter and len(recv_into) >= payload_len:
                    dest = recv_into.head(payload_len)
                    for part in dest.parts:
                        self._read_into(part)
                        dest.filled(part)
                    return header, dest
                if recv_into is None or len(recv_into) < payload_len:
                    if len(self._scratch) < payload_len:
                        self._scratch = memoryview(bytearray(payload_len))
                    recv_into = self._scratch
                dest = recv_into[:payload_len]
                self._read_into(dest)
                return header, dest
        except (OSError, EOFError, msgspec.DecodeError) as e:
            raise Broken(f"response from {self.addr}: {_why(e, self.timeout)}") from e

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
            self._wait_readable()
            n = self.sock.recv_into(self._view[self._end:])
            if n == 0:
                raise EOFError("connection closed by the server")
            self._end += n

    def _wait_readable(self) -> None:
        """Return when the socket has bytes to read (spinning first when answers come quickly and a CPU is
        free: common/spin.py)."""
        if not self._answer.wait(self._poll_ms):
            raise TimeoutError(f"nothing to read within {self._poll_ms} ms")

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

    def _read_into(self, dest: memoryview) -> None:
        """The next len(dest) bytes of the stream into dest: what is buffered, then straight from the socket."""
        have = min(len(dest), self._end - self._start)
        if have:
            dest[:have] = self._view[self._start:self._start + have]
            self._start += have
            if self._start == self._end:
                self._start = self._end = 0
        got = have
        while got < len(dest):
            n = self.sock.recv_into(dest[got:])
            if n == 0:
                raise EOFError("connection closed by the server")
            got += n

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


class BlockingPool:
    """At most `per_server` blocking connections per server address, shared by any number of threads.
    Belongs to the process that made it."""

    def __init__(self, token_of, client_id_of, timeout: float, per_server: int, recent_s: float = 0.0):
        self._token_of = token_of  # callables: the values may change (token refresh, reconnect)
        self._client_id_of = client_id_of
        self.timeout = timeout
        self.per_server = per_server
        self.recent_s = recent_s  # given back more recently than this: used without the liveness poll
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._idle: dict[str, list[BlockingConnection]] = {}
        self._count: dict[str, int] = {}  # open connections per server (idle + in use)
        self.closed = False

    def usable(self) -> bool:
        return not self.closed and _pid[0] == self.pid

    def in_use(self, addr: str) -> int:
        """Connections to addr taken and not given back (a moment's snapshot, without the lock)."""
        return self._count.get(addr, 0) - len(self._idle.get(addr, ()))

    def take(self, addr: str, fresh: bool = False):
        """An idle live connection to addr, a new one, a Broken (cannot connect), or None (all busy)."""
        with self._lock:
            idle = self._idle.get(addr)
            while idle and not fresh:
                conn = idle.pop()
                if (self.recent_s and time.monotonic() - conn.given_back_s < self.recent_s) or conn.alive():
                    return conn
                self._count[addr] -= 1
                conn.close()
            if self._count.get(addr, 0) >= self.per_server:
                return None
            self._count[addr] = self._count.get(addr, 0) + 1
        try:
            return BlockingConnection(addr, self._token_of(), self._client_id_of(), self.timeout)
        except Broken as e:
            with self._lock:
                self._count[addr] -= 1
            return e
        except BaseException:
            with self._lock:
                self._count[addr] -= 1
            raise

    def give_back(self, addr: str, conn: BlockingConnection) -> None:
        conn.used = True
        if self.recent_s:
            conn.given_back_s = time.monotonic()
        with self._lock:
            if self.closed:
                self._count[addr] -= 1
                conn.close()
                return
            self._idle.setdefault(addr, []).append(conn)

    def discard(self, addr: str, conn) -> None:
        if isinstance(conn, Broken) or conn is None:
            return  # never counted
        conn.close()
        with self._lock:
            self._count[addr] -= 1

    def close(self) -> None:
        """Close the idle connections; those in use close when their call gives them back."""
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, {}
            for addr, conns in idle.items():
                self._count[addr] -= len(conns)
        if os.getpid() != self.pid:
            return  # a forked child's copies: the parent's sockets, never ours to touch
        for conns in idle.values():
            for conn in conns:
                conn.close()
