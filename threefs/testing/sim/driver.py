"""The simulated cluster the production CRAQ code runs in: the driver of the simulator.

Virtual time (an event heap), storage processes that run the production flows (`craq.serve_update_flow`,
`craq.resync_locked_flow`) with simulated effects on an in-memory chunk store (SimStore, which answers
as the chunk engine does), a network that delays, reorders and drops messages, a mgmtd that runs the
production chain state machine on heartbeats (failure detection after a delay, admin-offlined targets
counted OFFLINE) and pushes routing to each node after its own delay, and the resync of SYNCING
targets. What happens to the cluster and when (faults, clients) is the scenario's (scenario.py); what
must hold is the checker's (checker.py). Nothing here draws randomness except message delays and drops,
routing delays and refresh delays, so a seed replays exactly.
"""

from __future__ import annotations

import collections
import heapq
import random
from dataclasses import dataclass, field

from threefs.common import crc32c
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.mgmtd.chain_state import admin_offline_effective, next_chain, sync_done_refusal
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.storage import craq
from threefs.testing.sim_store import SimStore

CALL_TIMEOUT = 1.0  # virtual seconds before a caller gives up on a message
CHAIN_ID = 1


@dataclass
class Node:
    """One storage process hosting one target of the chain."""

    target_id: int
    store: SimStore = field(default_factory=SimStore)
    up: bool = True
    epoch: int = 0  # bumped on crash and restart: processes of an older epoch die
    view: ms.ChainInfo | None = None  # this node's (possibly stale) routing: the chain,
    view_offline: frozenset = frozenset()  # the targets it shows admin-offlined (TargetInfo.admin_offline)
    view_version: int = 0  # and its routing version
    locks: dict = field(default_factory=dict)  # chunk id -> list of waiting resume callbacks (FIFO)
    replica: craq.ReplicaState = field(default_factory=craq.ReplicaState)  # lost on a crash
    synced: bool = False  # mgmtd accepted its sync_done (mgmtd's `synced` set)
    syncing_to: int = 0  # the successor this node resyncs now (Resyncer.active)

    @property
    def flows(self) -> craq.FlowTracker:
        return self.replica.tracker(self.target_id)


