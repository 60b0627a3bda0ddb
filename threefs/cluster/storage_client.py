"""Client of the storage services: chunk writes to chain heads, batched reads from any SERVING replica.

The data path never touches meta: callers give (chain, chunk id, offset, length, buffer) computed from
the file layout, and this module finds targets in the routing info, bounds the requests in flight per
storage service, and retries what is retryable (routing changed, replica down, chunk not committed).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field

import crc32c

from threefs.cluster.mgmtd_client import MgmtdClient
from threefs.cluster.routing import Routing, serving_targets, write_targets
from threefs.common import limits
from threefs.common.buffers import BufferPool, align_up
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.client import RpcClient
from threefs.rpc.schemas import storage as ss

log = logging.getLogger(__name__)

RETRY_S = 20.0  # total time an IO keeps retrying retryable errors
REQUEST_IOS_MAX = 64  # IOs in one storage.batch_read request (a client batch is split into these)
BATCH_BYTES_MAX = 4 * limits.MiB
SOLO_IO_BYTES_MIN = 128 * limits.KiB  # larger IOs skip batching so they need no scatter copy


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
        self.damaged_reads = 0  # IOs whose bytes failed their checksum on arrival (then read elsewhere)

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
        try:
            async with asyncio.timeout(self.timeout):
                await sem.acquire()
        except TimeoutError:
            raise status_error(StatusCode.TIMEOUT, f"{addr}: no request slot free for {self.timeout:.0f} s "
                               f"({self.inflight_per_node} in flight); the service is overloaded or "
                               "stuck") from None
        try:
            return await self.rpc.call(addr, method, req, rsp_type,
                                       timeout=max(0.001, deadline - loop.time()), **kwargs)
        finally:
            sem.release()

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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETRY_S
        pending = [it for it in items if it.length > 0]
        for it in items:
            if it.length == 0:
                it.result = 0
        delay = 0.002
        while pending:
            routing = await self.mgmtd.get()
            groups = self._group_by_node(routing, pending)
            await asyncio.gather(*(self._read_node(addr, batch, allow_uncommitted)
                                   for addr, batches in groups.items() for batch in batches))
            retry = [it for it in pending if it.error is not None and _read_retryable(it.error)]
            if not retry or loop.time() > deadline:
                return
            for it in retry:
                it.avoid.add(it.target)
                it.error = None
            pending = retry
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)
            try:
                await self.mgmtd.refresh()
            except ThreeFSError:
                pass

    def _group_by_node(self, routing: Routing, items: list[ReadItem]) -> dict[str, list]:
        """Pick a SERVING replica per item; group small IOs per storage service into bounded batches."""
        groups: dict[str, list[list[ReadItem]]] = {}
        open_bytes: dict[str, int] = {}  # bytes in each service's last (open) batch
        serving: dict[int, list[int]] = {}  # per chain, computed once per call
        # Small IOs cost per request, not per byte: fill one request to one service (where the
        # chains have a replica there) before moving on to the next service, instead of sending
        # one request to every replica's service. Big IOs spread item by item.
        small_addr, small_n, small_bytes = None, 0, 0
        for it in items:
            try:
                targets = serving.get(it.chain_id)
                if targets is None:
                    targets = serving[it.chain_id] = _readable(routing, serving_targets(routing.chain(it.chain_id)))
                if not targets:
                    raise status_error(StatusCode.NO_SERVING_TARGET, f"chain {it.chain_id} has no "
                                       f"SERVING target ({routing.describe_chain(it.chain_id)})")
                choice = [t for t in targets if t not in it.avoid] if it.avoid else targets
                choice = choice or targets
                target = choice[next(self._rr) % len(choice)]
                if it.length < SOLO_IO_BYTES_MIN:
                    if (small_addr is None or small_n >= REQUEST_IOS_MAX
                            or small_bytes + it.length > BATCH_BYTES_MAX):
                        small_addr, small_n, small_bytes = routing.target_addr(target), 0, 0
                    else:
                        target = next((t for t in choice if _addr_or_none(routing, t) == small_addr), target)
                addr = routing.target_addr(target)
                if it.length < SOLO_IO_BYTES_MIN and addr == small_addr:
                    small_n, small_bytes = small_n + 1, small_bytes + it.length
            except ThreeFSError as e:
                it.error = e
                continue
            it.target = target
            batches = groups.setdefault(addr, [[]])
            if it.length >= SOLO_IO_BYTES_MIN:  # its own request: received straight into dest
                batches.insert(0, [it])
                continue
            last = batches[-1]
            if len(last) >= REQUEST_IOS_MAX or open_bytes.get(addr, 0) + it.length > BATCH_BYTES_MAX:
                batches.append(last := [])
                open_bytes[addr] = 0
            last.append(it)
            open_bytes[addr] = open_bytes.get(addr, 0) + it.length
        return {addr: [b for b in batches if b] for addr, batches in groups.items()}

    async def _read_node(self, addr: str, batch: list[ReadItem], allow_uncommitted: bool) -> None:
        req = ss.BatchReadReq([ss.ReadIO(it.chain_id, it.target, it.chunk_id, it.offset, it.length)
                               for it in batch], allow_uncommitted, self.rpc.senders is not None)
        # One IO: receive straight into the caller's memory. Several: into one buffer, then scatter.
        single = len(batch) == 1
        lease = None if single else self.pool.acquire(sum(align_up(it.length) for it in batch))
        recv = batch[0].dest if single else lease.view
        try:
            await self._read_batch(addr, req, batch, recv, single)
        finally:
            if lease is not None:
                lease.release()

    async def _read_batch(self, addr, req, batch, recv, single) -> None:
        try:
            rsp, payload = await self._call(addr, "storage.batch_read", req, ss.BatchReadRsp,
                                            recv_into=recv)
        except ThreeFSError as e:
            for it in batch:
                it.error = e
            return
        pos = 0
        for it, res in zip(batch, rsp.results):
            if res.status:
                it.error = status_error(res.status, f"{addr}: {res.message}")
                continue
            got = it.dest[:res.length] if single else payload[pos:pos + res.length]
            if res.length and crc32c.crc32c(got) != res.data_crc:
                # damaged between the server's disk read and here (network, memory): another replica
                self.damaged_reads += 1
                it.error = status_error(StatusCode.CHECKSUM_MISMATCH,
                                        f"{addr}: {res.length} bytes of chunk {it.chunk_id.hex()} from target "
                                        f"{it.target} arrived damaged (crc32c {crc32c.crc32c(got):08x}, "
                                        f"sent {res.data_crc:08x}); reading another replica")
                pos = align_up(pos + res.length)
                continue
            if not single:
                it.dest[:res.length] = got
            if res.length < it.length:
                it.dest[res.length:] = bytes(it.length - res.length)
            pos = align_up(pos + res.length)
            it.result = res.length


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
