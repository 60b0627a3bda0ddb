"""Resync: the predecessor of a SYNCING target brings it up to date (3FS "Data recovery").

1. dump the successor's chunk metadata (paged), 2. compare with ours, 3. send every chunk that differs
as a full replace under its chunk lock (live writes meanwhile are forwarded as full replaces too),
4. remove chunks only the successor has, 5. tell mgmtd `sync_done` -> the target becomes SERVING.
"""

from __future__ import annotations

import asyncio
import logging

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.rpc.server import CallContext, rpc
from threefs.storage import craq

log = logging.getLogger(__name__)

SCAN_INTERVAL_S = 0.5
RESYNC_INFLIGHT_MAX = 8  # chunks being sent to one syncing target at a time


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
                    job = craq.resync_job(chain, self.svc.engines)
                    if job is not None and job[1] not in self.active:
                        self.active.add(job[1])
                        task = asyncio.ensure_future(self._sync_guarded(chain.chain_id, *job))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
        finally:
            for t in tasks:
                t.cancel()

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
        sync_version = routing.chain(chain_id).version
        # Flows admitted under an older chain version may not forward to the SYNCING target: let them
        # finish, then every later update reaches it (as a full-chunk replace).
        await self.svc.quiet_below(me, sync_version)
        remote = await self._dump(routing.target_addr(successor), successor)
        engine = self.svc.engines[me]
        local = {meta.chunk_id for meta in await self.svc.disk(engine.iter_metas)}
        todo = sorted(local | set(remote))
        log.info("resync chain %d: target %d -> %d: checking %d chunks (%d here, %d there)",
                 chain_id, me, successor, len(todo), len(local), len(remote))
        self.progress[successor] = (0, len(todo))
        chunks, done, sent = iter(todo), [0], [0]

        async def worker() -> None:  # a bounded pool: memory stays flat for millions of chunks
            for cid in chunks:  # the shared iterator hands each chunk to one worker
                sent[0] += await self._send_chunk(chain_id, me, successor, cid, remote.get(cid))
                done[0] += 1
                self.progress[successor] = (done[0], len(todo))

        await asyncio.gather(*(worker() for _ in range(RESYNC_INFLIGHT_MAX)))
        sent = sent[0]
        await self.svc.mgmtd.call("sync_done", ms.SyncDoneReq(successor, chain_id, sync_version),
                                 ms.OkRsp)
        log.info("resync of target %d done: %d of %d chunks sent", successor, sent, len(todo))

    async def _send_chunk(self, chain_id: int, me: int, successor: int, cid: bytes, brief) -> int:
        """Decide and send under the chunk lock (craq.resync_chunk_flow); 1 if something was sent."""
        rsp = await self.svc.run_flow(craq.resync_locked_flow(me, successor, chain_id, cid, brief))
        return 0 if rsp is None else 1

    @rpc(ss.SyncDumpReq)
    async def sync_dump(self, ctx: CallContext, req: ss.SyncDumpReq) -> ss.SyncDumpRsp:
        engine = self.svc.engines.get(req.target_id)
        if engine is None:
            raise status_error(StatusCode.TARGET_NOT_FOUND, f"target {req.target_id} is not here")
        start = req.after + b"\x00" if req.after else b""
        metas = await self.svc.disk(engine.iter_metas, start, None, limit=req.limit + 1)
        briefs = [ss.ChunkBrief(x.chunk_id, x.commit_ver, x.length, x.crc, x.update_ver)
                  for x in metas[:req.limit]]
        return ss.SyncDumpRsp(briefs, len(metas) > req.limit)
