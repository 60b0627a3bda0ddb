"""Small batch reads from the caller's own thread: blocking sockets to the storage services, no trip
through the client's event loop.

A synchronous `batch_read` used to hand its batch to the loop thread (a self-pipe write and a wakeup),
which sent the packed requests, woke once per response, and woke the caller through a condition variable.
For a batch of 64 small samples (FFRecord, a KV lookup) those hops cost more than the reads themselves, and
every thread of a process queued behind the one loop thread. Here the caller's thread plans the batch exactly
as the loop would (`StorageClient._plan`: replica per IO, ≤ 256 IOs per request), sends every request on a
blocking connection per storage service (pipelined when one service gets several), and receives and checks
each response itself (`StorageClient.apply_packed`: status, crc32c of what arrived, placement). The GIL is
released while it waits in `recv_into`, so several threads read at once, each on its own connections.

What this path does not do itself, it hands to the event loop's path (`StorageClient.read_batch`), which
keeps every semantic: an IO that failed retryably (replica down, stale routing, chunk not committed,
damaged on arrival) is retried there on another replica, and a connection that broke or timed out makes
its IOs go there too. Batches with IOs of SOLO_IO_BYTES_MIN or more over SYNC_SOLO_BYTES_MAX in all or
with such an IO from a chunk's start (streamed better by the loop, or whole chunks it may send zero-copy),
batches over SYNC_BATCH_BYTES_MAX, and calls when every connection of a service is busy take the loop's path
from the start. Big IOs here are requests of their own, received straight into the caller's buffer.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from threefs.cluster.storage_client import (SCATTER_IO_BYTES_MIN, SOLO_IO_BYTES_MIN, ReadBatch, _aligned,
                                            _arrived_crcs, fail_ios, take_retries, zero_dests)
from threefs.common import limits
from threefs.common.ids import chunk_id
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.blocking import BlockingPool, Broken
from threefs.rpc.client import _decoder
from threefs.rpc.frame import KIND_REQUEST, Scatter, body_encoder
from threefs.rpc.schemas import storage as ss

# Where this process's threads start taking turns (see SyncStorageReads.read): its pid, and in a forked child
# the parent's start plus the number of forks the parent had made, so the workers a process forks one after
# another (a DataLoader's) start on consecutive services whatever their pids.
_spread = [os.getpid(), 0]  # [start, forks made by this process]


def _before_fork() -> None:
    _spread[1] += 1


def _after_fork_in_child() -> None:
    _spread[0], _spread[1] = _spread[0] + _spread[1], 0


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)

SYNC_CONNECTIONS_PER_SERVER = 8  # blocking connections per storage service (one per thread reading)
SYNC_BATCH_BYTES_MAX = 16 * limits.MiB
# A batch with an IO of SOLO_IO_BYTES_MIN or more (a random batch of 64 KiB samples, some of them back to
# back in the file and so read as one IO) takes this path up to this many bytes in all, and only if none of
# those IOs starts at a chunk's start (it may be the whole chunk, which the loop's path may have sent
# zero-copy or read with O_DIRECT); bigger batches stream on the loop (many requests in flight per service)
SYNC_SOLO_BYTES_MAX = 8 * limits.MiB


class SyncStorageReads:
    """Pooled blocking connections to the storage services of one AsyncClient. Safe to use from any
    number of threads; belongs to the process that made it."""

    sticky = True  # False: every batch takes the next turn of the storage client's round robin

    def __init__(self, aio, timeout: float):
        self._aio = aio
        self._timeout = timeout
        self._pool = BlockingPool(lambda: aio.config.token, lambda: aio.rpc.client_id, timeout,
                                  SYNC_CONNECTIONS_PER_SERVER)
        self._turns = threading.local()  # per thread: the service its small batches start at (see read)
        self.batches = 0  # batches served here (first pass), for tests and statistics
        self.handed_over = 0  # batches some of whose IOs then went to the loop's path

    def _sticky_turn(self, routing) -> int:
        """This thread's turn: the service its last read went to, while no other thread of this client reads
        from it (StorageClient.free_turn), else the next free one. A thread reads one batch at a time, and a
        service that served its last one serves the next for less CPU than a sleeping, cold one (measured,
        single 4 KiB reads from a file object: 7.0-7.1k -> 10.1-10.6k a second; docs/client.md).
        A thread's first turn is the next of the round robin, offset per process (_spread: forked DataLoader
        workers, whose clients all start their round robin at 0, start on consecutive services)."""
        storage = self._aio.storage
        turn = getattr(self._turns, "turn", None)
        if turn is None:
            turn = next(storage._rr) + _spread[0]
        turn = self._turns.turn = storage.free_turn(routing, turn, self._pool.in_use)
        return turn

    def read(self, batch: ReadBatch) -> np.ndarray | None:
        """One pass over the batch's IOs from this thread. None: not taken (nothing done; use the loop's
        path for all of it). Otherwise the IO indices the loop's path must still read (retryable failures,
        their errors cleared; possibly none)."""
        aio = self._aio
        routing = aio.mgmtd.routing
        if routing is None or not self._pool.usable():
            return None
        lengths = batch.ios["length"]
        if not len(lengths):
            return None
        total = int(lengths.sum())
        if total > SYNC_BATCH_BYTES_MAX:
            return None
        if int(lengths.max()) >= SOLO_IO_BYTES_MIN:
            big = lengths >= SOLO_IO_BYTES_MIN
            if total > SYNC_SOLO_BYTES_MAX or (batch.ios["offset"][big] == 0).any():
                return None  # (an IO from a chunk's start may be the whole chunk: zero-copy on the loop's path)
        pending = np.flatnonzero(lengths > 0)
        storage = aio.storage
        # A thread's batches start their turn at the same service (_sticky_turn); a batch some of whose IOs
        # had to be handed over moves the thread on to the next service
        turn = self._sticky_turn(routing) if self.sticky else None
        requests = storage._plan(routing, batch, pending, turn)
        by_addr: dict[str, list[np.ndarray]] = {}
        for addr, idx in requests:
            by_addr.setdefault(addr, []).append(idx)
        conns = {}
        unreachable: dict[str, Broken] = {}
        try:
            for addr in by_addr:
                try:
                    conn = self._pool.take(addr)
                except ThreeFSError:  # refused at hello (too many connections, a token): the loop's path
                    return None
                if conn is None:  # every connection to this service busy: the loop's path
                    return None
                if isinstance(conn, Broken):  # cannot connect: its IOs fail over on the loop's path
                    unreachable[addr] = conn
                    continue
                conns[addr] = conn
            self.batches += 1
            for addr, e in unreachable.items():  # (only now: a batch sent the loop's way has no errors yet)
                for idx in by_addr[addr]:
                    fail_ios(batch, idx, status_error(StatusCode.UNAVAILABLE, str(e)))
            sent = {addr: self._send(conn, by_addr[addr], batch) for addr, conn in conns.items()}
            for addr, conn in list(conns.items()):
                if not self._receive(addr, conn, by_addr[addr], sent[addr], batch, storage):
                    del conns[addr]
                    self._pool.discard(addr, conn)
        finally:
            for addr, conn in conns.items():
                self._pool.give_back(addr, conn)
        retry = take_retries(batch, pending)
        if len(retry):
            self.handed_over += 1
            if turn is not None:
                self._turns.turn = turn + 1
        return retry

    def read_one(self, attr, offset: int, dest: memoryview) -> int | None:
        """One small read that lies in one chunk (a file object's random read, a batch_read of one item),
        from this thread in scalar Python: the same request, replica choice and arrival checks as `read`,
        without the arrays a batch is planned and checked with (~10 numpy calls of 1-5 us per step).
        Returns the bytes read (clamped to attr's length; a hole reads as zeros), or None: not taken, or
        anything but a clean answer (an error status, a broken connection, bytes damaged on the way);
        the caller then reads it the general way, which retries elsewhere and reports errors, trying the
        replica that failed here last (take_failed). Nothing of dest beyond the bytes read is written,
        except zeros for a hole."""
        self._turns.failed = None
        n = min(len(dest), attr.length - offset)
        layout = attr.layout
        if n <= 0 or n >= SOLO_IO_BYTES_MIN or layout is None or offset < 0:
            return None
        cs = layout.chunk_size
        index, within = divmod(offset, cs)
        if within + n > cs or not self._pool.usable():
            return None
        aio = self._aio
        routing = aio.mgmtd.routing
        if routing is None:
            return None
        storage = aio.storage
        try:
            chains = aio._chains_of(routing, layout)
            cid = chunk_id(attr.inode, index)
        except ThreeFSError:
            return None
        turn = self._sticky_turn(routing) if self.sticky else next(storage._rr) + _spread[0]  # as read()
        planned = storage.one_read_request(routing, int(chains[index % len(chains)]), cid, within, n, turn)
        if planned is None:
            return None
        addr, target, record = planned
        try:
            conn = self._pool.take(addr)
        except ThreeFSError:  # refused at hello (too many connections, a token)
            return None
        if conn is None:  # every connection to it busy
            return None
        if isinstance(conn, Broken):  # cannot connect
            self._failed(target, turn)
            return None
        self.batches += 1
        view = dest[:n]
        ok = False
        try:
            body = body_encoder.encode(ss.PackedReadReq(record))
            rid = conn.send(KIND_REQUEST, "storage.read_packed", body, self._timeout)
            header, payload = conn.receive({rid: view})
            ok = True
        except (Broken, ThreeFSError):
            self._failed(target, turn)
            return None
        finally:
            if ok:
                self._pool.give_back(addr, conn)
            else:
                self._pool.discard(addr, conn)
        try:
            rsp = None if header.status else _decoder(ss.PackedReadRsp).decode(header.body)
        except Exception:  # msgspec's DecodeError / ValidationError: a malformed answer
            rsp = None
        if rsp is None or storage.one_read_answer(rsp, payload, view) is None:
            self._failed(target, turn)
            return None
        return n

    def _failed(self, target: int, turn: int) -> None:
        """read_one got no clean answer from `target`: the batch path reads it, that target last, and this
        thread's next reads start at the next service (a service that went away keeps failing until the
        routing says so)."""
        self._turns.failed = target
        if self.sticky:
            self._turns.turn = turn + 1

    def take_failed(self) -> int | None:
        """The target this thread's last read_one asked and got no clean answer from (None: none)."""
        failed, self._turns.failed = getattr(self._turns, "failed", None), None
        return failed

    def _send(self, conn, requests: list[np.ndarray], batch: ReadBatch) -> tuple[dict, Broken | None]:
        """Send the requests on one connection: ({request id: (IO indices, lengths, slot ends)}, None), or
        the error that stopped sending (then nothing of this service is received)."""
        sent = {}
        zero_copy_ok = self._aio.storage.zero_copy
        for idx in requests:
            ios = batch.ios[idx]
            lengths = ios["length"].astype(np.int64)
            # with an IO of 32 KiB or more the server may send big ones from its data files (every IO of the
            # request is checked on arrival here then)
            zero_copy = zero_copy_ok and int(lengths.max()) >= SCATTER_IO_BYTES_MIN
            body = body_encoder.encode(ss.PackedReadReq(ios.tobytes(), False, False, zero_copy))
            try:
                rid = conn.send(KIND_REQUEST, "storage.read_packed", body, self._timeout)
            except Broken as e:
                return {}, e
            sent[rid] = (idx, lengths, np.cumsum(_aligned(lengths)), zero_copy)
        return sent, None

    def _receive(self, addr: str, conn, requests: list[np.ndarray], sent: tuple, batch: ReadBatch,
                 storage) -> bool:
        """Receive and apply every answer of one connection; False if the connection broke (the IOs not
        answered get a retryable error, so they fail over)."""
        sent, error = sent
        if error is not None:
            for idx in requests:
                fail_ios(batch, idx, status_error(StatusCode.UNAVAILABLE, str(error)))
            return False
        expect = {rid: _in_place(batch, idx, lengths, ends, storage)
                  for rid, (idx, lengths, ends, _) in sent.items()}
        while expect:
            try:
                header, payload = conn.receive(expect)
            except (Broken, ThreeFSError) as e:  # transport trouble, or the server closing with a status
                err = e if isinstance(e, ThreeFSError) else status_error(StatusCode.UNAVAILABLE, str(e))
                for rid, target in expect.items():
                    fail_ios(batch, sent[rid][0], err)
                    if type(target) is Scatter:  # a slot received in part may hold another IO's bytes
                        zero_dests(batch, sent[rid][0])
                return False
            target = expect.pop(header.rid)
            # received in place (the one IO's destination, or a run of destinations laid out as the payload)
            single = target is not None and (payload is None or len(payload) <= len(target))
            idx, lengths, ends, zero_copy = sent[header.rid]
            if header.status:
                fail_ios(batch, idx, status_error(header.status, f"{addr}: {header.message}"))
                continue
            try:
                rsp = _decoder(ss.PackedReadRsp).decode(header.body)
            except Exception as e:  # msgspec's DecodeError / ValidationError
                fail_ios(batch, idx, status_error(StatusCode.PROTOCOL_ERROR,
                                                  f"bad read_packed response from {addr}: {e}"))
                continue
            crcs = None
            if type(target) is Scatter:  # checked whatever check_arrival says (see StorageClient._scatter)
                crcs = _arrived_crcs(payload, lengths) if type(payload) is Scatter else [None] * len(idx)
            # (no damage reports from here: this path sends no whole chunk from a chunk's start, the only IOs a
            # server sends unchecked; a part arrives with the crc32c of the server's read, like any other)
            storage.apply_packed(addr, rsp, payload, batch, idx, lengths, ends, single, zero_copy, crcs)
        return True

    def close(self) -> None:
        """Close the idle connections; those in use close when their batch gives them back."""
        self._pool.close()


def _in_place(batch: ReadBatch, idx: np.ndarray, lengths: np.ndarray, ends: np.ndarray,
              storage=None) -> memoryview | Scatter | None:
    """Where a request's payload can be received straight into the caller's memory, or None (received into
    the connection's buffer, then copied out): the one IO's destination, or, for several IOs, the span of one
    destination buffer in which each IO's bytes start exactly where its payload slot does (every IO but the
    last a multiple of IO_BUFFER_ALIGN long, back to back in request order: fixed-size samples of 1 or 64 KiB,
    token records, ... read into one batch buffer), or else, when every IO is at least SCATTER_IO_BYTES_MIN
    long, each IO's own destination (StorageClient._scatter: random samples of 64 KiB). Saves a copy of every
    byte; the arrival checks are the same (StorageClient.apply_packed with single=True)."""
    if len(idx) == 1:
        return batch.dest(int(idx[0]))
    ks = idx.tolist()
    dest_of, dest_off = batch.dest_of, batch.dest_off
    d = dest_of[ks[0]]
    if all(dest_of[k] == d for k in ks):
        starts = ends - _aligned(lengths)
        offs = np.fromiter((dest_off[k] for k in ks), np.int64, len(ks))
        base = int(offs[0])
        if np.array_equal(offs - base, starts):
            return batch.dests[d][base:base + int(starts[-1] + lengths[-1])]
    if storage is not None and int(lengths.min()) >= SCATTER_IO_BYTES_MIN:
        return storage._scatter(batch, idx, lengths)
    return None
