"""A seeded, deterministic simulator of one CRAQ chain (FoundationDB-style simulation testing).

It runs the production CRAQ flows (threefs/storage/craq.py), the production chain state machine
(threefs/mgmtd/chain_state.py) and the production admission/exactly-once/read checks, with everything
around them simulated: virtual time, a network that delays, reorders and drops messages, replicas that
crash (losing pending versions) and restart, a mgmtd that detects failures after a delay and bumps the
chain version, resync of returning replicas, and clients with stale routing that retry.

Checked properties (`Simulation.check()`):
- one content per committed version (replicas never commit different data under one version);
- no acknowledged write is lost: the final version is >= every acknowledged version, and the content
  recorded for an acknowledged version is what the head acknowledged;
- reads are never older than a write acknowledged before the read started (single-chunk
  linearizability in version order), and return exactly the content of the version they report;
- after healing and one final write, all replicas hold identical committed chunks and no pending ones.

    sim = Simulation(seed=7); sim.run(); sim.check()     # a failing seed replays exactly
"""

from __future__ import annotations

import collections
import heapq
import os
import random
from dataclasses import dataclass, field

import crc32c

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.mgmtd.chain_state import (next_chain, offline_refusal, serving_targets, sync_done_refusal,
                                       write_targets)
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.storage import craq
from threefs.testing.sim_store import SimStore

CHUNK_SIZE = 64
CALL_TIMEOUT = 1.0  # virtual seconds before a caller gives up on a message


class Killed(Exception):
    """The process's node crashed: the flow stops where it is."""


@dataclass
class Node:
    target_id: int
    store: SimStore = field(default_factory=SimStore)
    up: bool = True
    epoch: int = 0  # bumped on crash: processes of an older epoch die
    view: ms.ChainInfo | None = None  # this node's (possibly stale) routing
    locks: dict = field(default_factory=dict)  # chunk id -> list of waiting resume callbacks (FIFO)
    replica: craq.ReplicaState = field(default_factory=craq.ReplicaState)  # lost on a crash
    synced: bool = False
    syncing_to: int = 0

    @property
    def flows(self) -> craq.FlowTracker:
        return self.replica.tracker(self.target_id)


