"""Seeded model check: the state machine never lets a target that missed acknowledged writes serve.

A small world around `next_chain`: targets crash and restart, get cut off from mgmtd and come back, writes
are acknowledged only when every target of the write set took them (CRAQ), resyncs finish, and each
storage service reports its local state the way ours does — UPTODATE when its (possibly stale) routing
view says SERVING/LASTSRV, else ONLINE; a finished resync is reported by `sync_done`, on which mgmtd runs a
pass at once with that target UPTODATE. After every event:

  every SERVING or LASTSRV target holds every acknowledged write;
  a SYNCING target always has a SERVING target ahead of it (its resync source).

At the end everything heals and the chain must return to all SERVING (liveness).
"""

from __future__ import annotations

import random

import pytest

from threefs.cluster.routing import write_targets
from threefs.mgmtd.chain_state import next_chain
from threefs.rpc.schemas.mgmtd import (LASTSRV, LOCAL_OFFLINE, ONLINE, SERVING, SYNCING, UPTODATE, ChainInfo,
                                       ChainTarget)

HEAL_ROUNDS_MAX = 12


class World:
    def __init__(self, rng: random.Random, replicas: int):
        self.rng = rng
        ids = list(range(1, replicas + 1))
        self.chain = ChainInfo(1, 1, [ChainTarget(t, SERVING) for t in ids])
        self.alive = dict.fromkeys(ids, True)  # the process runs
        self.cut = dict.fromkeys(ids, False)  # mgmtd cannot hear it (it fences itself: takes no writes)
        self.complete = dict.fromkeys(ids, True)  # holds every acknowledged write
        self.view = dict.fromkeys(ids, SERVING)  # its own, possibly stale, copy of its public state
        self.acked = 0

    def public(self, tid: int) -> str:
        return next(t.public_state for t in self.chain.targets if t.target_id == tid)

    def local(self, tid: int) -> str:
        if not self.alive[tid] or self.cut[tid]:
            return LOCAL_OFFLINE
        return UPTODATE if self.view[tid] in (SERVING, LASTSRV) else ONLINE

    # -- events ----------------------------------------------------------------------------------------
    def kill(self, tid):
        self.alive[tid] = False

    def restart(self, tid):
        self.alive[tid] = True
        self.view[tid] = self.public(tid)  # a starting service registers and fetches fresh routing

    def write(self):
        order = write_targets(self.chain)
        if order and all(self.alive[t] and not self.cut[t] for t in order):
            self.acked += 1
            for t in self.complete:
                if t not in order:
                    self.complete[t] = False

    def sync(self):
        order = write_targets(self.chain)
        for source, target in zip(order, order[1:]):
            if self.public(target) == SYNCING and self.alive[source] and self.alive[target]:
                assert self.complete[source]
                self.complete[target] = True
                local = {t: self.local(t) for t in self.alive}
                local[target] = UPTODATE  # mgmtd's sync_done handler
                self.chain = next_chain(self.chain, local)
                return

    def mgmtd_pass(self):
        local = {t: self.local(t) for t in self.alive}
        self.chain = next_chain(self.chain, local)
        for t in self.alive:
            if self.alive[t] and not self.cut[t] and self.rng.random() < 0.7:  # routing refresh lags
                self.view[t] = self.public(t)

    def check(self):
        for t in self.chain.targets:
            if t.public_state in (SERVING, LASTSRV):
                assert self.complete[t.target_id], f"target {t.target_id} {t.public_state} misses writes"
        states = [t.public_state for t in self.chain.targets]
        if SYNCING in states:
            assert SERVING in states

    def random_event(self):
        tid = self.rng.choice(list(self.alive))
        kind = self.rng.choices(["kill", "restart", "cut", "heal", "write", "sync", "pass"],
                                [1, 1, 1, 1, 4, 2, 4])[0]
        if kind == "kill":
            self.kill(tid)
        elif kind == "restart" and not self.alive[tid]:
            self.restart(tid)
        elif kind in ("cut", "heal"):
            self.cut[tid] = kind == "cut"
        elif kind == "write":
            self.write()
        elif kind == "sync":
            self.sync()
        elif kind == "pass":
            self.mgmtd_pass()


@pytest.mark.parametrize("seed", range(100))
def test_no_target_serves_without_every_acknowledged_write(seed):
    rng = random.Random(seed)
    world = World(rng, replicas=rng.randint(1, 4))
    for _ in range(600):
        world.random_event()
        world.check()
    # heal everything: the chain must get back to fully SERVING
    for t in world.alive:
        if not world.alive[t]:
            world.restart(t)
        world.cut[t] = False
    for _ in range(HEAL_ROUNDS_MAX * len(world.alive)):
        world.mgmtd_pass()
        world.sync()
        world.write()
        world.check()
    assert all(t.public_state == SERVING for t in world.chain.targets), world.chain
    assert world.acked > 0
