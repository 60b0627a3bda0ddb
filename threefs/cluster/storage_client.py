"""Client of the storage services: chunk writes to chain heads, batched reads from any SERVING replica.

The data path never touches meta: callers give (chain, chunk id, offset, length, buffer) computed from
the file layout, and this module finds targets in the routing info, bounds the requests in flight per
storage service, and retries what is retryable (routing changed, replica down, chunk not committed).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import logging
import struct
from dataclasses import dataclass, field

import numpy as np

from threefs.cluster.mgmtd_client import MgmtdClient
from threefs.cluster.routing import Routing, serving_targets, write_targets
from threefs.common import crc32c
from threefs.common import limits
from threefs.common.buffers import IO_BUFFER_ALIGN, BufferPool
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.client import RpcClient
from threefs.rpc.frame import Scatter
from threefs.rpc.schemas import storage as ss
from threefs.rpc.schemas.mgmtd import STORAGE

log = logging.getLogger(__name__)

RETRY_S = 20.0  # total time an IO keeps retrying retryable errors
PACKED_IOS_MAX = 256  # IOs in one storage.read_packed request (a client batch is split into these)
BATCH_BYTES_MAX = 4 * limits.MiB
SOLO_IO_BYTES_MIN = 128 * limits.KiB  # larger IOs skip batching so they need no scatter copy
# Big IOs to one service go together, up to this many (and bytes) per request: each is received straight into
# its destination all the same (a Scatter), and a server may send each whole chunk among them zero-copy. One
# IO per request cost a request's Python per chunk on both sides (sequential 1 MiB batch_read: a third of the
# CPU of client and server).
BIG_IOS_PER_REQUEST = 8
BIG_REQUEST_BYTES_MAX = 8 * limits.MiB
# A packed request whose IOs are all at least this long is received straight into the IOs' destinations (a
# frame.Scatter: one part per IO, the slots' alignment padding into a scratch), not into one buffer and then
# copied out; smaller ones are copied (a part costs a receive system call of its own)
SCATTER_IO_BYTES_MIN = 32 * limits.KiB
# A read of at most this many small items (FUSE requests the gate sent together) is planned, packed and
# checked in scalar Python (StorageClient._read_few_items): the batch path's arrays cost more for so few
FEW_ITEMS_MAX = 8
PLAN_SMALL_IOS_MAX = 64  # batches of at most this many IOs are planned in plain Python (StorageClient._plan_small)


# The IO record of storage.read_packed (rpc/schemas/storage.py READ_IO_FORMAT), with the chunk id's fields
# (common/ids.py: tenant, reserved, inode, track, chunk index; big-endian) so they can be filled in bulk.
CHUNK_DTYPE = np.dtype([("tenant", "u1"), ("reserved", "u1"), ("inode", ">u8"), ("track", ">u2"),
                        ("index", ">u4")])
IO_DTYPE = np.dtype([("chain", "<u4"), ("target", "<u4"), ("chunk", CHUNK_DTYPE), ("offset", "<u8"),
                     ("length", "<u4")])
RESULT_DTYPE = np.dtype([("status", "<u4"), ("length", "<u4"), ("commit_ver", "<u8"), ("chunk_crc", "<u4"),
                         ("data_crc", "<u4")])
assert IO_DTYPE.itemsize == ss.READ_IO_BYTES and RESULT_DTYPE.itemsize == ss.READ_RESULT_BYTES
_IO_RECORD = struct.Struct(ss.READ_IO_FORMAT)  # one IO record / one result record, for a read of one IO
_RESULT_RECORD = struct.Struct(ss.READ_RESULT_FORMAT)


def _aligned(lengths: np.ndarray) -> np.ndarray:
    return (lengths.astype(np.int64) + (IO_BUFFER_ALIGN - 1)) // IO_BUFFER_ALIGN * IO_BUFFER_ALIGN


class ReadBatch:
    """The chunk IOs of one batch read as columns: one IO_DTYPE record per IO (chain, target, chunk id,
    offset, length) and where its bytes go (dests[dest_of[k]][dest_off[k]:...]); no Python object per IO.
    After StorageClient.read_batch: got[k] = bytes read from storage (the rest of the IO is zeros) or
    errors[k] = the IO's error."""

    def __init__(self, ios: np.ndarray, dests: list, dest_of, dest_off):
        self.ios = ios
        self.dests = dests  # writable byte memoryviews
        self.dest_of = dest_of  # per IO: index into dests (a list, or an int array)
        self.dest_off = dest_off  # per IO: byte offset in its dest
        self.got = np.zeros(len(ios), dtype=np.int64)
        self.errors: dict[int, ThreeFSError] = {}
        self.avoid: dict[int, set] = {}  # per IO: replicas that failed it (tried last)
        # crc32c each IO's bytes on arrival against storage's; False only for callers that verify their
        # own end-to-end checksum afterwards (and read again with it on if that fails)
        self.check_arrival = True

    @classmethod
    def of_items(cls, items: list["ReadItem"]) -> "ReadBatch":
        ios = np.zeros(len(items), dtype=IO_DTYPE)
        if items:
            ios["chain"] = [it.chain_id for it in items]
            ios["chunk"] = np.frombuffer(b"".join(it.chunk_id for it in items), CHUNK_DTYPE)
            ios["offset"] = [it.offset for it in items]
            ios["length"] = [it.length for it in items]
        return cls(ios, [it.dest for it in items], range(len(items)), [0] * len(items))

    def dest(self, k: int) -> memoryview:
        o = int(self.dest_off[k])
        return self.dests[self.dest_of[k]][o:o + int(self.ios["length"][k])]

    def chunk_hex(self, k: int) -> str:
        return self.ios["chunk"][k:k + 1].tobytes().hex()


