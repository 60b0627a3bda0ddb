"""Integrity: a background scrub re-reads every chunk and checks its CRC32C; a corrupted chunk (found by
the scrub or by a full-chunk read) is reported and replaced by a verified copy from a SERVING peer.

Repair keeps the chunk's versions: it fetches the peer's committed bytes of the same version, checks
them against the peer's checksum, and replaces the local copy under the chunk lock with one atomic
commit (a concurrent reader sees the old or the new bytes, never a missing chunk), so the replica
again matches its chain exactly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec

from threefs.common import crc32c
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.cluster.routing import serving_targets
from threefs.rpc.schemas import storage as ss
from threefs.rpc.server import CallContext, rpc

log = logging.getLogger(__name__)

SCRUB_BATCH = 64  # chunks verified per disk-pool call (bounds how long one call holds a thread)
CORRUPTIONS_KEPT = 100  # recent reports kept for status


@dataclass
class Corruption:
    time_ns: int
    target_id: int
    chunk_id: bytes
    found_by: str  # "scrub" | "read"
    repaired: bool = False
    detail: str = ""


class ScrubReq(msgspec.Struct):
    target_id: int = 0  # 0 = every target of this service


class ScrubRsp(msgspec.Struct):
    checked: int
    corrupted: int
    repaired: int


def _verify_batch(engine, chunk_ids: list[bytes]) -> tuple[int, list[bytes]]:
    """(chunks checked, chunks whose committed bytes fail their checksum); a chunk removed since the
    pass listed it is not counted."""
    checked, bad = 0, []
    for cid in chunk_ids:
        try:
            ok = engine.verify(cid)
        except ThreeFSError as e:
            if e.code == StatusCode.CHUNK_NOT_FOUND:
                continue
            raise
        checked += 1
        if not ok:
            bad.append(cid)
    return checked, bad


class Scrubber:
    def __init__(self, service, interval_s: float):
        self.svc = service
        self.interval_s = interval_s
        self.reports: list[Corruption] = []
        self.checked = self.corrupted = self.repaired = 0
        self._repairing: set[tuple[int, bytes]] = set()

    async def run(self) -> None:
        """Runs for the service's lifetime: one full pass over every target per interval."""
        if self.interval_s <= 0:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.scrub_all()
            except Exception:
                log.exception("scrub pass failed; retrying next interval")

    async def scrub_all(self, target_id: int = 0) -> ScrubRsp:
        """One pass over the chunks committed when the pass reaches each target. Chunks removed while
        the pass runs are skipped, and a target closed meanwhile (removed, or the service stopping)
        ends that target's pass: neither is an error (both happen under every delete-heavy load)."""
        before = (self.checked, self.corrupted, self.repaired)
        for tid, engine in sorted(self.svc.engines.items()):
            if target_id and tid != target_id:
                continue
            try:
                ids = [m.chunk_id for m in await self.svc.disk(engine.iter_metas) if m.commit_ver]
                for i in range(0, len(ids), SCRUB_BATCH):
                    checked, bad = await self.svc.disk(_verify_batch, engine, ids[i:i + SCRUB_BATCH])
                    self.checked += checked
                    for cid in bad:
                        await self.report(tid, cid, "scrub")
            except ThreeFSError as e:
                if e.code != StatusCode.TARGET_OFFLINE:  # the engine was closed (service stopping)
                    raise
                log.info("target %d closed during its scrub pass; skipped the rest", tid)
        return ScrubRsp(self.checked - before[0], self.corrupted - before[1], self.repaired - before[2])

    async def report(self, target_id: int, chunk_id: bytes, found_by: str) -> None:
        """Record a corruption and repair it (once at a time per chunk)."""
        key = (target_id, chunk_id)
        if key in self._repairing:
            return
        self._repairing.add(key)
        entry = Corruption(time.time_ns(), target_id, chunk_id, found_by)
        self.corrupted += 1
        self.reports = (self.reports + [entry])[-CORRUPTIONS_KEPT:]
        log.error("target %d: chunk %s fails its checksum (found by %s); repairing from a peer",
                  target_id, chunk_id.hex(), found_by)
        try:
            await self.repair(target_id, chunk_id)
            entry.repaired = True
            self.repaired += 1
            log.warning("target %d: chunk %s repaired", target_id, chunk_id.hex())
        except ThreeFSError as e:
            entry.detail = e.message
            log.error("target %d: chunk %s NOT repaired: %s", target_id, chunk_id.hex(), e.message)
        finally:
            self._repairing.discard(key)

    def _chain_of(self, target_id: int):
        routing = self.svc.mgmtd.routing
        info = routing.info.targets.get(target_id) if routing else None
        if info is None or not info.chain_id:
            raise status_error(StatusCode.TARGET_NOT_FOUND, f"target {target_id} is in no chain")
        return routing, routing.chain(info.chain_id)

    async def repair(self, target_id: int, chunk_id: bytes) -> None:
        engine = self.svc.engines[target_id]
        async with self.svc.chunk_lock(target_id, chunk_id):
            meta = engine.get_meta(chunk_id)
            if meta is None or not meta.commit_ver:
                return  # removed meanwhile
            if await self.svc.disk(engine.verify, chunk_id):
                return  # rewritten meanwhile by an update
            data = await self._fetch_good_copy(target_id, chunk_id, meta)
            ver, chain_ver = meta.commit_ver, meta.chain_ver
            # Replace the data in one atomic commit (readers never see the chunk missing), then put
            # the version numbers back: the chunk lock keeps updates out meanwhile.
            await self.svc.disk(engine.write, chunk_id, update_ver=ver + 1, chain_ver=chain_ver, offset=0,
                                 data=data, chunk_size=max(len(data), 1), full_replace=True)
            await self.svc.disk(engine.commit, chunk_id, ver + 1, chain_ver=chain_ver)
            fixed = await self.svc.disk(engine.set_versions, chunk_id, update_ver=ver, commit_ver=ver,
                                         chain_ver=chain_ver)
            if fixed.crc != crc32c.crc32c(data) or fixed.commit_ver != ver:
                raise status_error(StatusCode.INTERNAL, f"repair of chunk {chunk_id.hex()} left version "
                                   f"{fixed.commit_ver} crc {fixed.crc:08x}, expected {ver} "
                                   f"{crc32c.crc32c(data):08x}")

    async def _fetch_good_copy(self, target_id: int, chunk_id: bytes, meta) -> bytes:
        routing, chain = self._chain_of(target_id)
        errors = []
        for peer in serving_targets(chain):
            if peer == target_id:
                continue
            io = ss.ReadIO(chain.chain_id, peer, chunk_id, 0, meta.length)
            try:
                rsp, payload = await self.svc.rpc.call(routing.target_addr(peer), "storage.batch_read",
                                                       ss.BatchReadReq([io]), ss.BatchReadRsp)
            except ThreeFSError as e:
                errors.append(f"target {peer}: {e.message}")
                continue
            r = rsp.results[0]
            data = bytes(payload[:r.length]) if payload is not None else b""
            if r.status or r.commit_ver != meta.commit_ver or crc32c.crc32c(data) != r.chunk_crc:
                errors.append(f"target {peer}: status {r.status}, version {r.commit_ver}")
                continue
            return data
        raise status_error(StatusCode.CHECKSUM_MISMATCH, f"no verified copy of chunk {chunk_id.hex()} "
                           f"(version {meta.commit_ver}) on another SERVING replica: {'; '.join(errors)}")

    @rpc(ScrubReq)
    async def scrub(self, ctx: CallContext, req: ScrubReq) -> ScrubRsp:
        """Run a scrub pass now (admin, tests)."""
        return await self.scrub_all(req.target_id)
