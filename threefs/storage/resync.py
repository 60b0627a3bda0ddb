"""Resync: the predecessor of a SYNCING target brings it up to date (3FS "Data recovery").

1. dump the successor's chunk metadata (paged), 2. compare with ours, 3. send every chunk that differs
as a full replace under its chunk lock (live writes meanwhile are forwarded as full replaces too),
4. remove chunks only the successor has, 5. tell mgmtd `sync_done` -> the target becomes SERVING.
"""

from __future__ import annotations

import asyncio
import logging

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.mgmtd.chain_state import write_targets
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.rpc.server import CallContext, rpc
from threefs.storage import craq

log = logging.getLogger(__name__)

SCAN_INTERVAL_S = 0.5


class Resyncer:
    def __init__(self, service):
        self.svc = service
        self.active: set[int] = set()  # successor targets being synced by us
        self.progress: dict[int, tuple[int, int]] = {}  # target -> (chunks sent, chunks to check)

    async def run(self) -> None:
        """Runs for the service's lifetime: start a sync for every SYNCING successor of ours."""
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                await asyncio.sleep(SCAN_INTERVAL_S)
                routing = self.svc.mgmtd.routing
                if routing is None:
                    continue
                for chain in routing.info.chains.values():
                    job = self._job(chain)
                    if job is not None and job[1] not in self.active:
                        self.active.add(job[1])
                        task = asyncio.ensure_future(self._sync_guarded(chain.chain_id, *job))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
        finally:
            for t in tasks:
                t.cancel()

    def _job(self, chain: ms.ChainInfo) -> tuple[int, int] | None:
        order = write_targets(chain)
        for me, successor in zip(order, order[1:]):
            state = next(t.public_state for t in chain.targets if t.target_id == successor)
            if me in self.svc.engines and state == ms.SYNCING:
                return me, successor
        return None

    async def _sync_guarded(self, chain_id: int, me: int, successor: int) -> None:
        try:
            await self.sync(chain_id, me, successor)
        except ThreeFSError as e:
            log.warning("resync of target %d from %d failed (will retry): %s", successor, me, e)
            await asyncio.sleep(1.0)
        finally:
            self.active.discard(successor)

    async def _dump(self, addr: str, successor: int) -> dict[bytes, ss.ChunkBrief]:
        remote, after = {}, b""
        while True:
            rsp, _ = await self.svc.rpc.call(addr, "storage.sync_dump", ss.SyncDumpReq(successor, after),
                                             ss.SyncDumpRsp)
            remote.update((c.chunk_id, c) for c in rsp.chunks)
            if not rsp.more:
                return remote
            after = rsp.chunks[-1].chunk_id

    async def sync(self, chain_id: int, me: int, successor: int) -> None:
        routing = await self.svc.mgmtd.get()
        addr = routing.target_addr(successor)
        remote = await self._dump(addr, successor)
        engine = self.svc.engines[me]
        local = {meta.chunk_id: meta for meta in await self.svc._disk(engine.iter_metas)}
        todo, extra = craq.resync_plan(local, remote)
        log.info("resync chain %d: target %d -> %d: %d chunks to send, %d to remove, %d equal",
                 chain_id, me, successor, len(todo), len(extra), len(local) - len(todo))
        sent = 0
        self.progress[successor] = (0, len(todo) + len(extra))
        for cid in todo + extra:
            await self._send_chunk(chain_id, me, successor, cid)
            sent += 1
            self.progress[successor] = (sent, len(todo) + len(extra))
        await self.svc.mgmtd.call("sync_done", ms.SyncDoneReq(successor), ms.OkRsp)
        log.info("resync of target %d done (%d chunks)", successor, sent)

    async def _send_chunk(self, chain_id: int, me: int, successor: int, cid: bytes) -> None:
        lock = self.svc._lock(me, cid)
        async with lock:
            chain = (await self.svc.mgmtd.get()).chain(chain_id)
            await craq.drive(craq.resync_chunk_flow(me, successor, chain, cid), self._effects(me))

    def _effects(self, me: int):
        base = self.svc._effects(me)
        engine = self.svc.engines[me]

        async def perform(e):
            if isinstance(e, craq.ReadCommitted):
                data, _ = await self.svc._disk(engine.read, e.chunk_id, 0, e.length)
                return data
            return await base(e)

        return perform

    @rpc(ss.SyncDumpReq)
    async def sync_dump(self, ctx: CallContext, req: ss.SyncDumpReq) -> ss.SyncDumpRsp:
        engine = self.svc.engines.get(req.target_id)
        if engine is None:
            raise status_error(StatusCode.TARGET_NOT_FOUND, f"target {req.target_id} is not here")
        start = req.after + b"\x00" if req.after else b""
        metas = await self.svc._disk(engine.iter_metas, start, None, limit=req.limit + 1)
        briefs = [ss.ChunkBrief(x.chunk_id, x.commit_ver, x.length, x.crc) for x in metas[:req.limit]]
        return ss.SyncDumpRsp(briefs, len(metas) > req.limit)
