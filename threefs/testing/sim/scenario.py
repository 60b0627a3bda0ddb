"""What happens to the simulated cluster, and when: faults and clients.

Faults, from one loop at exponential intervals (mean `crash_every` virtual seconds): a crash of a live
node (kill -9; it restarts 0.1-1.5 s later), and with probability `admin_p` per tick an admin taking a
target offline (`threefs admin offline-target`, no --force: the last SERVING target is refused) and
putting it back 0.1-1.5 s later; the network drops `drop_p` of messages (driver). Clients: `clients`
loops of `ops_per_client` operations, 60% writes of random extents (retried with the same request tag
for up to 20 s after a refresh of their routing) and 40% whole-chunk reads from a SERVING target of
their (possibly stale) routing. Then `heal`: faults stop, everyone restarts and comes back online, the
chain must reach all-SERVING, and one more write per chunk lets the replicas converge.
"""

from __future__ import annotations

import collections
import random

from threefs.cluster.routing import serving_targets, write_targets
from threefs.common import crc32c
from threefs.mgmtd.chain_state import offline_refusal
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.testing.sim.checker import Checker
from threefs.testing.sim.driver import CHAIN_ID, Cluster, Node

CHUNK_SIZE = 64


class Scenario:
    def __init__(self, cluster: Cluster, checker: Checker, rng: random.Random, clients: int = 3,
                 ops_per_client: int = 25, chunks: int = 2, crash_every: float = 1.5,
                 admin_p: float = 0.3) -> None:
        self.cluster, self.checker, self.rng = cluster, checker, rng
        self.clients, self.ops_per_client = clients, ops_per_client
        self.chunks = [bytes([0] * 15 + [i]) for i in range(chunks)]
        self.crash_every = crash_every
        self.admin_p = admin_p  # per fault-loop tick: the chance that an admin takes a target offline
        self.ops: collections.Counter = collections.Counter()  # client operations started, by kind
        self.stop_faults = False
        self.clients_done = 0

    # -- faults ------------------------------------------------------------------------------------
    def fault_loop(self) -> None:
        if self.stop_faults:
            return
        up = [n for n in self.cluster.nodes.values() if n.up]
        if len(up) > 1 and self.rng.random() < 0.7:
            self.crash(self.rng.choice(up))
        if self.admin_p and self.rng.random() < self.admin_p:
            self.admin_take_offline()
        self.cluster.at(self.rng.expovariate(1 / self.crash_every), self.fault_loop)

    def crash(self, node: Node) -> None:
        self.cluster.faults["crash"] += 1
        self.cluster.kill(node)
        self.cluster.at(self.rng.uniform(0.1, 1.5), self.cluster.restart, node)

    def admin_take_offline(self) -> None:
        """`threefs admin offline-target` (MgmtdAdmin.offline_target, no --force) on a random target,
        usually a live one: mgmtd counts it OFFLINE once its node has seen that (or is failed), while
        its process runs on with its old routing meanwhile (it may be forwarding a write or serving a
        read); put back online a little later."""
        c = self.cluster
        candidates = [t for t in c.nodes
                      if t not in c.admin_offline and offline_refusal(c.chain, t, c.admin_offline) is None]
        if not candidates:
            return
        target = self.rng.choice(candidates)
        c.faults["admin offline"] += 1
        c.set_admin_offline(target, True)
        c.at(self.rng.uniform(0.1, 1.5), self.admin_put_online, target)

    def admin_put_online(self, target: int) -> None:
        if target in self.cluster.admin_offline:
            self.cluster.faults["admin online"] += 1
            self.cluster.set_admin_offline(target, False)

    # -- clients -----------------------------------------------------------------------------------
    def client_loop(self, client: int, op: int, view: ms.ChainInfo) -> None:
        c = self.cluster
        if op >= self.ops_per_client:
            self.clients_done += 1
            return
        cid = self.rng.choice(self.chunks)
        nxt = lambda v=view: c.at(self.rng.uniform(0, 0.05), self.client_loop, client, op + 1, v)  # noqa
        if self.rng.random() < 0.6:
            self.client_write(client, op, cid, view, nxt)
        else:
            self.client_read(cid, view, nxt)

    def client_write(self, client: int, op: int, cid: bytes, view: ms.ChainInfo, nxt) -> None:
        c = self.cluster
        offset = self.rng.randrange(0, CHUNK_SIZE)
        data = self.rng.randbytes(self.rng.randrange(1, CHUNK_SIZE - offset + 1))
        tag = ss.RequestTag(f"client-{client}", op + 1)  # the same tag on every retry (exactly-once)
        self.ops["write"] += 1
        deadline = c.now + 20.0

        def attempt(view: ms.ChainInfo):
            order = write_targets(view)
            if not order:
                return retry(view, None)
            req = ss.UpdateReq(CHAIN_ID, view.version, cid, ss.WRITE, offset, len(data), CHUNK_SIZE,
                               crc32c.crc32c(data), tag)
            c.send(c.client_node, order[0], req, data, lambda rsp, err: done(rsp, err))

        def done(rsp, err):
            if err is None:
                self.checker.ack(cid, rsp.commit_ver, c.now)
                return nxt(c.chain)
            retry(view, err)

        def retry(_view, _err):
            if c.now > deadline:
                return nxt(c.chain)  # gave up: this write is not acknowledged
            c.at(self.rng.uniform(0.01, 0.1), attempt, c.chain)  # refresh routing, retry

        attempt(view)

    def client_read(self, cid: bytes, view: ms.ChainInfo, nxt) -> None:
        c = self.cluster
        started = c.now
        self.ops["read"] += 1
        targets = serving_targets(view)
        if not targets:
            return nxt(c.chain)
        node = c.nodes[self.rng.choice(targets)]

        def serve():
            result = c.serve_read(node, cid)
            if result is not None:  # else TARGET_OFFLINE / CHUNK_NOT_COMMIT: the client retries later
                self.checker.read(cid, started, *result)
            nxt(c.chain)

        c.at(self.rng.uniform(0.0005, 0.02), serve)

    # -- the run -----------------------------------------------------------------------------------
    def run(self) -> None:
        c = self.cluster
        c.start()
        c.at(self.rng.uniform(0.1, 0.5), self.fault_loop)
        for client in range(self.clients):
            c.at(self.rng.uniform(0, 0.05), self.client_loop, client, 0, c.chain)
        c.run_until(lambda: self.clients_done == self.clients, limit=600)
        self.heal()

    def heal(self) -> None:
        """Stop faults, restart everyone, wait until every target SERVES, then one write per chunk."""
        c = self.cluster
        self.stop_faults = True
        c.drop_p = 0.0
        for node in c.nodes.values():
            if not node.up:
                c.restart(node)
        for target in sorted(c.admin_offline):  # the operator puts every target back
            self.admin_put_online(target)
        all_serving = lambda: all(t.public_state == ms.SERVING for t in c.chain.targets)  # noqa
        if not c.run_until(all_serving, limit=c.now + 120):
            self.checker.fail(f"chain did not heal: {c.chain}")
            return
        for cid in self.chunks:
            box = []
            self.client_write(99, 1000 + cid[-1], cid, c.chain, lambda *_: box.append(1))
            c.run_until(lambda: bool(box), limit=c.now + 60)
        c.run_until(lambda: False, limit=c.now + 2)  # let stragglers finish