class Cluster:
    DETECT_S = 0.3  # heartbeat timeout
    PASS_S = 0.05  # chain state machine period

    def __init__(self, rng: random.Random, replicas: int = 3, drop_p: float = 0.03,
                 report_from_view: bool = True, on_commit=None, label: str = "") -> None:
        self.rng, self.label = rng, label
        self.now = 0.0
        self._events: list = []
        self._seq = 0
        ids = [10 + i for i in range(replicas)]
        self.nodes = {t: Node(t) for t in ids}
        self.chain = ms.ChainInfo(CHAIN_ID, 1, [ms.ChainTarget(t, ms.SERVING) for t in ids])
        self.routing_version = 1  # mgmtd's RoutingInfo.version: bumped by chain and admin changes
        self.client_node = Node(0)  # where client messages come from (never crashes)
        self.drop_p = drop_p
        # what a node reports comes from its own (maybe stale) routing, as the service does; False: from
        # mgmtd's chain (the model the seeds before the admin faults were found with: LEGACY)
        self.report_from_view = report_from_view
        self.on_commit = on_commit or (lambda now, cid, store: None)
        self.down_since: dict[int, float] = {}
        self.admin_offline: set[int] = set()  # mgmtd's TargetInfo.admin_offline
        self.offline_ver: dict[int, int] = {}  # TargetInfo.admin_offline_ver
        self.node_routing: dict[int, int] = {}  # mgmtd's node_routing: routing version of the last heartbeat
        self.reported: dict[int, str] = {}  # mgmtd's view of each target's local state
        self.faults: collections.Counter = collections.Counter()  # kind -> times injected
        for n in self.nodes.values():
            self.learn(n)

    def start(self) -> None:
        """The background loops: mgmtd's pass, and each node's resync scan."""
        self.at(0, self.mgmtd_pass)
        for node in self.nodes.values():
            self.at(0.2, self.resync_scan, node)

    # -- scheduler ---------------------------------------------------------------------------------
    def at(self, delay: float, fn, *args) -> None:
        self._seq += 1
        heapq.heappush(self._events, (self.now + delay, self._seq, fn, args))

    def run_until(self, predicate, limit: float) -> bool:
        """Process events until predicate() holds or virtual time passes `limit` (bounded loop)."""
        for _ in range(2_000_000):
            if predicate():
                return True
            if not self._events or self._events[0][0] > limit:
                return predicate()
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        raise AssertionError(f"{self.label}: event budget exhausted")

    # -- processes: run a generator flow with simulated effects --------------------------------------
    def spawn(self, node: Node, flow, done) -> None:
        """Run `flow` on `node`; done(result, error) is called unless the node crashes first. The chunk
        locks the flow takes are released when it ends, before done() (a crash frees them anyway)."""
        epoch = node.epoch
        self._step(node, epoch, flow, done, [], None, None)

    def _step(self, node: Node, epoch: int, flow, done, held: list, value, error) -> None:
        if node.epoch != epoch or not node.up:
            flow.close()
            return
        try:
            effect = flow.throw(error) if error is not None else flow.send(value)
        except StopIteration as stop:
            result = (stop.value, None)
        except ThreeFSError as e:
            result = (None, e)
        else:
            resume = lambda v=None, e=None: self._step(node, epoch, flow, done, held, v, e)  # noqa: E731
            self._perform(node, effect, resume, held)
            return
        for release in held:
            release()
        done(*result)

    def _perform(self, node: Node, e, resume, held: list) -> None:
        store = node.store
        if isinstance(e, craq.ChainView):
            if e.at_least > node.view.version:
                self.learn(node)  # the caller saw newer routing: refresh
            return resume(node.view)
        if isinstance(e, craq.LockChunk):
            return self.with_lock(node, e.chunk_id, lambda release: (held.append(release), resume()))
        if isinstance(e, craq.STORE_EFFECTS):
            try:
                result = craq.apply_to_store(store, e)
            except ThreeFSError as err:
                return resume(None, err)
            if isinstance(e, craq.Commit):
                self.on_commit(self.now, e.chunk_id, store)
            return resume(result)
        if isinstance(e, craq.Forward):
            return self.send(node, e.target_id, e.req, e.payload, resume)
        if isinstance(e, craq.RefreshChain):
            self.learn(node)
            return self.at(self.rng.uniform(0.001, 0.01), resume, self.chain)
        if isinstance(e, craq.ReportDamage):
            # SimStore never damages a copy, so a report is a false alarm of the checks: a bug
            raise AssertionError(f"{self.label}: t={self.now:.3f} target {e.target_id} reported chunk "
                                 f"{e.chunk_id[-1]} damaged ({e.found_by}), and the simulator damages nothing")
        if isinstance(e, craq.Sleep):
            return self.at(e.seconds, resume)
        if isinstance(e, craq.Now):
            return resume(self.now)
        raise AssertionError(f"unknown effect {e!r}")

    # -- network -----------------------------------------------------------------------------------
    def send(self, src: Node, target_id: int, req: ss.UpdateReq, payload, reply) -> None:
        """An update message src -> target; reply(rsp) or reply(None, error) exactly once."""
        state = {"answered": False}

        def answer(rsp=None, err=None):
            if not state["answered"]:
                state["answered"] = True
                reply(rsp, err)

        self.at(CALL_TIMEOUT, answer, None, status_error(StatusCode.TIMEOUT, "simulated timeout"))
        if self.rng.random() < self.drop_p:
            self.faults["request dropped"] += 1
            return  # request lost
        payload = None if payload is None else bytes(payload)
        self.at(self.rng.uniform(0.0005, 0.02), self._deliver, target_id, req, payload, answer)

    def _deliver(self, target_id: int, req: ss.UpdateReq, payload, answer) -> None:
        node = self.nodes[target_id]
        if not node.up:
            return self.at(0.002, answer, None, status_error(StatusCode.UNAVAILABLE, "node down"))

        def respond(rsp, err):
            if self.rng.random() < self.drop_p:
                self.faults["response dropped"] += 1
                return  # response lost: the caller times out
            self.at(self.rng.uniform(0.0005, 0.02), answer, rsp, err)

        self.handle_update(node, req, payload, respond)

    # -- the storage service -------------------------------------------------------------------------
    def handle_update(self, node: Node, req: ss.UpdateReq, payload, respond) -> None:
        """The storage service's update(): craq.serve_update_flow, as StorageService.update runs it."""
        # as the service does: a write's payload crc32c, checked on arrival, goes down the flow with it
        crc = crc32c.crc32c(payload) if req.kind == ss.WRITE else None
        self.spawn(node, craq.serve_update_flow((node.target_id,), req, payload, node.replica, crc), respond)

    def serve_read(self, node: Node, cid: bytes) -> tuple[int, bytes] | None:
        """The storage service's read of a whole chunk (batch_read's checks, craq.read_check, on the
        node's own routing): (committed version, bytes), or None for an error the client retries."""
        if not node.up:
            return None
        public = next((t.public_state for t in node.view.targets if t.target_id == node.target_id), None)
        try:
            craq.read_check(node.target_id, public, node.store.get_meta(cid), allow_uncommitted=False,
                            admin_offline=node.target_id in node.view_offline)
        except ThreeFSError:
            return None  # TARGET_OFFLINE / CHUNK_NOT_COMMIT
        return node.store.read_committed(cid)

    def with_lock(self, node: Node, cid: bytes, body) -> None:
        """FIFO per-chunk lock on a node; a crash frees every lock (new epoch)."""
        epoch = node.epoch
        if not node.up:
            return  # a dead process takes no lock (it would never release it)
        waiters = node.locks.setdefault(cid, [])

        def release():
            if node.epoch != epoch:
                return
            waiters.pop(0)
            if waiters:
                self.at(0, waiters[0])
            else:
                node.locks.pop(cid, None)

        waiters.append(lambda: body(release))
        if len(waiters) == 1:
            self.at(0, waiters[0])

    def kill(self, node: Node) -> None:
        """kill -9: the process and everything in its memory are gone; the store keeps what a crash
        keeps (SimStore.crash)."""
        node.up = False
        node.epoch += 1
        node.store.crash()
        node.locks = {}
        node.replica = craq.ReplicaState()
        node.syncing_to = 0
        node.synced = False
        self.down_since[node.target_id] = self.now

    def restart(self, node: Node) -> None:
        if node.up:
            return  # already restarted (by heal)
        node.up = True
        node.epoch += 1
        self.learn(node)  # a restarted service fetches routing before serving
        self.down_since.pop(node.target_id, None)

    # -- mgmtd: failure detection, the chain state machine, routing propagation --------------------
    def local_state(self, node: Node) -> str:
        """What the storage service reports (StorageService.local_state): see docs/architecture.md."""
        if not node.up:
            return ms.LOCAL_OFFLINE
        chain = node.view if self.report_from_view else self.chain
        public = next(t.public_state for t in chain.targets if t.target_id == node.target_id)
        state = craq.local_state(public)
        # mgmtd's side (MgmtdService._record_targets): a target whose sync_done was accepted is UPTODATE
        return ms.UPTODATE if node.synced and state == ms.ONLINE else state

    def mgmtd_pass(self) -> None:
        self.update_chain()
        self.at(self.PASS_S, self.mgmtd_pass)

    def update_chain(self) -> None:
        """MgmtdService.update_chains: heartbeats' local states (admin-offlined targets count as
        OFFLINE once `admin_offline_effective`, `_local_view`) through the production state machine;
        the new chain is pushed."""
        local = {}
        for t, node in self.nodes.items():
            failed = False
            if node.up:
                self.reported[t] = self.local_state(node)  # a heartbeat, sent with the node's routing
                self.node_routing[t] = node.view_version
            elif self.now - self.down_since.get(t, self.now) >= self.DETECT_S:
                self.reported[t] = ms.LOCAL_OFFLINE  # heartbeat timeout: mgmtd marks the node failed
                failed = True
            local[t] = self.reported.get(t, ms.UPTODATE)  # until then: the last heartbeat's state
            if t in self.admin_offline:
                public = next(x.public_state for x in self.chain.targets if x.target_id == t)
                if admin_offline_effective(public, self.offline_ver[t], not failed, self.node_routing.get(t, 0)):
                    local[t] = ms.LOCAL_OFFLINE
        new = next_chain(self.chain, local)
        if new is not self.chain:
            self.chain = new
            for node in self.nodes.values():
                if node.synced and any(t.target_id == node.target_id and t.public_state != ms.SYNCING
                                       for t in new.targets):
                    node.synced = False  # the sync it finished belonged to that SYNCING period
            self.publish()

    def publish(self) -> None:
        """A new routing version (MgmtdService.commit); it reaches each node after its own delay."""
        self.routing_version += 1
        for node in self.nodes.values():
            if node.up:
                self.at(self.rng.uniform(0.005, 0.1), self._push_view, node, node.epoch)

    def learn(self, node: Node) -> None:
        """The node fetches the current routing."""
        node.view, node.view_offline, node.view_version = self.chain, frozenset(self.admin_offline), \
            self.routing_version

    def set_admin_offline(self, target: int, offline: bool) -> None:
        """MgmtdAdmin.offline_target: commit the override (a new routing version), then a chain update
        at once (which drops the target only once `admin_offline_effective`)."""
        if offline:
            self.admin_offline.add(target)
            self.offline_ver[target] = self.routing_version + 1
        else:
            self.admin_offline.discard(target)
        self.publish()
        self.update_chain()

    def _push_view(self, node: Node, epoch: int) -> None:
        if node.epoch == epoch and node.up:
            self.learn(node)
            self.maybe_resync(node)

    # -- resync ------------------------------------------------------------------------------------
    def resync_scan(self, node: Node) -> None:
        """Resyncer.run: every node looks for a SYNCING successor periodically (never ends)."""
        if node.up:
            self.maybe_resync(node)
        self.at(0.2, self.resync_scan, node)

    def maybe_resync(self, node: Node) -> None:
        if not node.up:
            return  # a dead process starts nothing (a retry timer may fire after a crash)
        job = craq.resync_job(node.view, (node.target_id,))  # as Resyncer.run chooses
        if job is not None and node.syncing_to != job[1]:
            node.syncing_to = job[1]
            self._resync(node, job[1], node.epoch)

    def _resync(self, node: Node, successor: int, epoch: int) -> None:
        """Resyncer.sync: wait for older flows, dump (the successor's metas, read directly: a dump RPC),
        compare and send chunk by chunk, then sync_done."""
        if node.epoch != epoch:
            return
        sync_version = node.view.version
        node.flows.when_quiet_below(sync_version,
                                    lambda: self._resync_quiet(node, successor, epoch, sync_version))

    def _resync_quiet(self, node: Node, successor: int, epoch: int, sync_version: int) -> None:
        if node.epoch != epoch:
            return
        peer = self.nodes[successor]
        if not peer.up:
            node.syncing_to = 0  # the periodic scan tries again
            return
        remote = {m.chunk_id: m for m in peer.store.iter_metas()}
        todo = sorted(set(remote) | {m.chunk_id for m in node.store.iter_metas()})

        def next_chunk(i: int):
            if node.epoch != epoch:
                return
            if i == len(todo):
                node.syncing_to = 0
                # sync_done to mgmtd, which checks it against its chain as MgmtdService.sync_done does
                if sync_done_refusal(self.chain, successor, sync_version) is None:
                    self.nodes[successor].synced = True  # -> UPTODATE -> mgmtd makes it SERVING
                else:
                    self.at(0.1, self.maybe_resync, node)  # refused: the sync starts over
                return
            cid = todo[i]

            def done(_rsp, err):
                if err is not None:
                    node.syncing_to = 0  # retried on the next routing push / pass
                    self.at(0.1, self.maybe_resync, node)
                    return
                next_chunk(i + 1)

            self.spawn(node, craq.resync_locked_flow(node.target_id, successor, CHAIN_ID, cid,
                                                     remote.get(cid)), done)

        next_chunk(0)
