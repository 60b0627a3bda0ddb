"""mgmtd: membership, heartbeats, versioned routing info, chain tables, the chain state machine, HA.

Several mgmtd share one KV. Each runs a lease pass every `mgmtd_lease_renew_s` (`MgmtdStore.renew_lease`):
the holder extends the lease, anyone takes an expired one. Only the primary serves; a standby answers
NOT_PRIMARY naming the primary, and every mutation re-checks the lease inside its own transaction
(`_guard`), so a deposed primary can never write. A new primary reloads everything from the KV, publishes a
new routing version and, for one heartbeat timeout (bootstrapping), judges nobody dead.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import time

from threefs.common.config import ServiceConfig
from threefs.common.health import PROBLEM_CHARS_MAX, PROBLEMS_MAX
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.kv import Transaction
from threefs.mgmtd.chain_state import admin_offline_effective, next_chain, sync_done_refusal
from threefs.mgmtd.store import MgmtdStore, read_lease
from threefs.rpc.auth import TokenAuthenticator, require_cluster, token_entries
from threefs.rpc.schemas import mgmtd as s
from threefs.rpc.schemas.common import Empty
from threefs.rpc.server import CallContext, rpc

log = logging.getLogger(__name__)

PRIMARY, STANDBY = "primary", "standby"
SYNC_REPORT_TTL_HEARTBEATS = 3  # a resync not reported for this many heartbeat intervals is over
FLAP_WINDOW_S = 600.0  # `threefs status` counts a node's failures over this window
FAILURES_KEPT = 64  # failure times remembered per node
LEASE_END_SLACK_S = 0.02  # a standby's pass comes this long after another's lease ends
DEAF_LOG_S = 0.5  # a stall of mgmtd's own at least this long is logged


class MgmtdService:
    def __init__(self, config: ServiceConfig, store: MgmtdStore, *, auth: TokenAuthenticator | None = None,
                 clock=time.monotonic, wall_ns=time.time_ns):
        self.config = config
        self.store = store
        self.clock = clock  # heartbeat ages (this process only)
        self.wall_ns = wall_ns  # the lease: shared by processes, so wall clock (one host, or NTP)
        self.role = STANDBY
        self.lease: s.MgmtdLease | None = None
        self.routing: s.RoutingInfo | None = None
        self.last_heartbeat: dict[int, float] = {}  # node id -> clock()
        self.node_routing: dict[int, int] = {}  # node id -> routing version its last heartbeat was sent with
        self.local_states: dict[int, str] = {}  # target id -> local state from heartbeats
        self.synced: set[int] = set()  # targets whose resync finished, until they are SERVING
        self.syncs: dict[int, tuple[float, list[s.SyncProgress]]] = {}  # node id -> (clock, its resyncs)
        self.node_problems: dict[int, list[str]] = {}  # node id -> what its last heartbeat reported
        self.failures: dict[int, collections.deque] = {}  # node id -> clock() of each time it failed
        self.kv_error: tuple[float, str] | None = None  # (since, error) while lease renewals fail
        self.primary_since = clock()
        self.primary_since_ns = 0
        self.auth = auth if auth is not None else TokenAuthenticator("")
        self.auth.reload = self._reload_tokens  # a token issued by another mgmtd a moment ago
        self._lock = asyncio.Lock()  # serialises mutations (one writer of the routing info)
        # What was late under pressure (metrics; `threefs.testing.pressure` reports them): the longest lease
        # pass (one KV commit, C), the longest time between two renewals that kept the lease, and the
        # longest time a node went without a heartbeat received here while primary.
        self.lease_pass_s_max = 0.0
        self.lease_renew_gap_s_max = 0.0
        self.heartbeat_gap_s_max = 0.0
        self._last_renewal: float | None = None

    # -- HA ------------------------------------------------------------------------------------------
    @property
    def me(self) -> s.MgmtdMember:
        return s.MgmtdMember(self.config.node_id, self.config.addr, 0)

    async def start(self) -> None:
        """First lease pass: become primary now if nobody holds the lease."""
        await self._reload_tokens()
        try:
            await self.lease_pass()
        except ThreeFSError as e:
            log.warning("first lease pass failed (will retry): %s", e)

    async def lease_pass(self) -> None:
        t0 = self.clock()
        lease, token_version = await self.store.renew_lease(self.me, int(self.config.mgmtd_lease_s * 1e9),
                                                            self.wall_ns)
        now = self.clock()
        self.lease_pass_s_max = max(self.lease_pass_s_max, now - t0)
        lapsed = self.role == PRIMARY and not self._lease_valid()  # we were not primary for a while
        self.lease = lease
        mine = lease.primary_id == self.config.node_id
        if mine and lapsed:
            # Nobody else took the lease while ours had lapsed, so it is ours again; but meanwhile we
            # refused every heartbeat (NOT_PRIMARY): judge nobody on the table of before the lapse.
            self._deaf(now - self._last_renewal if self._last_renewal is not None else 0.0,
                       "its lease had lapsed")
        if mine and self.role == PRIMARY and self._last_renewal is not None:
            self.lease_renew_gap_s_max = max(self.lease_renew_gap_s_max, now - self._last_renewal)
        self._last_renewal = now if mine else None
        if mine and self.role != PRIMARY:
            await self._become_primary()
        elif not mine and self.role == PRIMARY:
            self._step_down(f"mgmtd {lease.primary_id} at {lease.primary_addr} holds the lease")
        if token_version != self.auth.version:
            await self._reload_tokens()

    async def lease_loop(self) -> None:
        """Runs for the service's lifetime; a KV outage past the lease demotes us."""
        while True:
            await asyncio.sleep(self._next_pass_s())
            try:
                await self.lease_pass()
                self.kv_error = None
            except Exception as e:  # a KV outage, or a bug: keep trying; never keep a lapsed lease
                if isinstance(e, ThreeFSError) and e.code == StatusCode.KV_ERROR:
                    self.kv_error = (self.kv_error or (self.clock(), ""))[0], e.message
                if isinstance(e, ThreeFSError):
                    log.warning("lease pass failed: %s", e)
                else:
                    log.exception("lease pass failed")
                if self.role == PRIMARY and not self._lease_valid():
                    self._step_down("could not renew the lease before it ended")

    def _next_pass_s(self) -> float:
        """The primary renews every R. A standby polls every R too, but the pass right after another's lease
        ends comes at that end (+ LEASE_END_SLACK_S) rather than up to R later: an unclean failover's gap loses
        R (docs/architecture.md, "The margins, derived")."""
        every = self.config.mgmtd_lease_renew_s
        lease = self.lease
        if self.role == PRIMARY or lease is None or lease.primary_id == self.config.node_id:
            return every
        until_end = (lease.lease_end_ns - self.wall_ns()) / 1e9
        return min(every, until_end + LEASE_END_SLACK_S) if until_end >= 0 else every

    async def release(self) -> None:
        """Clean shutdown: give the lease up so a standby takes over at its next pass."""
        if self.role == PRIMARY:
            self.role = STANDBY
            try:
                await self.store.release_lease(self.config.node_id, self.wall_ns())
            except ThreeFSError as e:
                log.warning("could not release the lease (it will expire): %s", e)

    async def _become_primary(self) -> None:
        async with self._lock:
            routing = await self.store.load()
            routing.version += 1  # a new primary always publishes a new version
            routing.primary_addr = self.config.addr
            await self.store.save([], routing.version, self._guard)
            self.routing = routing
            self.last_heartbeat.clear()
            self.node_routing.clear()
            self.local_states.clear()
            self.synced.clear()
            self.syncs.clear()
            self.primary_since, self.primary_since_ns = self.clock(), self.wall_ns()
            self.role = PRIMARY
        log.warning("mgmtd %d is primary: routing v%d, %d nodes, %d chains (bootstrapping %.1f s)",
                    self.config.node_id, routing.version, len(routing.nodes), len(routing.chains),
                    self.config.heartbeat_timeout_s)

    def _step_down(self, why: str) -> None:
        self.role = STANDBY  # `routing` stays for handlers still running; `check_primary` refuses new ones
        log.warning("mgmtd %d is no longer primary: %s", self.config.node_id, why)

    def _lease_valid(self) -> bool:
        lease = self.lease
        return (lease is not None and lease.primary_id == self.config.node_id
                and self.wall_ns() < lease.lease_end_ns)

    def primary_addr(self) -> str:
        lease = self.lease
        if lease is None or lease.lease_end_ns <= self.wall_ns():
            return ""
        return lease.primary_addr

    def check_primary(self) -> s.RoutingInfo:
        if self.role == PRIMARY and self._lease_valid() and self.routing is not None:
            return self.routing
        raise status_error(StatusCode.NOT_PRIMARY, s.not_primary_message(self.config.addr, self.primary_addr()))

    async def _guard(self, tr: Transaction) -> None:
        """Inside every mutation's transaction: we still hold the lease (conflict-tracked read)."""
        lease = await read_lease(tr)
        if lease is None or lease.primary_id != self.config.node_id or lease.lease_end_ns <= self.wall_ns():
            raise status_error(StatusCode.NOT_PRIMARY, s.not_primary_message(
                self.config.addr, lease.primary_addr if lease else ""))

    def _deaf(self, seconds: float, why: str) -> None:
        """We heard nobody for `seconds` (our event loop stalled, or our lease had lapsed): nodes get that time
        back. A node is failed only after T of silence *while we were listening*; a primary that judged
        across its own stall would fail every healthy node whose heartbeats were waiting in its sockets.
        Failing later than T after a node's last heartbeat is safe: its fence closed at F < T anyway."""
        if seconds <= 0:
            return
        now = self.clock()
        for nid, t in self.last_heartbeat.items():
            self.last_heartbeat[nid] = min(now, t + seconds)
        self.primary_since = min(now, self.primary_since + seconds)
        if seconds >= DEAF_LOG_S:
            log.warning("mgmtd %d heard nobody for %.1f s (%s): nodes get that time back before being judged",
                        self.config.node_id, seconds, why)

    @property
    def bootstrapping(self) -> bool:
        """A new primary waits one heartbeat timeout before judging anyone dead (3FS: 2 min)."""
        return self.clock() - self.primary_since < self.config.heartbeat_timeout_s

    # -- tokens --------------------------------------------------------------------------------------
    async def _reload_tokens(self) -> None:
        version, users = await self.store.users()
        self.auth.update(version, token_entries(users))

    # -- mutations -----------------------------------------------------------------------------------
    async def commit(self, objects: list, users: list[s.UserInfo] | None = None) -> None:
        """Persist changed objects under a new routing version (lease re-checked), then publish them."""
        routing = self.check_primary()
        version = routing.version + 1
        await self.store.save(objects, version, self._guard, users)
        for obj in objects:
            table = {s.NodeInfo: routing.nodes, s.TargetInfo: routing.targets,
                     s.ChainInfo: routing.chains, s.ChainTable: routing.tables}[type(obj)]
            key = {s.NodeInfo: "node_id", s.TargetInfo: "target_id", s.ChainInfo: "chain_id",
                   s.ChainTable: "table_id"}[type(obj)]
            table[getattr(obj, key)] = obj
        if users:
            routing.token_version += 1
        routing.version = version

    # -- RPC: membership -----------------------------------------------------------------------------
    @rpc(Empty)
    async def get_primary(self, ctx: CallContext, req: Empty) -> s.PrimaryRsp:
        """Answered by every mgmtd: who am I, who is primary."""
        lease = self.lease
        primary = self.role == PRIMARY and self._lease_valid()
        return s.PrimaryRsp(self.config.node_id, self.config.addr, primary,
                            lease.primary_id if lease else 0, self.primary_addr(),
                            lease.lease_end_ns if lease else 0, self._kv_error_text())

    def _kv_error_text(self) -> str:
        if self.kv_error is None:
            return ""
        return f"{self.kv_error[1]} (for {self.clock() - self.kv_error[0]:.0f} s)"

    @rpc(s.RegisterReq)
    async def register(self, ctx: CallContext, req: s.RegisterReq) -> s.RegisterRsp:
        require_cluster(ctx.principal, "registering a service")
        if req.type not in (s.MGMTD, s.META, s.STORAGE):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"unknown node type {req.type!r}")
        async with self._lock:
            routing = self.check_primary()
            node = s.NodeInfo(req.node_id, req.type, req.addr, req.hostname,
                              req.failure_domain or f"{req.hostname}/{req.node_id}", True, time.time_ns())
            changed = [node] if routing.nodes.get(req.node_id) != node else []
            for tid in req.targets:
                old = routing.targets.get(tid)
                if old is not None and old.node_id != req.node_id:
                    raise status_error(StatusCode.INVALID_ARGUMENT,
                                       f"target {tid} belongs to node {old.node_id}, not {req.node_id}")
                if old is None:
                    changed.append(s.TargetInfo(tid, req.node_id))
            if changed:
                await self.commit(changed)
            self.last_heartbeat[req.node_id] = self.clock()
        log.info("registered %s node %d at %s", req.type, req.node_id, req.addr)
        return s.RegisterRsp(routing.version)

    @rpc(s.HeartbeatReq)
    async def heartbeat(self, ctx: CallContext, req: s.HeartbeatReq) -> s.HeartbeatRsp:
        require_cluster(ctx.principal, "heartbeats")
        routing = self.check_primary()
        node = routing.nodes.get(req.node_id)
        if node is None:
            raise status_error(StatusCode.NODE_NOT_FOUND, f"node {req.node_id} is not registered")
        if req.hb_version <= node.hb_version:  # reordered or duplicated: older news than we have
            # ... but the node counts this reply as accepted from this copy's send time, so its receipt
            # must count here too (a copy resent after a lost reply: fence.heartbeat_every_mgmtd)
            self.last_heartbeat[req.node_id] = max(self.clock(), self.last_heartbeat.get(req.node_id, 0.0))
            return s.HeartbeatRsp(routing.version)
        for t in req.targets:
            if t.local_state not in s.LOCAL_STATES:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"target {t.target_id}: unknown local "
                                   f"state {t.local_state!r} (one of {', '.join(s.LOCAL_STATES)})")
        now = self.clock()
        self.heartbeat_gap_s_max = max(self.heartbeat_gap_s_max,
                                       now - self.last_heartbeat.get(req.node_id, self.primary_since))
        self.last_heartbeat[req.node_id] = now
        node.hb_version = req.hb_version
        node.last_heartbeat_ns = time.time_ns()
        self.node_routing[req.node_id] = max(req.routing_version, self.node_routing.get(req.node_id, 0))
        self._record_targets(req)
        if not node.alive:
            async with self._lock:
                revived = copy.copy(node)
                revived.alive = True
                await self.commit([revived])
            log.warning("node %d (%s) is back", req.node_id, node.addr)
        return s.HeartbeatRsp(routing.version)

    def _admin_offline_effective(self, info: s.TargetInfo) -> bool:
        node = self.routing.nodes.get(info.node_id)
        chain = self.routing.chains.get(info.chain_id)
        public = next((t.public_state for t in chain.targets if t.target_id == info.target_id),
                      info.public_state) if chain is not None else info.public_state
        return admin_offline_effective(public, info.admin_offline_ver, node is not None and node.alive,
                                       self.node_routing.get(info.node_id, 0))

    def _record_targets(self, req: s.HeartbeatReq) -> None:
        problems = [p[:PROBLEM_CHARS_MAX] for p in req.problems[:PROBLEMS_MAX]]
        if problems:
            self.node_problems[req.node_id] = problems
        else:
            self.node_problems.pop(req.node_id, None)
        for t in req.targets:
            info = self.routing.targets.get(t.target_id)
            if info is None or info.node_id != req.node_id:
                continue
            state = t.local_state
            if t.target_id in self.synced and state == s.ONLINE:
                state = s.UPTODATE  # its resync finished (sync_done) and mgmtd has not acted yet
            self.local_states[t.target_id] = state
            info.local_state, info.used_bytes = state, t.used_bytes
            info.free_bytes, info.fs_id = t.free_bytes, t.fs_id
        self.syncs[req.node_id] = (self.clock(), list(req.syncs))

    @rpc(s.GetRoutingReq)
    async def get_routing(self, ctx: CallContext, req: s.GetRoutingReq) -> s.GetRoutingRsp:
        routing = self.check_primary()
        if req.known_version == routing.version:
            return s.GetRoutingRsp(None)
        routing.bootstrapping = self.bootstrapping
        return s.GetRoutingRsp(routing)

    @rpc(s.SyncDoneReq)
    async def sync_done(self, ctx: CallContext, req: s.SyncDoneReq) -> s.OkRsp:
        require_cluster(ctx.principal, "sync_done")
        routing = self.check_primary()
        if req.target_id not in routing.targets:
            raise status_error(StatusCode.TARGET_NOT_FOUND, f"unknown target {req.target_id}")
        chain = routing.chains.get(req.chain_id)
        if chain is None:
            raise status_error(StatusCode.CHAIN_NOT_FOUND, f"unknown chain {req.chain_id}")
        refusal = sync_done_refusal(chain, req.target_id, req.chain_ver)
        if refusal is not None:
            raise status_error(StatusCode.CHAIN_VERSION_MISMATCH, refusal)
        self.synced.add(req.target_id)
        self.local_states[req.target_id] = s.UPTODATE
        await self.update_chains()
        return s.OkRsp()

    @rpc(Empty)
    async def status(self, ctx: CallContext, req: Empty) -> s.MgmtdStatusRsp:
        routing = self.check_primary()
        routing.bootstrapping = self.bootstrapping
        now = self.clock()
        ages = {nid: round(now - t, 3) for nid, t in self.last_heartbeat.items()}
        failures = {nid: n for nid, times in self.failures.items()
                    if (n := sum(now - t <= FLAP_WINDOW_S for t in times))}
        kv_error = self._kv_error_text()
        return s.MgmtdStatusRsp(routing, await self.get_primary(ctx, req), await self.store.members(), ages,
                                self.current_syncs(), self.primary_since_ns, self.config.heartbeat_timeout_s,
                                dict(self.node_problems), failures, kv_error, FLAP_WINDOW_S)

    def current_syncs(self) -> list[s.SyncProgress]:
        ttl = SYNC_REPORT_TTL_HEARTBEATS * self.config.heartbeat_interval_s
        now = self.clock()
        return [p for seen, progress in list(self.syncs.values()) if now - seen <= ttl for p in progress]

    # -- background ----------------------------------------------------------------------------------
    async def check_heartbeats(self) -> None:
        routing = self.routing
        if self.role != PRIMARY or routing is None or self.bootstrapping:
            return
        silent_since = self.clock() - self.config.heartbeat_timeout_s
        dead = [node for node in routing.nodes.values()
                if node.type != s.MGMTD and node.alive
                and self.last_heartbeat.get(node.node_id, self.primary_since) < silent_since]
        if not dead:
            return
        async with self._lock:
            failed = []
            for node in dead:
                n = copy.copy(node)
                n.alive = False
                failed.append(n)
                for t in routing.targets.values():
                    if t.node_id == node.node_id:
                        self.local_states[t.target_id] = s.LOCAL_OFFLINE
                        t.local_state = s.LOCAL_OFFLINE
                log.warning("node %d (%s) missed heartbeats for %.1f s: marked failed", node.node_id,
                            node.addr, self.config.heartbeat_timeout_s)
                times = self.failures.setdefault(node.node_id, collections.deque(maxlen=FAILURES_KEPT))
                times.append(self.clock())
                self.node_problems.pop(node.node_id, None)
            await self.commit(failed)

    def _local_view(self, chain: s.ChainInfo) -> dict[int, str]:
        """Local states as the state machine sees them: admin-offlined targets count as OFFLINE once
        they serve no more reads (`chain_state.admin_offline_effective`)."""
        out = {}
        for t in chain.targets:
            info = self.routing.targets.get(t.target_id)
            offline = info is None or (info.admin_offline and self._admin_offline_effective(info))
            out[t.target_id] = s.LOCAL_OFFLINE if offline else self.local_states.get(t.target_id,
                                                                                     s.LOCAL_OFFLINE)
        return out

    async def update_chains(self) -> None:
        if self.role != PRIMARY or self.routing is None or self.bootstrapping:
            return
        async with self._lock:
            changed: list = []
            for chain in list(self.routing.chains.values()):
                new = next_chain(chain, self._local_view(chain))
                if new is chain:
                    continue
                log.info("chain %d v%d -> v%d: %s", chain.chain_id, chain.version, new.version,
                         ", ".join(f"{t.target_id}:{t.public_state}" for t in new.targets))
                changed.append(new)
                changed.extend(self._target_states(new))
            if changed:
                await self.commit(changed)
            self.synced = {t for t in self.synced if self.routing.targets[t].public_state == s.SYNCING}

    def _target_states(self, chain: s.ChainInfo) -> list[s.TargetInfo]:
        out = []
        for t in chain.targets:
            info = copy.copy(self.routing.targets[t.target_id])
            info.chain_id, info.public_state = chain.chain_id, t.public_state
            out.append(info)
        return out

    async def run_background(self) -> None:
        """Runs until cancelled (the service's lifetime); each pass survives its own errors."""
        interval = min(self.config.chain_update_interval_s, self.config.heartbeat_interval_s)
        while True:
            before = self.clock()
            await asyncio.sleep(interval)
            self._deaf(self.clock() - before - interval, "its event loop stalled")
            try:
                await self.check_heartbeats()
                await self.update_chains()
            except ThreeFSError as e:
                log.warning("mgmtd background pass failed (retrying): %s", e)
            except Exception:
                log.exception("mgmtd background pass failed; retrying")