@dataclass
class ReadItem:
    chain_id: int
    chunk_id: bytes
    offset: int
    length: int
    dest: memoryview  # exactly `length` bytes; holes and bytes past the chunk's end become zeros
    result: int = -1  # bytes read from storage (>= 0) once done
    error: ThreeFSError | None = None
    target: int = 0  # the replica chosen for the current attempt
    avoid: set = field(default_factory=set)  # replicas that failed this item (tried last)


class StorageClient:
    def __init__(self, rpc: RpcClient, mgmtd: MgmtdClient, *,
                 inflight_per_node: int = limits.INFLIGHT_REQUESTS_PER_SERVICE_MAX,
                 timeout: float = limits.CALL_TIMEOUT_S_DEFAULT):
        self.rpc = rpc
        self.mgmtd = mgmtd
        self.timeout = timeout
        self.inflight_per_node = inflight_per_node
        self._sems: dict[str, asyncio.Semaphore] = {}
        self._request_ids = itertools.count(1)
        self._rr = itertools.count()
        self.pool = BufferPool()  # scatter buffers of multi-IO reads
        self._pad = memoryview(bytearray(IO_BUFFER_ALIGN))  # alignment padding of Scatter-received slots
        self.damaged_reads = 0  # IOs whose bytes failed their checksum on arrival (then read elsewhere)
        self._replicas_cache: dict[int, list | ThreeFSError] = {}
        self._replicas_version = -1
        # the storage services in one order per routing version (_services): a turn names a service
        self._services_of: tuple[int, list[str], dict[str, int]] = (-1, [], {})
        self._inflight: dict[str, int] = {}  # requests of ours in flight per service (_call)
        self._turn = os.getpid()  # the turn of small reads on this path (_small_turn); processes spread out
        self._tasks: set[asyncio.Task] = set()  # damage reports in flight
        # let servers send whole chunks from their data files (see PackedReadReq); THREEFS_ZERO_COPY=0 turns
        # it off (to compare, e.g. benchmarks/checkpoint.py run both ways)
        self.zero_copy = os.environ.get("THREEFS_ZERO_COPY", "1") != "0"

    def _sem(self, addr: str) -> asyncio.Semaphore:
        sem = self._sems.get(addr)
        if sem is None:
            sem = self._sems[addr] = asyncio.Semaphore(self.inflight_per_node)
        return sem

    async def _call(self, addr: str, method: str, req, rsp_type, **kwargs):
        """One storage RPC, at most `inflight_per_node` per service at a time; waiting for a slot counts
        against the call's deadline (`self.timeout`), so a stuck service cannot stall callers forever."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        sem = self._sem(addr)
        if not sem.locked():  # a slot is free: taken at once, no deadline to arm (~5 us less per call)
            await sem.acquire()
        else:
            try:
                async with asyncio.timeout(self.timeout):
                    await sem.acquire()
            except TimeoutError:
                raise status_error(StatusCode.TIMEOUT, f"{addr}: no request slot free for {self.timeout:.0f} s "
                                   f"({self.inflight_per_node} in flight); the service is overloaded or "
                                   "stuck") from None
        inflight = self._inflight
        inflight[addr] = inflight.get(addr, 0) + 1
        try:
            return await self.rpc.call(addr, method, req, rsp_type,
                                       timeout=max(0.001, deadline - loop.time()), **kwargs)
        finally:
            inflight[addr] -= 1
            sem.release()

    def free_turn(self, routing: Routing, turn: int, busy) -> int:
        """`turn`, or the first turn after it whose service (_services) is not `busy(addr)` (has a request of
        ours in flight), or `turn` if all are. Small reads stay on one service while it is free: a reader at
        queue depth 1 (a FUSE read at a time, a file object's jumps, a thread's batches) keeps that service
        busy, and so awake and hot, where taking turns woke each service from its sleep for every third
        request (on this kind of VM a wake-up costs ~20 us of CPU on each side, and a service's Python runs
        slower on cold caches); readers at once spread over the services as they find them busy."""
        addrs = self._services(routing)[0]
        n = len(addrs)
        for step in range(n):
            if not busy(addrs[(turn + step) % n]):
                return turn + step
        return turn

    def _small_turn(self, routing: Routing) -> int:
        """The turn of a small read on this path (one item, or a gate's few): free_turn from the last one."""
        inflight = self._inflight
        turn = self._turn = self.free_turn(routing, self._turn, lambda addr: inflight.get(addr, 0) > 0)
        return turn

    async def _retrying(self, what: str, attempt):
        """Run attempt(routing) until it succeeds, refreshing routing after retryable errors."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETRY_S
        delay = 0.005
        routing = await self.mgmtd.get()
        while True:
            try:
                return await attempt(routing)
            except ThreeFSError as e:
                if not e.retryable or loop.time() + delay > deadline:
                    if e.retryable:
                        raise status_error(e.code, f"{what}: gave up after {RETRY_S:.0f} s: {e.message}")
                    raise
                log.debug("%s: %s; retrying", what, e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            try:
                routing = await self.mgmtd.refresh()
            except ThreeFSError as e:
                log.debug("routing refresh failed: %s", e)

    # -- updates ---------------------------------------------------------------------------------
    async def _update(self, req: ss.UpdateReq, payload=None) -> ss.UpdateRsp:
        req.tag = ss.RequestTag(self.rpc.client_id, next(self._request_ids))  # same tag on retries

        async def attempt(routing: Routing) -> ss.UpdateRsp:
            chain = routing.chain(req.chain_id)
            order = write_targets(chain)
            if not order:
                raise status_error(StatusCode.NO_SERVING_TARGET, f"chain {req.chain_id} has no "
                                   f"writable target ({routing.describe_chain(req.chain_id)}); see "
                                   "`threefs status`")
            req.chain_ver = chain.version
            addr = routing.target_addr(order[0])
            rsp, _ = await self._call(addr, "storage.update", req, ss.UpdateRsp, payload=payload)
            return rsp

        return await self._retrying(f"update of chunk {req.chunk_id.hex()} on chain {req.chain_id}",
                                    attempt)

    async def write_chunk(self, chain_id: int, chunk_id: bytes, offset: int, data,
                          chunk_size: int) -> ss.UpdateRsp:
        if offset < 0 or offset + len(data) > chunk_size:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"write [{offset}, {offset + len(data)}) crosses the chunk size {chunk_size}")
        req = ss.UpdateReq(chain_id, 0, chunk_id, ss.WRITE, offset, len(data), chunk_size,
                           crc32c.crc32c(data))
        return await self._update(req, data)

    async def truncate_chunk(self, chain_id: int, chunk_id: bytes, length: int,
                             chunk_size: int) -> ss.UpdateRsp:
        return await self._update(ss.UpdateReq(chain_id, 0, chunk_id, ss.TRUNCATE, 0, length, chunk_size))

    async def remove_range(self, chain_id: int, begin: bytes, end: bytes, chunk_size: int) -> int:
        async def attempt(routing: Routing) -> int:
            chain = routing.chain(chain_id)
            order = write_targets(chain)
            if not order:
                raise status_error(StatusCode.NO_SERVING_TARGET, f"chain {chain_id} has no writable target")
            req = ss.RemoveRangeReq(chain_id, chain.version, begin, end, chunk_size)
            rsp, _ = await self.rpc.call(routing.target_addr(order[0]), "storage.remove_range", req,
                                         ss.RemoveRangeRsp, timeout=self.timeout * 4)
            return rsp.removed

        return await self._retrying(f"remove of chunks on chain {chain_id}", attempt)

    async def remove_ranges(self, chain_id: int, ranges: list[tuple[bytes, bytes]], chunk_size: int) -> int:
        """remove_range for many [begin, end) ranges of one chain (GC of many files): one request per
        REMOVE_RANGES_MAX ranges. A storage service without the call (an older one) gets one remove_range
        per range instead."""
        removed = 0
        for i in range(0, len(ranges), ss.REMOVE_RANGES_MAX):
            part = ranges[i:i + ss.REMOVE_RANGES_MAX]

            async def attempt(routing: Routing, part=part) -> int:
                chain = routing.chain(chain_id)
                order = write_targets(chain)
                if not order:
                    raise status_error(StatusCode.NO_SERVING_TARGET, f"chain {chain_id} has no writable target")
                req = ss.RemoveRangesReq(chain_id, chain.version, part, chunk_size)
                rsp, _ = await self.rpc.call(routing.target_addr(order[0]), "storage.remove_ranges", req,
                                             ss.RemoveRangeRsp, timeout=self.timeout * 4)
                return rsp.removed

            try:
                removed += await self._retrying(f"remove of chunks of {len(part)} ranges on chain {chain_id}",
                                                attempt)
            except ThreeFSError as e:
                if e.code != StatusCode.UNKNOWN_METHOD:
                    raise
                for begin, end in part:
                    removed += await self.remove_range(chain_id, begin, end, chunk_size)
        return removed

    async def last_chunk(self, chain_id: int, begin: bytes, end: bytes) -> ss.LastChunkRsp:
        async def attempt(routing: Routing) -> ss.LastChunkRsp:
            targets = serving_targets(routing.chain(chain_id))
            if not targets:
                raise status_error(StatusCode.NO_SERVING_TARGET, f"chain {chain_id} has no SERVING target")
            rsp, _ = await self.rpc.call(routing.target_addr(targets[0]), "storage.last_chunk",
                                         ss.LastChunkReq(chain_id, begin, end), ss.LastChunkRsp)
            return rsp

        return await self._retrying(f"last-chunk query on chain {chain_id}", attempt)

    # -- reads -----------------------------------------------------------------------------------
    async def read(self, items: list[ReadItem], *, allow_uncommitted: bool = False) -> None:
        """Fill every item's dest; per-item errors are stored in item.error (never raised)."""
        failed = None
        if len(items) == 1 and not allow_uncommitted:
            done, failed = await self._read_one_item(items[0])
            if done:
                return
        elif len(items) <= FEW_ITEMS_MAX and not allow_uncommitted:
            left = await self._read_few_items(items)
            if not left:
                return
            rest = sorted(left)
            sub = [items[k] for k in rest]
            batch = ReadBatch.of_items(sub)
            for j, k in enumerate(rest):
                if left[k] is not None:  # the replica that just failed it is tried last
                    batch.avoid[j] = {left[k]}
            await self.read_batch(batch)
            _batch_results(batch, sub)
            return
        batch = ReadBatch.of_items(items)
        if failed is not None:  # the replica that just failed it is tried last
            batch.avoid[0] = {failed}
        await self.read_batch(batch, allow_uncommitted=allow_uncommitted)
        _batch_results(batch, items)

    async def _read_few_items(self, items: list[ReadItem]) -> dict[int, int | None]:
        """A few small items (FUSE requests the gate sent together) read as _read_one_item reads one: planned
        with one_read_request (all to the service the turn picks for the first, where their chains have a
        replica there, as _plan_small sends a run of small IOs), one read_packed per service, answers checked
        with struct (few_read_answer). Returns {item
        index: the target whose answer was not clean, or None} of the items left to the batch path (retries,
        errors, big items)."""
        left: dict[int, int | None] = {}
        routing = await self.mgmtd.get()
        turn = self._small_turn(routing)
        groups: dict[str, list] = {}
        prefer = None  # the service the first item goes to: the others too where their chains have a replica
        for k, it in enumerate(items):
            planned = None if it.avoid else self.one_read_request(routing, it.chain_id, it.chunk_id, it.offset,
                                                                   it.length, turn, prefer)
            if planned is None:
                left[k] = None
                continue
            prefer = planned[0]
            groups.setdefault(planned[0], []).append((k, planned[1], planned[2]))
        if len(groups) == 1:
            left.update(await self._read_few_from(*next(iter(groups.items())), items))
        elif groups:
            for part in await asyncio.gather(*(self._read_few_from(addr, g, items) for addr, g in groups.items())):
                left.update(part)
        for addr, group in groups.items():
            if any(left.get(k) is not None for k, _, _ in group):
                self._move_on(addr, routing)
        return left

    async def _read_few_from(self, addr: str, group: list, items: list[ReadItem]) -> dict[int, int | None]:
        """One read_packed of `group` ((item index, target, IO record)) from the service at addr; returns the
        items not read cleanly, as _read_few_items does."""
        lengths = [items[k].length for k, _, _ in group]
        lease = self.pool.acquire(sum(map(_align, lengths)))
        try:
            rsp, payload = await self._call(addr, "storage.read_packed",
                                            ss.PackedReadReq(b"".join([r for _, _, r in group]), False,
                                                             self.rpc.senders is not None),
                                            ss.PackedReadRsp, recv_into=lease.view)
        except asyncio.CancelledError:
            raise  # the answer may still be received into the buffer: never reuse it (the GC frees it)
        except ThreeFSError:
            lease.release()
            return {k: t for k, t, _ in group}
        except BaseException:
            lease.release()
            raise
        try:
            got = self.few_read_answer(rsp, payload, [items[k].dest[:n] for (k, _, _), n in zip(group, lengths)])
        finally:
            lease.release()
        left = {}
        for (k, t, _), g in zip(group, got):
            if g is None:
                left[k] = t
            else:
                items[k].result = g
        return left

    def few_read_answer(self, rsp: ss.PackedReadRsp, payload, views: list[memoryview]) -> list[int | None]:
        """Per IO of a read_packed answer of a few IOs (payload: their slots, each IO's bytes then its
        alignment padding): the bytes read into the IO's view, checked against the crc32c storage sent
        (whatever check_arrival says), the rest of the view zeroed (a hole, or past the chunk's end); or
        None: an error status, a malformed answer, bytes damaged on the way."""
        out: list[int | None] = [None] * len(views)
        if len(rsp.results) != len(views) * _RESULT_RECORD.size:
            return out
        have = len(payload) if payload is not None else 0
        crc = crc32c.crc32c
        at = 0
        for i, (status, got, _, _, data_crc) in enumerate(_RESULT_RECORD.iter_unpack(rsp.results)):
            view = views[i]
            n = len(view)
            start, at = at, at + _align(n)
            if status or got > n or (got and start + got > have):  # (a payload ends after its last bytes)
                continue
            if got:
                data = payload[start:start + got]
                if crc(data) != data_crc:  # damaged between the server and here
                    self.damaged_reads += 1
                    continue
                view[:got] = data
            if got < n:
                view[got:] = bytes(n - got)
            out[i] = got
        return out

    # -- one small read, in scalar Python ---------------------------------------------------------------
    # A read of one small IO (a FUSE request on its own, a file object's jump, a batch_read of one item)
    # costs more in the batch path's arrays (~40 numpy calls of 1-5 us each here) than in its RPC. These
    # plan, pack and check it with struct instead, with the same choices and checks; anything but a clean
    # answer is left to the batch path, which retries elsewhere and reports errors.
    def one_read_request(self, routing: Routing, chain_id: int, chunk_id: bytes, offset: int, n: int,
                         turn: int, prefer: str | None = None) -> tuple[str, int, bytes] | None:
        """(service address, target, the IO record) of a read of n bytes (0 < n < SOLO_IO_BYTES_MIN) at
        offset of a chunk, from the replica on service `prefer` if the chain has one there, else from the one
        the turn picks (as _plan_small picks for a small IO), or None."""
        found = self._replicas(routing, chain_id)
        if isinstance(found, ThreeFSError) or not found or not 0 < n < SOLO_IO_BYTES_MIN:
            return None
        if prefer is not None:
            for target, addr in found:
                if addr == prefer:
                    return addr, target, _IO_RECORD.pack(chain_id, target, chunk_id, offset, n)
        # the service the turn names (_services), else the next one that has a replica of the chain
        ranks = [self._rank(routing, a) for _, a in found]  # (numbers any service not listed yet first)
        n_nodes = len(self._services(routing)[0])
        _, (target, addr) = min(((j - turn) % n_nodes, ta) for j, ta in zip(ranks, found))
        return addr, target, _IO_RECORD.pack(chain_id, target, chunk_id, offset, n)

    def one_read_answer(self, rsp: ss.PackedReadRsp, payload, view: memoryview) -> int | None:
        """The bytes storage sent for a one-IO read_packed whose payload was to be received into `view` (the
        IO's destination, exactly its length): checked against the crc32c storage sent (whatever
        check_arrival says), the rest of view zeroed (a hole, or past the chunk's end). None: not a clean
        answer (an error status, a malformed answer, bytes not received in place, or damaged on the way)."""
        try:
            status, got, _, _, data_crc = _RESULT_RECORD.unpack(rsp.results)
        except struct.error:
            return None
        n = len(view)
        if status or got > n or (got and (payload is None or len(payload) != got or payload.obj is not view.obj)):
            return None
        if got and crc32c.crc32c(view[:got]) != data_crc:  # damaged between the server and here
            self.damaged_reads += 1
            return None
        if got < n:
            view[got:] = bytes(n - got)
        return got

    async def _read_one_item(self, it: ReadItem) -> tuple[bool, int | None]:
        """One small item read by one_read_request / one_read_answer: (done, None), or (False, the target
        whose answer was not clean, or None if none was asked): then read it in a batch, that target last."""
        if it.avoid:  # a retry: the batch path, which tries those replicas last
            return False, None
        routing = await self.mgmtd.get()
        planned = self.one_read_request(routing, it.chain_id, it.chunk_id, it.offset, it.length,
                                        self._small_turn(routing))
        if planned is None:
            return False, None
        addr, target, record = planned
        view = it.dest[:it.length]
        try:
            rsp, payload = await self._call(addr, "storage.read_packed",
                                            ss.PackedReadReq(record, False, self.rpc.senders is not None),
                                            ss.PackedReadRsp, recv_into=view)
        except ThreeFSError:
            self._move_on(addr, routing)
            return False, target
        got = self.one_read_answer(rsp, payload, view)
        if got is None:
            self._move_on(addr, routing)
            return False, target
        it.result = got
        return True, None

    def _move_on(self, addr: str, routing: Routing) -> None:
        """A small read from `addr` did not come back clean: the next ones start at the next service (a
        service that went away keeps failing until the routing says so)."""
        addrs = self._services(routing)[0]
        if addrs and addrs[self._turn % len(addrs)] == addr:
            self._turn += 1

    async def read_batch(self, batch: "ReadBatch", *, allow_uncommitted: bool = False,
                         pending: np.ndarray | None = None) -> None:
        """Fill every IO's destination (or those of the IO indices `pending`); per-IO errors end in
        batch.errors (never raised). IOs that fail retryably (replica down, stale routing, damaged on
        arrival or on disk) go to another replica."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETRY_S
        if pending is None:
            pending = np.flatnonzero(batch.ios["length"] > 0)
        delay = 0.002
        while len(pending):
            routing = await self.mgmtd.get()
            requests = self._plan(routing, batch, pending)
            await asyncio.gather(*(self._read_packed(addr, batch, idx, allow_uncommitted)
                                   for addr, idx in requests))
            if loop.time() > deadline:
                return  # the errors stay
            pending = take_retries(batch, pending)
            if not len(pending):
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)
            try:
                await self.mgmtd.refresh()
            except ThreeFSError:
                pass

    def _plan(self, routing: Routing, batch: "ReadBatch", idx: np.ndarray,
              turn: int | None = None) -> list[tuple[str, np.ndarray]]:
        """Pick a SERVING replica per IO and cut the IOs into requests: [(service address, IO indices)].

        Small IOs cost per request, not per byte: runs of PACKED_IOS_MAX of them go to one service (where
        their chains have a replica there), each run to the next service in turn; big IOs (received
        straight into their destination) spread one by one. Vectorised: per chain, not per IO, in Python.
        `turn` is where the turn starts (default: the next of this client's round robin)."""
        if len(idx) <= PLAN_SMALL_IOS_MAX and not batch.avoid:
            return self._plan_small(routing, batch, idx, turn)
        ios = batch.ios
        chains, inv = np.unique(ios["chain"][idx], return_inverse=True)
        per_chain: list[list[tuple[int, int]]] = []  # (target, node index) of each chain's readable replicas
        dead = []
        for u, chain_id in enumerate(chains.tolist()):
            found = self._replicas(routing, chain_id)
            if isinstance(found, ThreeFSError):
                dead.append((u, found))
                per_chain.append([])
                continue
            per_chain.append([(t, self._rank(routing, addr)) for t, addr in found])
        addrs = self._services(routing)[0]  # node index j: addrs[j] (a turn names a service)
        n_nodes = len(addrs)
        # table[u, j] = the target of chain u on node j (0: none there)
        table = np.zeros((len(chains), max(1, n_nodes)), dtype=np.int64)
        first = np.zeros(len(chains), dtype=np.int64)  # a fallback node per chain
        for u, replicas in enumerate(per_chain):
            for t, j in replicas:
                table[u, j] = t
            if replicas:
                first[u] = replicas[0][1]
        for u, e in dead:
            for k in idx[inv == u].tolist():
                batch.errors[k] = e
        if n_nodes == 0:
            return []
        lengths = ios["length"][idx]
        small = lengths < SOLO_IO_BYTES_MIN
        rr = next(self._rr) if turn is None else turn
        pref = np.empty(len(idx), dtype=np.int64)
        pref[small] = (np.arange(int(small.sum())) // PACKED_IOS_MAX + rr) % n_nodes
        pref[~small] = (np.arange(int((~small).sum())) + rr) % n_nodes
        rows = table[inv]
        node = np.full(len(idx), -1, dtype=np.int64)
        for step in range(n_nodes):  # the preferred node if the chain has a replica there, else the next one
            col = (pref + step) % n_nodes
            hit = (node < 0) & (rows[np.arange(len(idx)), col] != 0)
            node[hit] = col[hit]
        live = node >= 0
        if batch.avoid:  # retries: IOs that failed on a replica try the others first (a Python path, rare)
            for pos, k in enumerate(idx.tolist()):
                avoid = batch.avoid.get(k)
                if avoid and live[pos] and int(rows[pos, node[pos]]) in avoid:
                    choice = [j for j in range(n_nodes) if rows[pos, j] and int(rows[pos, j]) not in avoid]
                    if choice:
                        node[pos] = choice[(k + rr) % len(choice)]
        sel = np.flatnonzero(live)
        node_l = node[sel]
        ios["target"][idx[sel]] = rows[sel, node_l]
        requests: list[tuple[str, np.ndarray]] = []
        big = sel[~small[sel]]
        if len(big):
            _big_requests(requests, idx, big.tolist(), node[big].tolist(), lengths[big].tolist(), addrs)
        sm = sel[small[sel]]
        if len(sm):
            order = np.argsort(node[sm], kind="stable")
            sm = sm[order]
            sm_node = node[sm]
            bounds = np.flatnonzero(np.diff(sm_node)) + 1
            for part in np.split(sm, bounds):
                addr = addrs[int(node[part[0]])]
                widest = int(_aligned(lengths[part]).max())
                step = max(1, min(PACKED_IOS_MAX, BATCH_BYTES_MAX // widest))
                for i in range(0, len(part), step):
                    requests.append((addr, idx[part[i:i + step]]))
        return requests

    def _plan_small(self, routing: Routing, batch: "ReadBatch", idx: np.ndarray,
                    turn: int | None = None) -> list[tuple[str, np.ndarray]]:
        """_plan for a few IOs (FUSE reads: one to a gate opening's 64), in plain Python: the same choices
        (small IOs together on the turn's service where their chain has a replica, else the next; big ones
        spread one by one), without numpy's fixed cost per call. Measured per plan (same process, min of 5,
        load 11-12): 1 IO 117 -> 11 us, 3 IOs 179 -> 16, 8 IOs 153 -> 16, 32 IOs 105 -> 43, 64 IOs 137
        -> 58; a chain's small IOs take the node and target chosen for its first one, and the targets are
        set in one assignment (64 x 1 KiB FFRecord batch: 44 -> 36 us). Retries (batch.avoid) take the
        general path."""
        ios = batch.ios
        ks = idx.tolist()
        chain_col, length_col = ios["chain"][idx].tolist(), ios["length"][idx].tolist()
        on_of: dict[int, dict[int, int] | ThreeFSError] = {}  # chain -> {node index: target} or its error
        for chain_id in set(chain_col):  # nodes numbered as in the general plan (_services)
            found = self._replicas(routing, chain_id)
            if isinstance(found, ThreeFSError):
                on_of[chain_id] = found
                continue
            on_of[chain_id] = {self._rank(routing, addr): t for t, addr in found}
        addrs = self._services(routing)[0]
        n_nodes = len(addrs)
        rr = next(self._rr) if turn is None else turn
        small_at: dict[int, list[int]] = {}  # node -> positions of its small IOs
        small_of: dict[int, tuple] = {}  # chain -> (node, target, small_at[node]) of its small IOs (one node)
        requests: list[tuple[str, np.ndarray]] = []
        planned, chosen = [], []  # positions given a target, and the target
        n_big = 0
        big_at, big_node, big_len = [], [], []  # big IOs: position, node, length
        for pos, (chain_id, length) in enumerate(zip(chain_col, length_col)):
            small = length < SOLO_IO_BYTES_MIN
            if small:
                hit = small_of.get(chain_id)
                if hit is not None:  # the common case: a chain seen before in this batch
                    hit[2].append(pos)
                    planned.append(pos)
                    chosen.append(hit[1])
                    continue
            on = on_of[chain_id]
            if isinstance(on, ThreeFSError):
                batch.errors[ks[pos]] = on
                continue
            if not on:
                continue
            pref = rr % n_nodes if small else (n_big + rr) % n_nodes
            node = next((pref + step) % n_nodes for step in range(n_nodes) if (pref + step) % n_nodes in on)
            planned.append(pos)
            chosen.append(on[node])
            if small:
                at = small_at.setdefault(node, [])
                at.append(pos)
                small_of[chain_id] = (node, on[node], at)
            else:
                n_big += 1
                big_at.append(pos)
                big_node.append(node)
                big_len.append(length)
        if big_at:
            _big_requests(requests, idx, big_at, big_node, big_len, addrs)
        if planned:
            ios["target"][idx if len(planned) == len(ks) else idx[planned]] = chosen
        for node in sorted(small_at):
            part = small_at[node]
            widest = -(-max(length_col[p] for p in part) // IO_BUFFER_ALIGN) * IO_BUFFER_ALIGN
            step = max(1, min(PACKED_IOS_MAX, BATCH_BYTES_MAX // max(1, widest)))
            for i in range(0, len(part), step):
                requests.append((addrs[node], idx[part[i:i + step]]))
        return requests

    def _replicas(self, routing: Routing, chain_id: int) -> list[tuple[int, str]] | ThreeFSError:
        """[(target, service address)] of a chain's readable replicas, or why there is none; cached per
        routing version (a batch looks its chains up, not its IOs)."""
        if self._replicas_version != routing.version:
            self._replicas_cache, self._replicas_version = {}, routing.version
        found = self._replicas_cache.get(chain_id)
        if found is None:
            try:
                targets = _readable(routing, serving_targets(routing.chain(chain_id)))
                if not targets:
                    raise status_error(StatusCode.NO_SERVING_TARGET, f"chain {chain_id} has no SERVING target "
                                       f"({routing.describe_chain(chain_id)})")
                found = [(t, a) for t in targets if (a := _addr_or_none(routing, t)) is not None]
                if not found:
                    routing.target_addr(targets[0])  # raises the reason
            except ThreeFSError as e:
                found = e
            self._replicas_cache[chain_id] = found
        return found

    def _services(self, routing: Routing) -> tuple[list[str], dict[str, int]]:
        """Every live storage service's address in node id order, and each one's place in it, per routing
        version: the numbering in which a turn (`turn % len`) names a service. (Numbered by where they first
        appear in a batch's chains, as they were, a thread's sticky turn named a different service whenever its
        batch's first chain listed its replicas in another order: every chain does, CRAQ orders each one's
        own.) Dead nodes are left out, so a turn that would name one does not fall on its neighbour; a service
        only a chain names (a node the routing does not list as alive) is numbered after them."""
        version, addrs, rank = self._services_of
        if version != routing.version:
            addrs = [n.addr for n in routing.nodes_of_type(STORAGE)]
            rank = {a: j for j, a in enumerate(addrs)}
            self._services_of = (routing.version, addrs, rank)
        return addrs, rank

    def _rank(self, routing: Routing, addr: str) -> int:
        """The place of `addr` in _services' numbering (a service not listed there is appended)."""
        addrs, rank = self._services(routing)
        j = rank.get(addr)
        if j is None:
            j = rank[addr] = len(addrs)
            addrs.append(addr)
        return j

    async def _read_packed(self, addr: str, batch: "ReadBatch", idx: np.ndarray, allow_uncommitted: bool) -> None:
        ios = batch.ios[idx]
        lengths = ios["length"].astype(np.int64)
        ends = np.cumsum(_aligned(lengths))
        # With an IO of 32 KiB or more, the server may send big IOs straight from its data file (zero_copy:
        # whole chunks unchecked there, parts with the crc32c of a read just before): every IO of the request
        # is then checked here on arrival, check_arrival or not.
        zero_copy = self.zero_copy and int(lengths.max()) >= SCATTER_IO_BYTES_MIN
        req = ss.PackedReadReq(ios.tobytes(), allow_uncommitted, self.rpc.senders is not None, zero_copy)
        # One IO: receive straight into the caller's memory; several big ones: straight into their own
        # destinations (Scatter); several small ones: into one buffer, then copied out.
        lease = None
        if len(idx) == 1:
            recv = batch.dest(int(idx[0]))
        elif int(lengths.min()) >= SCATTER_IO_BYTES_MIN:
            recv = self._scatter(batch, idx, lengths)
        else:
            lease = self.pool.acquire(int(ends[-1]))
            recv = lease.view
        try:
            damaged = await self._read_request(addr, req, batch, idx, lengths, ends, recv, lease is None, zero_copy)
        finally:
            if lease is not None:
                lease.release()
        if zero_copy:
            for k in damaged or ():
                # a whole chunk (from a chunk's start, 128 KiB or more) may have been sent unchecked: the server
                # checks its copy now (a part arrives with the crc32c of the server's read: damage on the way)
                if int(batch.ios["offset"][k]) == 0 and int(batch.ios["length"][k]) >= SOLO_IO_BYTES_MIN:
                    self._background(self._report_damage(addr, int(batch.ios["target"][k]),
                                                         batch.ios["chunk"][k:k + 1].tobytes()))

    def _scatter(self, batch: "ReadBatch", idx: np.ndarray, lengths: np.ndarray) -> Scatter:
        """The payload of a packed request laid out over its IOs' destinations: each IO's slot is its
        destination, then its alignment padding (into a scratch: never the caller's memory). Each IO's bytes
        are crc32c'd as soon as they are in (in cache), see _arrived_crcs; checked whatever check_arrival says,
        as when they were copied out of one buffer."""
        parts = []
        dest = batch.dest
        for k, ln in zip(idx.tolist(), lengths.tolist()):
            parts.append(dest(k))
            pad = -ln % IO_BUFFER_ALIGN
            if pad:
                parts.append(self._pad[:pad])
        return Scatter(parts, crc32c.crc32c)

    async def _report_damage(self, addr: str, target_id: int, chunk_id: bytes) -> None:
        """storage.report_damage: a whole chunk sent zero-copy arrived damaged; the server checks its copy
        (and repairs it from a peer if it is the copy). Best effort: the read itself already went elsewhere."""
        try:
            await self._call(addr, "storage.report_damage", ss.ReportDamageReq(target_id, chunk_id),
                             ss.ReportDamageRsp)
        except ThreeFSError as e:
            log.info("%s: damage report of chunk %s not taken: %s", addr, chunk_id.hex(), e.message)

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_request(self, addr, req, batch, idx, lengths, ends, recv, single,
                            zero_copy=False) -> list[int] | None:
        try:
            rsp, payload = await self._call(addr, "storage.read_packed", req, ss.PackedReadRsp,
                                            recv_into=recv)
        except ThreeFSError as e:
            fail_ios(batch, idx, e)
            if type(recv) is Scatter:  # a slot received in part may hold another IO's bytes (an error's slot)
                zero_dests(batch, idx)
            return
        # (a payload longer than asked for is not received in place: the transport gave it a buffer of its own)
        single = single and (payload is None or len(payload) <= len(recv))
        crcs = None
        if type(recv) is Scatter:
            crcs = _arrived_crcs(payload, lengths) if type(payload) is Scatter else [None] * len(idx)
        return self.apply_packed(addr, rsp, payload, batch, idx, lengths, ends, single, zero_copy, crcs)

    def apply_packed(self, addr: str, rsp: ss.PackedReadRsp, payload, batch: "ReadBatch", idx: np.ndarray,
                     lengths: np.ndarray, ends: np.ndarray, single: bool, zero_copy: bool = False,
                     crcs: list | None = None) -> list[int]:
        """Check a read_packed response's IOs (status, crc32c of what arrived) and place their bytes in
        the batch's destinations (`single`: the payload was received in place, into the one IO's destination
        or into destinations laid out as the payload's slots, client/storage_sync.py _in_place, or each slot
        into its IO's destination, _scatter). In place, a failed IO's destination is zeroed: its slot held
        what the server had there (an error's slot is not written by the server) or bytes damaged on the way.
        Plain CPU work: also used by the caller-thread read path (client/storage_sync.py).

        A zero_copy request's whole chunk may come unchecked by the server: its write-time crc is always
        checked here on arrival, check_arrival or not (a chunk is never returned that no one has checked).

        `crcs` (a Scatter-received request: checked whatever check_arrival says): per IO, the crc32c of its
        whole destination taken as its bytes arrived, or None; used for an IO that got all its bytes (else its
        crc32c is taken here). Returns the IOs that arrived damaged."""
        res = np.frombuffer(rsp.results, RESULT_DTYPE) if len(rsp.results) % RESULT_DTYPE.itemsize == 0 else None
        if res is None or len(res) != len(idx) or (res["length"] > lengths).any():
            fail_ios(batch, idx, status_error(StatusCode.PROTOCOL_ERROR, f"{addr}: malformed read_packed "
                                              f"response ({len(rsp.results)} result bytes for {len(idx)} IOs)"))
            return []
        got = res["length"].astype(np.int64)
        status = res["status"]
        if payload is None:
            payload = memoryview(b"")
        starts = (ends - _aligned(lengths)).tolist()
        dests, dest_of, dest_off = batch.dests, batch.dest_of, batch.dest_off
        errors = batch.errors
        # a packed IO copied out of the payload, or received by Scatter (crcs), is checked. A zero-copy chunk is
        # checked here whatever check_arrival says: the server did not check it (with check_arrival=False a
        # server-checked whole chunk received in place is not checked again: the caller's own checksum covers
        # the transfer)
        check = batch.check_arrival or not single or zero_copy or crcs is not None
        crc32c_of = crc32c.crc32c
        damaged: list[int] = []
        # the per-IO part: check what arrived, place it (~1-2 us per IO)
        for pos, (k, s, g, want, crc, st) in enumerate(zip(idx.tolist(), starts, got.tolist(), lengths.tolist(),
                                                       res["data_crc"].tolist(), status.tolist())):
            if st:
                errors[k] = status_error(st, f"{addr}: {rsp.messages.get(pos, '')}")
                if single and len(idx) > 1:  # received in place: the slot's bytes are not this IO's
                    o = dest_off[k]
                    dests[dest_of[k]][o:o + want] = bytes(want)
                continue
            d = dests[dest_of[k]]
            o = dest_off[k]
            if g:
                got_bytes = d[o:o + g] if single else payload[s:s + g]
                if check and (crcs[pos] if crcs is not None and g == want and crcs[pos] is not None
                              else crc32c_of(got_bytes)) != crc:
                    # damaged between the server's disk read and here (network, memory): another replica
                    self.damaged_reads += 1
                    damaged.append(k)
                    errors[k] = status_error(
                        StatusCode.CHECKSUM_MISMATCH,
                        f"{addr}: {g} bytes of chunk {batch.chunk_hex(k)} from target "
                        f"{int(batch.ios['target'][k])} arrived damaged (crc32c {crc32c.crc32c(got_bytes):08x}, "
                        f"sent {crc:08x}); reading another replica")
                    if single:
                        d[o:o + want] = bytes(want)
                    continue
                if not single:
                    d[o:o + g] = got_bytes
            if g < want:  # a hole or past the chunk's end: zeros
                d[o + g:o + want] = bytes(want - g)
        batch.got[idx] = got
        return damaged


def _big_requests(requests: list, idx: np.ndarray, positions: list[int], nodes: list[int], lengths: list[int],
                  addrs: list[str]) -> None:
    """Append the requests of big IOs (idx[positions], each on its node): per node in order, up to
    BIG_IOS_PER_REQUEST IOs and BIG_REQUEST_BYTES_MAX bytes each (one IO alone if bigger), the nodes' requests
    taking turns in the list as the IOs did."""
    runs: dict[int, list[list[int]]] = {}
    sizes: dict[int, int] = {}
    for pos, j, ln in zip(positions, nodes, lengths):
        mine = runs.setdefault(j, [[]])
        if mine[-1] and (len(mine[-1]) >= BIG_IOS_PER_REQUEST or sizes[j] + ln > BIG_REQUEST_BYTES_MAX):
            mine.append([])
            sizes[j] = 0
        mine[-1].append(pos)
        sizes[j] = sizes.get(j, 0) + ln
    for turn in range(max(len(r) for r in runs.values())):
        for j, mine in runs.items():
            if turn < len(mine):
                part = mine[turn]
                requests.append((addrs[j], idx[part[0]:part[0] + 1] if len(part) == 1 else idx[part]))


def _arrived_crcs(payload: Scatter, lengths: np.ndarray) -> list:
    """Per IO of a Scatter-received packed payload (parts: each IO's destination, then its padding if any):
    the crc32c of its destination as it arrived, or None (not all of it arrived: a trimmed payload)."""
    parts, digests = payload.parts, payload.digests
    out, i = [], 0
    for ln in lengths.tolist():
        out.append(digests[i] if i < len(digests) and len(parts[i]) == ln else None)
        i += 1 if ln % IO_BUFFER_ALIGN == 0 else 2
    return out


def _batch_results(batch: ReadBatch, items: list[ReadItem]) -> None:
    for k, it in enumerate(items):
        err = batch.errors.get(k)
        if err is not None:
            it.error = err
        else:
            it.result = int(batch.got[k])


def _align(n: int) -> int:
    return (n + IO_BUFFER_ALIGN - 1) // IO_BUFFER_ALIGN * IO_BUFFER_ALIGN


def take_retries(batch: ReadBatch, pending: np.ndarray) -> np.ndarray:
    """The IOs of `pending` that failed retryably, their errors cleared and the replica that failed each
    marked to be tried last."""
    if not batch.errors:
        return np.zeros(0, dtype=np.int64)
    retry = [k for k in pending.tolist() if k in batch.errors and _read_retryable(batch.errors[k])]
    for k in retry:
        batch.avoid.setdefault(k, set()).add(int(batch.ios["target"][k]))
        del batch.errors[k]
    return np.array(retry, dtype=np.int64)


def fail_ios(batch: ReadBatch, idx: np.ndarray, error: ThreeFSError) -> None:
    for k in idx.tolist():
        batch.errors[k] = error


def zero_dests(batch: ReadBatch, idx: np.ndarray) -> None:
    for k in idx.tolist():
        d = batch.dest(k)
        d[:] = bytes(len(d))


def _readable(routing: Routing, targets: list[int]) -> list[int]:
    """SERVING targets minus those an admin is taking offline (they refuse reads while they leave their
    chain), unless that leaves none."""
    info = routing.info.targets
    return [t for t in targets if t not in info or not info[t].admin_offline] or targets


def _addr_or_none(routing: Routing, target: int) -> str | None:
    try:
        return routing.target_addr(target)
    except ThreeFSError:
        return None


def _read_retryable(error: ThreeFSError) -> bool:
    """A read may go to another replica after these (a corrupted replica is being repaired)."""
    return error.retryable or error.code == StatusCode.CHECKSUM_MISMATCH
