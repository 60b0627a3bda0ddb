"""Storage service: hosts targets, runs the CRAQ write path and serves batch reads.

Write path (3FS §3): client -> head; the head takes the per-chunk lock, assigns the version, writes a
pending version, forwards to its successor (next SERVING or SYNCING target), and commits when the
successor answers; the tail commits first, so the ack is the nested RPC response.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import crc32c

from threefs.client.mgmtd_client import MgmtdClient, Routing
from threefs.common.buffers import align_up
from threefs.common.config import ServiceConfig
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.mgmtd.chain_state import write_targets
from threefs.rpc.client import RpcClient
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.rpc.schemas.common import Empty
from threefs.rpc.server import CallContext, rpc
from threefs.storage.chunk_engine import ChunkEngine
from threefs.storage.replica import Decision, decide_at_successor, plan_at_head, readable

log = logging.getLogger(__name__)

FORWARD_RETRY_S = 10.0  # how long a replica keeps retrying its successor before failing the update
DEDUP_ENTRIES_MAX = 100_000  # exactly-once cache (client, request id) -> result


class StorageService:
    def __init__(self, config: ServiceConfig, rpc_client: RpcClient, mgmtd: MgmtdClient):
        self.config = config
        self.rpc = rpc_client
        self.mgmtd = mgmtd
        self.engines: dict[int, ChunkEngine] = {}
        self.io_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="disk")
        self._locks: dict[tuple[int, bytes], asyncio.Lock] = {}
        self._dedup: collections.OrderedDict = collections.OrderedDict()
        self.synced: set[int] = set()  # targets whose resync finished (report UPTODATE)
        self.hb_version = 0
        self.resync = None  # set by the runner (storage.resync.Resyncer)

    def open_targets(self) -> None:
        for t in self.config.targets:
            os.makedirs(t.path, exist_ok=True)
            self.engines[t.target_id] = ChunkEngine(t.path, fsync=self.config.fsync)
        log.info("opened %d targets", len(self.engines))

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.io_pool.shutdown(wait=True)

    async def _disk(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self.io_pool, lambda: fn(*args, **kwargs))

    # -- membership ------------------------------------------------------------------------------
    def local_state(self, routing: Routing | None, target_id: int) -> str:
        """UPTODATE when mgmtd still counts this target as holding every acknowledged write."""
        if routing is None or target_id not in routing.info.targets:
            return ms.ONLINE
        public = routing.info.targets[target_id].public_state
        if public in (ms.SERVING, ms.LASTSRV) or target_id in self.synced:
            return ms.UPTODATE
        return ms.ONLINE

    async def register(self) -> None:
        req = ms.RegisterReq(self.config.node_id, ms.STORAGE, self.config.addr, socket.gethostname(),
                             self.config.failure_domain, sorted(self.engines))
        await self.mgmtd.call("register", req, ms.RegisterRsp)
        await self.mgmtd.refresh(force=True)

    async def heartbeat_loop(self) -> None:
        """Runs for the service's lifetime; a missing mgmtd only delays the next beat."""
        while True:
            try:
                await self.heartbeat_once()
            except ThreeFSError as e:
                if e.code == StatusCode.NODE_NOT_FOUND:
                    await self.register()
                else:
                    log.warning("heartbeat failed: %s", e)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def heartbeat_once(self) -> None:
        routing = self.mgmtd.routing
        targets = [ms.LocalTarget(tid, self.local_state(routing, tid), engine.used_bytes())
                   for tid, engine in self.engines.items()]
        self.hb_version += 1
        rsp = await self.mgmtd.call("heartbeat", ms.HeartbeatReq(self.config.node_id, self.hb_version,
                                                                 targets), ms.HeartbeatRsp)
        if routing is None or rsp.routing_version != routing.version:
            routing = await self.mgmtd.refresh()
            self._forget_sync_flags(routing)

    def _forget_sync_flags(self, routing: Routing) -> None:
        for tid in list(self.synced):
            if routing.info.targets.get(tid) and routing.info.targets[tid].public_state == ms.SERVING:
                self.synced.discard(tid)

    # -- helpers ---------------------------------------------------------------------------------
    def _my_target(self, chain: ms.ChainInfo) -> int:
        for t in chain.targets:
            if t.target_id in self.engines:
                return t.target_id
        raise status_error(StatusCode.TARGET_NOT_FOUND,
                           f"node {self.config.node_id} has no target in chain {chain.chain_id}")

    async def _chain_checked(self, chain_id: int, chain_ver: int) -> ms.ChainInfo:
        chain = await self._chain(chain_id)
        if chain_ver > chain.version:  # the caller saw a newer routing than ours
            chain = (await self.mgmtd.refresh()).chain(chain_id)
        if chain_ver != chain.version:
            raise status_error(StatusCode.CHAIN_VERSION_MISMATCH,
                               f"chain {chain_id} is at version {chain.version}, request carries "
                               f"{chain_ver}; refresh routing and retry")
        return chain

    async def _chain(self, chain_id: int) -> ms.ChainInfo:
        """The chain from our routing, refreshed once if we do not know it yet."""
        routing = await self.mgmtd.get()
        if chain_id not in routing.info.chains:
            routing = await self.mgmtd.refresh()
        return routing.chain(chain_id)

    def _lock(self, target_id: int, chunk_id: bytes) -> asyncio.Lock:
        key = (target_id, chunk_id)
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    def _release_lock_entry(self, target_id: int, chunk_id: bytes) -> None:
        lock = self._locks.get((target_id, chunk_id))
        if lock is not None and not lock.locked() and not lock._waiters:
            del self._locks[(target_id, chunk_id)]

    # -- write path ------------------------------------------------------------------------------
    @rpc(ss.UpdateReq)
    async def update(self, ctx: CallContext, req: ss.UpdateReq) -> ss.UpdateRsp:
        payload = ctx.payload if ctx.payload is not None else memoryview(b"")
        if req.kind == ss.WRITE and crc32c.crc32c(payload) != req.crc:
            raise status_error(StatusCode.CHECKSUM_MISMATCH,
                               f"payload checksum mismatch for chunk {req.chunk_id.hex()} "
                               f"(corrupted in transit); retry")
        key = (req.tag.client_id, req.tag.request_id) if req.tag and not req.from_target else None
        if key is not None and key in self._dedup:
            return self._dedup[key]
        chain = await self._chain_checked(req.chain_id, req.chain_ver)
        me = self._my_target(chain)
        order = write_targets(chain)
        if me not in order:
            raise status_error(StatusCode.TARGET_OFFLINE, f"target {me} is not writable in chain "
                               f"{chain.chain_id} ({ms.SERVING}/{ms.SYNCING} only)")
        if req.from_target == 0 and order[0] != me:
            raise status_error(StatusCode.NOT_HEAD, f"target {me} is not the head of chain "
                               f"{chain.chain_id}; head is {order[0]}")
        lock = self._lock(me, req.chunk_id)
        try:
            async with lock:
                rsp = await self._update_locked(req, payload, chain, me, order)
        finally:
            self._release_lock_entry(me, req.chunk_id)
        if key is not None:
            self._dedup[key] = rsp
            while len(self._dedup) > DEDUP_ENTRIES_MAX:
                self._dedup.popitem(last=False)
        return rsp

    async def _update_locked(self, req, payload, chain, me, order) -> ss.UpdateRsp:
        engine = self.engines[me]
        meta = engine.get_meta(req.chunk_id)
        if req.sync and req.from_target:
            return self._rsp(await self._apply_sync(engine, req, payload, meta, chain.version))
        if req.from_target == 0:
            plan = plan_at_head(meta)
            update_ver, full = plan.update_ver, plan.full_replace
        else:
            update_ver, full = req.update_ver, req.full_replace
            if req.kind != ss.REMOVE:
                decision = decide_at_successor(meta, update_ver, full)
                if decision is Decision.COMMITTED:
                    return self._rsp(meta)
                if decision is Decision.MISSING:
                    raise status_error(StatusCode.MISSING_UPDATE,
                                       f"target {me} misses versions before {update_ver} of chunk "
                                       f"{req.chunk_id.hex()} (has {meta.commit_ver if meta else 0})")
        tag = b"" if req.tag is None else f"{req.tag.client_id}:{req.tag.request_id}".encode()
        pending = await self._apply(engine, req, payload, update_ver, full, chain.version, tag)
        idx = order.index(me)
        if idx + 1 < len(order):
            await self._forward(req, payload, chain, me, update_ver, full, pending)
        committed = await self._disk(engine.commit, req.chunk_id, update_ver, chain_ver=chain.version)
        return self._rsp(committed)

    async def _apply_sync(self, engine: ChunkEngine, req, payload, meta, chain_ver):
        """Resync replaces the chunk and its versions with the predecessor's, whatever we had."""
        cid = req.chunk_id
        if meta is not None:
            ver = max(meta.update_ver, meta.commit_ver) + 1
            await self._disk(engine.remove, cid, update_ver=ver, chain_ver=chain_ver)
            await self._disk(engine.commit, cid, ver, chain_ver=chain_ver)
        if req.kind == ss.REMOVE:
            return None
        await self._disk(engine.write, cid, update_ver=req.update_ver, chain_ver=chain_ver, offset=0,
                         data=payload, chunk_size=req.chunk_size, full_replace=True)
        return await self._disk(engine.commit, cid, req.update_ver, chain_ver=chain_ver)

    @staticmethod
    def _rsp(meta) -> ss.UpdateRsp:
        if meta is None:
            return ss.UpdateRsp(0, 0, 0, removed=True)
        return ss.UpdateRsp(meta.commit_ver, meta.length, meta.crc)

    async def _apply(self, engine: ChunkEngine, req, payload, update_ver, full, chain_ver, tag):
        """Write the pending version; with `full` from a client, compose it on our newest version."""
        cid = req.chunk_id
        if req.kind == ss.REMOVE:
            return await self._disk(engine.remove, cid, update_ver=update_ver, chain_ver=chain_ver,
                                    last_request=tag)
        if full and req.from_target == 0:
            payload = await self._compose(engine, req, payload)
            return await self._disk(engine.write, cid, update_ver=update_ver, chain_ver=chain_ver,
                                    offset=0, data=payload, chunk_size=req.chunk_size,
                                    full_replace=True, last_request=tag)
        if req.kind == ss.TRUNCATE:
            return await self._disk(engine.truncate, cid, update_ver=update_ver, chain_ver=chain_ver,
                                    length=req.length, chunk_size=req.chunk_size, last_request=tag)
        return await self._disk(engine.write, cid, update_ver=update_ver, chain_ver=chain_ver,
                                offset=req.offset, data=payload, chunk_size=req.chunk_size,
                                full_replace=full, last_request=tag)

    async def _compose(self, engine: ChunkEngine, req, payload) -> bytearray:
        """The whole chunk after this update, built on the newest (pending) local version."""
        data, _ = await self._disk(engine.read, req.chunk_id, 0, req.chunk_size, pending=True)
        chunk = bytearray(data)
        if req.kind == ss.TRUNCATE:
            del chunk[req.length:]
            chunk.extend(bytes(max(0, req.length - len(chunk))))
        else:
            end = req.offset + len(payload)
            if len(chunk) < end:
                chunk.extend(bytes(end - len(chunk)))
            chunk[req.offset:end] = payload
        return chunk

    async def _forward(self, req, payload, chain, me, update_ver, full, pending) -> None:
        """Send the update to our successor until it commits, following routing changes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FORWARD_RETRY_S
        delay = 0.01
        while True:
            order = write_targets(chain)
            if me not in order or order.index(me) + 1 >= len(order):
                return  # we are the tail now: commit locally
            successor = order[order.index(me) + 1]
            successor_syncing = any(t.target_id == successor and t.public_state == ms.SYNCING
                                    for t in chain.targets)
            try:
                rsp = await self._send_update(req, payload, chain, me, successor, update_ver,
                                              full or successor_syncing, pending)
                self._check_successor(req, rsp, pending, successor)
                return
            except ThreeFSError as e:
                if e.code == StatusCode.MISSING_UPDATE and not full:
                    full = True  # the successor lags: send it the whole chunk
                    continue
                if not e.retryable and e.code != StatusCode.MISSING_UPDATE or loop.time() > deadline:
                    raise status_error(e.code, f"forwarding chunk {req.chunk_id.hex()} to target "
                                       f"{successor} failed: {e.message}")
                log.info("forward to target %d failed (%s); retrying", successor, e.message)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
            routing = await self.mgmtd.refresh()
            chain = routing.chain(req.chain_id)

    async def _send_update(self, req, payload, chain, me, successor, update_ver, full, pending):
        routing = await self.mgmtd.get()
        fwd = ss.UpdateReq(req.chain_id, chain.version, req.chunk_id, req.kind, req.offset, req.length,
                           req.chunk_size, req.crc, req.tag, update_ver, full, me)
        if full and req.kind != ss.REMOVE:
            data, _ = await self._disk(self.engines[me].read, req.chunk_id, 0, req.chunk_size,
                                       pending=True)
            payload = data
            fwd.offset, fwd.kind, fwd.length = 0, ss.WRITE, len(data)
            fwd.crc = crc32c.crc32c(data)
        rsp, _ = await self.rpc.call(routing.target_addr(successor), "storage.update", fwd,
                                     ss.UpdateRsp, payload=payload if fwd.kind == ss.WRITE else None)
        return rsp

    def _check_successor(self, req, rsp: ss.UpdateRsp, pending, successor: int) -> None:
        """Replicas verifiably agree after every write: compare the successor's chunk checksum."""
        if req.kind == ss.REMOVE or pending is None:
            return
        if rsp.crc != pending.pending_crc or rsp.length != pending.pending_length:
            raise status_error(StatusCode.CHECKSUM_MISMATCH,
                               f"target {successor} holds chunk {req.chunk_id.hex()} with crc "
                               f"{rsp.crc:08x}/{rsp.length} B, expected {pending.pending_crc:08x}/"
                               f"{pending.pending_length} B")

    # -- read path -------------------------------------------------------------------------------
    @rpc(ss.BatchReadReq)
    async def batch_read(self, ctx: CallContext, req: ss.BatchReadReq):
        routing = await self.mgmtd.get()
        for io in req.ios:
            target = routing.info.targets.get(io.target_id)
            if io.target_id in self.engines and (target is None or target.public_state != ms.SERVING):
                routing = await self.mgmtd.refresh()  # maybe we are behind; then judge again
                break
        lease = ctx.conn.server.pool.acquire(sum(align_up(io.length) for io in req.ios))
        try:
            try:  # page-cache hits are served inline; a miss goes to the disk threads
                results, used = self._read_batch(req, routing, lease.view, nowait=True)
            except BlockingIOError:
                results, used = await self._disk(self._read_batch, req, routing, lease.view)
        except BaseException:
            lease.release()
            raise
        lease.view = lease.view[:used]
        return ss.BatchReadRsp(results), lease

    def _read_batch(self, req: ss.BatchReadReq, routing: Routing, out: memoryview, nowait: bool = False):
        """Runs in the disk pool: IO k's bytes land in `out` at its slot, aligned (see BatchReadRsp)."""
        results, pos, end = [], 0, 0
        for io in req.ios:
            engine = self.engines.get(io.target_id)
            target = routing.info.targets.get(io.target_id)
            if engine is None:
                results.append(ss.ReadResult(int(StatusCode.TARGET_NOT_FOUND), 0,
                                             f"target {io.target_id} is not on node {self.config.node_id}"))
                continue
            if target is None or target.public_state != ms.SERVING:
                state = target.public_state if target else "unknown"
                results.append(ss.ReadResult(int(StatusCode.TARGET_OFFLINE), 0,
                                             f"target {io.target_id} is {state}, not SERVING"))
                continue
            results.append(self._read_one(engine, io, req.allow_uncommitted, out[pos:pos + io.length],
                                          nowait))
            end = pos + results[-1].length
            pos = align_up(end)
        return results, end

    @staticmethod
    def _read_one(engine: ChunkEngine, io: ss.ReadIO, allow_uncommitted: bool, out: memoryview,
                  nowait: bool = False):
        meta = engine.get_meta(io.chunk_id)
        if meta is None:
            return ss.ReadResult(0, 0)  # a hole: the client fills zeros
        if not readable(meta, allow_uncommitted):
            return ss.ReadResult(int(StatusCode.CHUNK_NOT_COMMIT), 0,
                                 f"chunk {io.chunk_id.hex()} has a pending update")
        try:
            data, meta = engine.read(io.chunk_id, io.offset, io.length, out,
                                     pending=allow_uncommitted and meta.update_ver != meta.commit_ver,
                                     nowait=nowait)
        except ThreeFSError as e:
            if e.code == StatusCode.CHUNK_NOT_FOUND:  # removed meanwhile: a hole
                return ss.ReadResult(0, 0)
            return ss.ReadResult(int(e.code), 0, e.message)
        return ss.ReadResult(0, len(data), "", meta.commit_ver, meta.crc)

    # -- range operations (GC, truncate) ---------------------------------------------------------
    @rpc(ss.RemoveRangeReq)
    async def remove_range(self, ctx: CallContext, req: ss.RemoveRangeReq) -> ss.RemoveRangeRsp:
        chain = await self._chain_checked(req.chain_id, req.chain_ver)
        me = self._my_target(chain)
        metas = await self._disk(self.engines[me].iter_metas, req.begin, req.end)
        removed = 0
        for meta in metas:
            sub = ss.UpdateReq(req.chain_id, req.chain_ver, meta.chunk_id, ss.REMOVE,
                               chunk_size=req.chunk_size)
            await self.update(ctx, sub)
            removed += 1
        return ss.RemoveRangeRsp(removed)

    @rpc(ss.LastChunkReq)
    async def last_chunk(self, ctx: CallContext, req: ss.LastChunkReq) -> ss.LastChunkRsp:
        me = self._my_target(await self._chain(req.chain_id))
        metas = await self._disk(self.engines[me].iter_metas, req.begin, req.end, reverse=True, limit=1)
        if not metas:
            return ss.LastChunkRsp(b"", 0)
        return ss.LastChunkRsp(metas[0].chunk_id, metas[0].length)

    @rpc(Empty)
    async def status(self, ctx: CallContext, req: Empty) -> ss.StatusRsp:
        routing = self.mgmtd.routing
        return ss.StatusRsp(self.config.node_id, [
            ss.TargetStat(tid, self.local_state(routing, tid), e.chunk_count(), e.used_bytes())
            for tid, e in sorted(self.engines.items())])
