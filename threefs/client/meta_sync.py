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

Each client keeps to one meta server (picked by host and process id among the live ones, so clients spread
over them) for as long as it answers: that server's KV read cache then holds this client's working set
(its directories' records), where calls alternating between servers found them changed by the other
server's commits and read them again from the KV on every mutation. Failover is the async path's: the
next live meta server (from the routing the client's loop keeps fresh) with the same request id, so a
retried mutation never acts twice; the server that answered becomes the one this client keeps to. A pooled
connection the server closed (restart) is noticed before use by a zero-timeout poll (skipped for a
connection given back less than RECENT_S ago), and a call that fails on a reused connection is retried once
on a fresh one to the same server.

After a fork the child never touches the parent's sockets: the pool belongs to one process id.
"""

from __future__ import annotations

import os
import socket
import zlib

import msgspec

from threefs.common.status import StatusCode, status_error
from threefs.rpc.blocking import BlockingPool, Broken
from threefs.rpc.frame import KIND_REQUEST, body_encoder
from threefs.rpc.client import _decoder  # one decoder cache per process, shared with the async client
from threefs.rpc.schemas.mgmtd import META

SYNC_CONNECTIONS_PER_SERVER = 8  # blocking connections per meta server (servers allow 64 per client id)
# A connection given back less than this ago is used without polling it first (one system call less per
# call); should the server have closed it meanwhile, the call fails on it and runs again on a fresh one.
RECENT_S = 1.0
NOT_TAKEN = object()  # call() could not run this call here (no routing yet, every connection busy)


class SyncMetaCalls:
    """Pooled blocking connections to the meta servers of one AsyncClient (its token, client id, request ids,
    routing). Safe to use from any number of threads; belongs to the process that made it."""

    def __init__(self, aio, timeout: float):
        self._aio = aio
        self._timeout = timeout
        self._pool = BlockingPool(lambda: aio.config.token, lambda: aio.rpc.client_id, timeout,
                                  SYNC_CONNECTIONS_PER_SERVER, recent_s=RECENT_S)
        # (routing snapshot (immutable), kept-to node id, the order of servers made for them)
        self._order_cache: tuple = (None, None, [])
        # Where this client starts among the meta servers: by process id (and host), so that processes
        # started together (8 benchmark clients, DataLoader workers) spread evenly over the servers.
        self._seed = zlib.crc32(socket.gethostname().encode()) + os.getpid()
        self._keep_to: int | None = None  # node id of the meta server that answered last

    def _order(self, routing) -> list:
        """The meta servers in the order this call tries them: the one kept to first (else the seed's),
        then the rest round the list. Cached per routing snapshot and kept-to server."""
        cached_routing, cached_keep, order = self._order_cache  # one tuple: threads see it whole
        keep_to = self._keep_to
        if routing is not cached_routing or keep_to != cached_keep:
            servers = routing.nodes_of_type(META)
            start = self._seed
            for i, node in enumerate(servers):
                if node.node_id == keep_to:
                    start = i
                    break
            n = len(servers)
            order = [servers[(start + i) % n] for i in range(n)]
            self._order_cache = (routing, keep_to, order)
        return order

    def call(self, method: str, req, rsp_type):
        """The response, or NOT_TAKEN when the call must take the event loop's path instead."""
        aio = self._aio
        routing = aio.mgmtd.routing
        pool = self._pool
        if routing is None or not pool.usable():
            return NOT_TAKEN
        order = self._order(routing)
        if not order:
            return NOT_TAKEN  # the async path refreshes the routing and says what is wrong
        if getattr(req, "request_id", None) == 0:  # one id per call: failover retries reuse it
            req.request_id = next(aio._meta_request_ids)
        if aio.acting_user is not None and getattr(req, "user", 0) is None:
            req.user = aio.acting_user
        body = body_encoder.encode(req)
        name = "meta." + method
        errors = []
        for node in order:
            for fresh in (False, True):
                conn = pool.take(node.addr, fresh)
                if conn is None:  # every connection busy: the loop's path (same request id)
                    return NOT_TAKEN
                try:
                    if isinstance(conn, Broken):
                        raise conn
                    header = conn.exchange(KIND_REQUEST, name, body, self._timeout)
                except Broken as e:
                    reused = not isinstance(conn, Broken) and conn.used
                    pool.discard(node.addr, conn)
                    if reused and not fresh:
                        continue  # a pooled connection the server dropped: once more on a new one
                    errors.append(f"meta {node.node_id} at {node.addr}: {e}")
                    break
                except BaseException:
                    pool.discard(node.addr, conn)
                    raise
                pool.give_back(node.addr, conn)
                if header.status:
                    if header.status in (StatusCode.UNAVAILABLE, StatusCode.TIMEOUT):
                        errors.append(f"meta {node.node_id} at {node.addr}: {header.message}")
                        break
                    self._keep_to = node.node_id
                    raise status_error(header.status, header.message)
                self._keep_to = node.node_id
                try:
                    return _decoder(rsp_type).decode(header.body)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise status_error(StatusCode.PROTOCOL_ERROR, f"bad {name} response from {node.addr}: {e}")
        raise status_error(StatusCode.UNAVAILABLE, "; ".join(errors))

    def close(self) -> None:
        """Close the idle connections; those in use close when their call gives them back."""
        self._pool.close()