class Simulation:
    def __init__(self, seed: int, replicas: int = 3, clients: int = 3, ops_per_client: int = 25,
                 chunks: int = 2, drop_p: float = 0.03, crash_every: float = 1.5, admin_p: float = 0.3,
                 report_from_view: bool = True):
        self.rng = random.Random(seed)
        self.seed = seed
        self.now = 0.0
        self._events: list = []
        self._seq = 0
        ids = [10 + i for i in range(replicas)]
        self.nodes = {t: Node(t) for t in ids}
        self.chain = ms.ChainInfo(1, 1, [ms.ChainTarget(t, ms.SERVING) for t in ids])
        self.down_since: dict[int, float] = {}
        self.chunks = [bytes([0] * 15 + [i]) for i in range(chunks)]
        self.drop_p, self.crash_every = drop_p, crash_every
        # per fault-loop tick: the chance that an admin takes a target offline (it stays alive)
        self.admin_p = admin_p
        self.admin_offline: set[int] = set()  # mgmtd's TargetInfo.admin_offline
        # what a node reports comes from its own (maybe stale) routing, as the service does; False: from
        # mgmtd's chain (the model the seeds before the admin faults were found with: LEGACY)
        self.report_from_view = report_from_view
        self.faults: collections.Counter = collections.Counter()  # kind -> times injected
        self.ops: collections.Counter = collections.Counter()  # client operations started, by kind
        self.clients, self.ops_per_client = clients, ops_per_client
        self.history: dict[tuple[bytes, int], bytes] = {}  # (chunk, version) -> committed content
        self.acked: list[tuple[bytes, int, float, bytes]] = []  # (chunk, version, ack time, content)
        self.reads: list[tuple[bytes, float, int, bytes]] = []  # (chunk, start time, version, content)
        self.violations: list[str] = []
        self.reported: dict[int, str] = {}  # mgmtd's view of each target's local state
        self.stop_faults = False
        for n in self.nodes.values():
            n.view = self.chain

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
        raise AssertionError(f"seed {self.seed}: event budget exhausted")

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
                node.view = self.chain  # the caller saw newer routing: refresh
            return resume(node.view)
        if isinstance(e, craq.LockChunk):
            return self.with_lock(node, e.chunk_id, lambda release: (held.append(release), resume()))
        if isinstance(e, craq.STORE_EFFECTS):
            try:
                result = craq.apply_to_store(store, e)
            except ThreeFSError as err:
                return resume(None, err)
            if isinstance(e, craq.Commit):
                self._record_commit(e.chunk_id, store)
            return resume(result)
        if isinstance(e, craq.Forward):
            return self.send(node, e.target_id, e.req, e.payload, resume)
        if isinstance(e, craq.RefreshChain):
            node.view = self.chain
            return self.at(self.rng.uniform(0.001, 0.01), resume, self.chain)
        if isinstance(e, craq.Sleep):
            return self.at(e.seconds, resume)
        if isinstance(e, craq.Now):
            return resume(self.now)
        raise AssertionError(f"unknown effect {e!r}")

    def _record_commit(self, cid: bytes, store: SimStore) -> None:
        ver, data = store.read_committed(cid)
        if ver == 0:
            return
        seen = self.history.setdefault((cid, ver), data)
        if seen != data:
            self.violations.append(f"t={self.now:.3f} chunk {cid[-1]} version {ver} committed with two "
                                   f"contents: {seen!r} and {data!r}")

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

    def handle_update(self, node: Node, req: ss.UpdateReq, payload, respond) -> None:
        """The storage service's update(): craq.serve_update_flow, as StorageService.update runs it."""
        self.spawn(node, craq.serve_update_flow((node.target_id,), req, payload, node.replica), respond)

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

    # -- mgmtd: failure detection, the chain state machine, routing propagation --------------------
    DETECT_S = 0.3  # heartbeat timeout
    PASS_S = 0.05  # chain state machine period

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
        OFFLINE, `_local_view`) through the production state machine; the new chain is pushed."""
        local = {}
        for t, node in self.nodes.items():
            if node.up:
                self.reported[t] = self.local_state(node)  # a heartbeat
            elif self.now - self.down_since.get(t, self.now) >= self.DETECT_S:
                self.reported[t] = ms.LOCAL_OFFLINE  # heartbeat timeout
            local[t] = self.reported.get(t, ms.UPTODATE)  # until then: the last heartbeat's state
            if t in self.admin_offline:
                local[t] = ms.LOCAL_OFFLINE
        new = next_chain(self.chain, local)
        if new is not self.chain:
            self.chain = new
            for node in self.nodes.values():
                if node.synced and any(t.target_id == node.target_id and t.public_state != ms.SYNCING
                                       for t in new.targets):
                    node.synced = False  # the sync it finished belonged to that SYNCING period
                if node.up:  # routing reaches each node after its own delay
                    self.at(self.rng.uniform(0.005, 0.1), self._push_view, node, node.epoch)

    def _push_view(self, node: Node, epoch: int) -> None:
        if node.epoch == epoch and node.up:
            node.view = self.chain
            self.maybe_resync(node)

    # -- faults ------------------------------------------------------------------------------------
    def fault_loop(self) -> None:
        if self.stop_faults:
            return
        up = [n for n in self.nodes.values() if n.up]
        if len(up) > 1 and self.rng.random() < 0.7:
            self.crash(self.rng.choice(up))
        if self.admin_p and self.rng.random() < self.admin_p:
            self.admin_take_offline()
        self.at(self.rng.expovariate(1 / self.crash_every), self.fault_loop)

    def admin_take_offline(self) -> None:
        """`threefs admin offline-target` (MgmtdAdmin.offline_target, no --force) on a random target,
        usually a live one: mgmtd counts it OFFLINE at once while its process runs on with its old
        routing (it may be forwarding a write or serving a read); put back online a little later."""
        candidates = [t for t in self.nodes if t not in self.admin_offline
                      and offline_refusal(self.chain, t) is None]
        if not candidates:
            return
        target = self.rng.choice(candidates)
        self.admin_offline.add(target)
        self.faults["admin offline"] += 1
        self.update_chain()
        self.at(self.rng.uniform(0.1, 1.5), self.admin_put_online, target)

    def admin_put_online(self, target: int) -> None:
        if target in self.admin_offline:
            self.admin_offline.discard(target)
            self.faults["admin online"] += 1
            self.update_chain()

    def crash(self, node: Node) -> None:
        self.faults["crash"] += 1
        node.up = False
        node.epoch += 1
        node.store.crash()
        node.locks = {}
        node.replica = craq.ReplicaState()
        node.syncing_to = 0
        node.synced = False
        self.down_since[node.target_id] = self.now
        self.at(self.rng.uniform(0.1, 1.5), self.restart, node)

    def restart(self, node: Node) -> None:
        if node.up:
            return  # already restarted (by heal)
        node.up = True
        node.epoch += 1
        node.view = self.chain  # a restarted service fetches routing before serving
        self.down_since.pop(node.target_id, None)

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
        """Resyncer.sync: dump (the successor's metas, read directly: a dump RPC), compare, send."""
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
        remote = {c: peer.store.get_meta(c) for c in self.chunks if peer.store.get_meta(c)}
        todo = sorted(set(remote) | {c for c in self.chunks if node.store.get_meta(c)})

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

            self.spawn(node, craq.resync_locked_flow(node.target_id, successor, 1, cid, remote.get(cid)),
                       done)

        next_chunk(0)

    # -- clients -----------------------------------------------------------------------------------
    def client_loop(self, client: int, op: int, view: ms.ChainInfo) -> None:
        if op >= self.ops_per_client:
            self.clients_done += 1
            return
        cid = self.rng.choice(self.chunks)
        nxt = lambda v=view: self.at(self.rng.uniform(0, 0.05), self.client_loop, client, op + 1, v)  # noqa
        if self.rng.random() < 0.6:
            self.client_write(client, op, cid, view, nxt)
        else:
            self.client_read(cid, view, nxt)

    def client_write(self, client: int, op: int, cid: bytes, view: ms.ChainInfo, nxt) -> None:
        offset = self.rng.randrange(0, CHUNK_SIZE)
        data = self.rng.randbytes(self.rng.randrange(1, CHUNK_SIZE - offset + 1))
        tag = ss.RequestTag(f"client-{client}", op + 1)  # the same tag on every retry (exactly-once)
        self.ops["write"] += 1
        deadline = self.now + 20.0

        def attempt(view: ms.ChainInfo):
            order = write_targets(view)
            if not order:
                return retry(view, None)
            req = ss.UpdateReq(1, view.version, cid, ss.WRITE, offset, len(data), CHUNK_SIZE,
                               crc32c.crc32c(data), tag)
            self.send(self.client_node, order[0], req, data, lambda rsp, err: done(rsp, err))

        def done(rsp, err):
            if err is None:
                content = self.history.get((cid, rsp.commit_ver))
                self.acked.append((cid, rsp.commit_ver, self.now, content))
                return nxt(self.chain)
            retry(view, err)

        def retry(_view, _err):
            if self.now > deadline:
                return nxt(self.chain)  # gave up: this write is not acknowledged
            self.at(self.rng.uniform(0.01, 0.1), attempt, self.chain)  # refresh routing, retry

        attempt(view)

    def client_read(self, cid: bytes, view: ms.ChainInfo, nxt) -> None:
        started = self.now
        self.ops["read"] += 1
        targets = serving_targets(view)
        if not targets:
            return nxt(self.chain)
        node = self.nodes[self.rng.choice(targets)]

        def serve():
            if not node.up:
                return nxt(self.chain)
            public = next((t.public_state for t in node.view.targets if t.target_id == node.target_id), None)
            meta = node.store.get_meta(cid)
            try:
                craq.read_check(node.target_id, public, meta, allow_uncommitted=False)
            except ThreeFSError:
                return nxt(self.chain)  # TARGET_OFFLINE / CHUNK_NOT_COMMIT: the client retries later
            version, content = node.store.read_committed(cid)
            self.reads.append((cid, started, version, content))
            nxt(self.chain)

        self.at(self.rng.uniform(0.0005, 0.02), serve)

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> "Simulation":
        self.client_node = Node(0)  # where client messages come from (never crashes)
        self.clients_done = 0
        self.at(0, self.mgmtd_pass)
        for node in self.nodes.values():
            self.at(0.2, self.resync_scan, node)
        self.at(self.rng.uniform(0.1, 0.5), self.fault_loop)
        for c in range(self.clients):
            self.at(self.rng.uniform(0, 0.05), self.client_loop, c, 0, self.chain)
        self.run_until(lambda: self.clients_done == self.clients, limit=600)
        self.heal()
        return self

    def heal(self) -> None:
        """Stop faults, restart everyone, wait until every target SERVES, then one write per chunk."""
        self.stop_faults = True
        self.drop_p = 0.0
        for node in self.nodes.values():
            if not node.up:
                self.restart(node)
        for target in sorted(self.admin_offline):  # the operator puts every target back
            self.admin_put_online(target)
        all_serving = lambda: all(t.public_state == ms.SERVING for t in self.chain.targets)  # noqa
        if not self.run_until(all_serving, limit=self.now + 120):
            self.violations.append(f"chain did not heal: {self.chain}")
            return
        for cid in self.chunks:
            box = []
            self.client_write(99, 1000 + cid[-1], cid, self.chain, lambda *_: box.append(1))
            self.run_until(lambda: bool(box), limit=self.now + 60)
        self.run_until(lambda: False, limit=self.now + 2)  # let stragglers finish

    # -- checking ------------------------------------------------------------------------------------
    def check(self) -> None:
        problems = list(self.violations)
        for cid in self.chunks:
            final = max((v for (c, v) in self.history if c == cid), default=0)
            for c, ver, _, content in self.acked:
                if c == cid and (ver > final or content is None):
                    problems.append(f"acknowledged write v{ver} of chunk {cid[-1]} is lost")
            problems += self._check_reads(cid)
            states = {(t, n.store.read_committed(cid), cid in n.store.pending) for t, n in self.nodes.items()}
            if len({s[1] for s in states}) != 1 or any(s[2] for s in states):
                problems.append(f"replicas of chunk {cid[-1]} differ after healing: {sorted(states)}")
        if problems:
            raise AssertionError(f"seed {self.seed}: " + "; ".join(problems[:5]))

    def _check_reads(self, cid: bytes) -> list[str]:
        out = []
        acks = sorted((t, v) for c, v, t, _ in self.acked if c == cid)
        for c, started, ver, content in self.reads:
            if c != cid:
                continue
            if ver and self.history.get((cid, ver)) != content:
                out.append(f"read of chunk {cid[-1]} v{ver} returned content never committed as v{ver}")
            newest_acked = max((v for t, v in acks if t < started), default=0)
            if ver < newest_acked:
                out.append(f"stale read of chunk {cid[-1]} at t={started:.3f}: v{ver} < acknowledged "
                           f"v{newest_acked}")
        return out


# -- soak mode: python -m threefs.testing.craq_sim --seeds 100000 [--start N] [--jobs 2] ----------------
def run_seeds(start: int, stop: int, scenario: dict | None = None) -> dict:
    """Run and check seeds [start, stop); totals and the failing seeds with their first problem."""
    totals: dict = {"seeds": 0, "ops": collections.Counter(), "faults": collections.Counter(), "acked": 0,
                    "checked_reads": 0, "virtual_s": 0.0, "failures": []}
    for seed in range(start, stop):
        sim = Simulation(seed, **(scenario or {}))
        try:
            sim.run().check()
        except AssertionError as e:
            totals["failures"].append((seed, str(e)[:500]))
        totals["seeds"] += 1
        totals["ops"].update(sim.ops)
        totals["faults"].update(sim.faults)
        totals["acked"] += len(sim.acked)
        totals["checked_reads"] += len(sim.reads)
        totals["virtual_s"] += sim.now
    return totals


def _run_batch(args):
    return run_seeds(*args)


def soak(seeds: int, start: int = 0, jobs: int = 1, batch: int = 250, scenario: dict | None = None,
         progress=None) -> dict:
    """Run seeds [start, start+seeds) in batches on `jobs` processes; the merged totals."""
    import multiprocessing

    batches = [(b, min(b + batch, start + seeds), scenario) for b in range(start, start + seeds, batch)]
    merged = run_seeds(0, 0)
    pool = multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else None
    try:
        results = pool.imap_unordered(_run_batch, batches) if pool else map(_run_batch, batches)
        for done, part in enumerate(results, 1):
            for key in ("seeds", "acked", "checked_reads", "virtual_s"):
                merged[key] += part[key]
            merged["ops"].update(part["ops"])
            merged["faults"].update(part["faults"])
            merged["failures"].extend(part["failures"])
            if progress is not None:
                progress(done, len(batches), merged)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    merged["failures"].sort()
    return merged


def main(argv=None) -> int:
    import argparse
    import sys
    import time

    parser = argparse.ArgumentParser(prog="python -m threefs.testing.craq_sim",
                                     description="Soak the CRAQ simulator: run and check many seeds.")
    parser.add_argument("--seeds", type=int, default=10_000, help="how many seeds (default 10000)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--batch", type=int, default=250, help="seeds per work unit (default 250)")
    parser.add_argument("--legacy", action="store_true",
                        help="the model before admin faults (crashes only; seeds found then replay)")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1 or args.batch < 1 or args.start < 0:
        parser.error("--seeds, --jobs and --batch must be >= 1, --start >= 0")
    scenario = dict(admin_p=0.0, report_from_view=False) if args.legacy else None
    began, cpu = time.monotonic(), time.process_time()
    step = max(1, (args.seeds // args.batch) // 20)

    def progress(done, total, merged):
        if done % step == 0 or done == total:
            print(f"  {merged['seeds']:>7} seeds  {len(merged['failures'])} failing  "
                  f"{time.monotonic() - began:7.0f} s", file=sys.stderr, flush=True)

    totals = soak(args.seeds, args.start, args.jobs, args.batch, scenario, progress)
    wall = time.monotonic() - began
    ops, faults = totals["ops"], totals["faults"]
    print(f"seeds {args.start}..{args.start + args.seeds - 1}: {totals['seeds']} run on {args.jobs} "
          f"process(es) in {wall:.0f} s ({totals['seeds'] / wall:.0f} seeds/s; load average "
          f"{open('/proc/loadavg').read().split()[0] if os.path.exists('/proc/loadavg') else '?'})")
    print(f"client operations: {sum(ops.values())} ({ops['write']} writes, {ops['read']} reads); "
          f"virtual time {totals['virtual_s']:.0f} s")
    print(f"acknowledged writes: {totals['acked']}; checked reads: {totals['checked_reads']}")
    print("faults: " + ", ".join(f"{kind} {faults[kind]}" for kind in sorted(faults)))
    print(f"failures: {len(totals['failures'])}")
    for seed, problem in totals["failures"][:50]:
        print(f"  {problem}  (replay: Simulation({seed}).run().check())")
    return 1 if totals["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
