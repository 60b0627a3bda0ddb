"""mgmtd: membership, heartbeats, versioned routing info, chain tables, the chain state machine."""

from __future__ import annotations

import asyncio
import copy
import logging
import time

from threefs.common.config import ServiceConfig
from threefs.common.ids import target_id as make_target_id  # noqa: F401  (documented numbering)
from threefs.common.status import StatusCode, status_error
from threefs.mgmtd.chain_state import next_chain
from threefs.mgmtd.store import MgmtdStore
from threefs.rpc.schemas import mgmtd as s
from threefs.rpc.server import CallContext, rpc

log = logging.getLogger(__name__)


class MgmtdService:
    def __init__(self, config: ServiceConfig, store: MgmtdStore, clock=time.monotonic):
        self.config = config
        self.store = store
        self.clock = clock
        self.routing: s.RoutingInfo | None = None
        self.last_heartbeat: dict[int, float] = {}  # node id -> clock()
        self.local_states: dict[int, str] = {}  # target id -> local state from heartbeats
        self.started_at = clock()
        self._lock = asyncio.Lock()  # serialises mutations (one writer of the routing info)

    async def start(self) -> None:
        self.routing = await self.store.load()
        self.routing.version += 1  # a new primary always publishes a new version
        self.routing.bootstrapping = True
        await self.store.save([], self.routing.version)
        log.info("mgmtd loaded routing v%d: %d nodes, %d chains", self.routing.version,
                 len(self.routing.nodes), len(self.routing.chains))

    @property
    def bootstrapping(self) -> bool:
        """A new primary waits one heartbeat timeout before judging anyone dead (3FS: 2 min)."""
        return self.clock() - self.started_at < self.config.heartbeat_timeout_s

    async def _commit(self, objects: list) -> None:
        """Persist changed objects under a new routing version, then publish them."""
        version = self.routing.version + 1
        await self.store.save(objects, version)
        for obj in objects:
            table = {s.NodeInfo: self.routing.nodes, s.TargetInfo: self.routing.targets,
                     s.ChainInfo: self.routing.chains, s.ChainTable: self.routing.tables}[type(obj)]
            key = {s.NodeInfo: "node_id", s.TargetInfo: "target_id", s.ChainInfo: "chain_id",
                   s.ChainTable: "table_id"}[type(obj)]
            table[getattr(obj, key)] = obj
        self.routing.version = version

    # -- RPC ------------------------------------------------------------------------------------
    @rpc(s.RegisterReq)
    async def register(self, ctx: CallContext, req: s.RegisterReq) -> s.RegisterRsp:
        if req.type not in (s.MGMTD, s.META, s.STORAGE):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"unknown node type {req.type!r}")
        async with self._lock:
            node = s.NodeInfo(req.node_id, req.type, req.addr, req.hostname,
                              req.failure_domain or f"{req.hostname}/{req.node_id}", True, time.time_ns())
            changed = [node] if self.routing.nodes.get(req.node_id) != node else []
            for tid in req.targets:
                old = self.routing.targets.get(tid)
                if old is not None and old.node_id != req.node_id:
                    raise status_error(StatusCode.INVALID_ARGUMENT,
                                       f"target {tid} belongs to node {old.node_id}, not {req.node_id}")
                if old is None:
                    changed.append(s.TargetInfo(tid, req.node_id))
            if changed:
                await self._commit(changed)
            self.last_heartbeat[req.node_id] = self.clock()
        log.info("registered %s node %d at %s", req.type, req.node_id, req.addr)
        return s.RegisterRsp(self.routing.version)

    @rpc(s.HeartbeatReq)
    async def heartbeat(self, ctx: CallContext, req: s.HeartbeatReq) -> s.HeartbeatRsp:
        node = self.routing.nodes.get(req.node_id)
        if node is None:
            raise status_error(StatusCode.NODE_NOT_FOUND, f"node {req.node_id} is not registered")
        if req.hb_version < node.hb_version:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"heartbeat version {req.hb_version} < {node.hb_version}")
        self.last_heartbeat[req.node_id] = self.clock()
        node.hb_version = req.hb_version
        node.last_heartbeat_ns = time.time_ns()
        for t in req.targets:
            info = self.routing.targets.get(t.target_id)
            if info is not None and info.node_id == req.node_id:
                self.local_states[t.target_id] = t.local_state
                info.local_state, info.used_bytes = t.local_state, t.used_bytes
        if not node.alive:
            async with self._lock:
                revived = copy.copy(node)
                revived.alive = True
                await self._commit([revived])
            log.info("node %d is back", req.node_id)
        return s.HeartbeatRsp(self.routing.version)

    @rpc(s.GetRoutingReq)
    async def get_routing(self, ctx: CallContext, req: s.GetRoutingReq) -> s.GetRoutingRsp:
        if req.known_version == self.routing.version:
            return s.GetRoutingRsp(None)
        self.routing.bootstrapping = self.bootstrapping
        return s.GetRoutingRsp(self.routing)

    @rpc(s.CreateChainTableReq)
    async def create_chain_table(self, ctx: CallContext, req: s.CreateChainTableReq):
        async with self._lock:
            table = self.routing.tables.get(req.table_id)
            if table is not None:
                return s.CreateChainTableRsp(table, False)
            chains = self._place_chains(req.replicas, req.chains)
            first = max(self.routing.chains, default=0) + 1
            objects: list = []
            for i, target_ids in enumerate(chains):
                chain = s.ChainInfo(first + i, 1, [s.ChainTarget(t, s.SERVING) for t in target_ids])
                objects.append(chain)
                for t in target_ids:
                    info = copy.copy(self.routing.targets[t])
                    info.chain_id, info.public_state = chain.chain_id, s.SERVING
                    objects.append(info)
            table = s.ChainTable(req.table_id, 1, [c.chain_id for c in objects if type(c) is s.ChainInfo],
                                 req.replicas)
            await self._commit(objects + [table])
        log.info("created chain table %d: %d chains x %d replicas", req.table_id, len(chains), req.replicas)
        return s.CreateChainTableRsp(table, True)

    def _place_chains(self, replicas: int, wanted: int) -> list[list[int]]:
        """Chains of `replicas` free targets, each on a different failure domain, heads rotated."""
        if replicas < 1:
            raise status_error(StatusCode.INVALID_ARGUMENT, "replication factor must be >= 1")
        free: dict[str, list[int]] = {}
        for t in sorted(self.routing.targets.values(), key=lambda t: t.target_id):
            node = self.routing.nodes.get(t.node_id)
            if t.chain_id == 0 and node is not None and node.alive and node.type == s.STORAGE:
                free.setdefault(node.failure_domain, []).append(t.target_id)
        domains = sorted(free)
        if len(domains) < replicas:
            raise status_error(StatusCode.NOT_ENOUGH_NODES,
                               f"replication factor {replicas} needs {replicas} storage failure domains "
                               f"with free targets; only {len(domains)} have any")
        chains: list[list[int]] = []
        while not wanted or len(chains) < wanted:
            ranked = sorted(domains, key=lambda d: -len(free[d]))  # most free targets first
            picked = [d for d in ranked if free[d]][:replicas]
            if len(picked) < replicas:
                break
            shift = len(chains) % replicas  # rotate which domain heads the chain
            picked = picked[shift:] + picked[:shift]
            chains.append([free[d].pop(0) for d in picked])
        if not chains or (wanted and len(chains) < wanted):
            raise status_error(StatusCode.NOT_ENOUGH_NODES,
                               f"only {len(chains)} chains of {replicas} replicas fit the free targets")
        return chains

    @rpc(s.SyncDoneReq)
    async def sync_done(self, ctx: CallContext, req: s.SyncDoneReq) -> s.OkRsp:
        if req.target_id not in self.routing.targets:
            raise status_error(StatusCode.TARGET_NOT_FOUND, f"unknown target {req.target_id}")
        self.local_states[req.target_id] = s.UPTODATE
        await self.update_chains()
        return s.OkRsp()

    # -- background ------------------------------------------------------------------------------
    async def check_heartbeats(self) -> None:
        if self.bootstrapping:
            return
        now = self.clock()
        dead = []
        for node in self.routing.nodes.values():
            if node.type == s.MGMTD or not node.alive:
                continue
            if now - self.last_heartbeat.get(node.node_id, self.started_at) > self.config.heartbeat_timeout_s:
                dead.append(node)
        if not dead:
            return
        async with self._lock:
            failed = []
            for node in dead:
                n = copy.copy(node)
                n.alive = False
                failed.append(n)
                for t in self.routing.targets.values():
                    if t.node_id == node.node_id:
                        self.local_states[t.target_id] = s.LOCAL_OFFLINE
                        t.local_state = s.LOCAL_OFFLINE
                log.warning("node %d (%s) missed heartbeats for %.1f s: marked failed", node.node_id,
                            node.addr, self.config.heartbeat_timeout_s)
            await self._commit(failed)

    async def update_chains(self) -> None:
        if self.bootstrapping:
            return
        async with self._lock:
            changed: list = []
            for chain in self.routing.chains.values():
                local = {t.target_id: self.local_states.get(t.target_id, s.LOCAL_OFFLINE)
                         for t in chain.targets}
                new = next_chain(chain, local)
                if new is chain:
                    continue
                log.info("chain %d v%d -> v%d: %s", chain.chain_id, chain.version, new.version,
                         ", ".join(f"{t.target_id}:{t.public_state}" for t in new.targets))
                changed.append(new)
                for t in new.targets:
                    info = copy.copy(self.routing.targets[t.target_id])
                    info.public_state = t.public_state
                    changed.append(info)
            if changed:
                await self._commit(changed)

    async def run_background(self) -> None:
        """Runs until cancelled (the service's lifetime); each pass survives its own errors."""
        interval = min(self.config.chain_update_interval_s, self.config.heartbeat_interval_s)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check_heartbeats()
                await self.update_chains()
            except Exception:
                log.exception("mgmtd background pass failed; retrying")
