"""A seeded, deterministic simulator of one CRAQ chain (FoundationDB-style simulation testing).

It runs the production CRAQ code (threefs/storage/craq.py: the update and resync flows and the glue
around them), the production chain state machine (threefs/mgmtd/chain_state.py) and the production
admission, exactly-once and read checks, with everything around them simulated. Three parts:

- driver.py: the simulated cluster (virtual time, network, storage processes on SimStore, mgmtd, resync);
- scenario.py: what happens to it (crashes, admin offline/online of live targets, clients);
- checker.py: what must hold (no lost acknowledged write, no stale read, one content per version,
  replicas converge);

and soak.py runs many seeds (`python -m threefs.testing.craq_sim --seeds 100000 --jobs 2`).

    sim = Simulation(seed=7); sim.run(); sim.check()     # a failing seed replays exactly
"""

from __future__ import annotations

import random

from threefs.testing.sim.checker import Checker
from threefs.testing.sim.driver import Cluster, Node
from threefs.testing.sim.scenario import CHUNK_SIZE, Scenario

# The model the seeds found before the admin faults were added ran under: crashes only, local states
# from mgmtd's chain. `Simulation(seed, **LEGACY)` replays them exactly.
LEGACY = dict(admin_p=0.0, report_from_view=False)


class Simulation:
    def __init__(self, seed: int, replicas: int = 3, clients: int = 3, ops_per_client: int = 25,
                 chunks: int = 2, drop_p: float = 0.03, crash_every: float = 1.5, admin_p: float = 0.3,
                 report_from_view: bool = True):
        self.seed = seed
        self.rng = random.Random(seed)
        self.checker = Checker()
        self.cluster = Cluster(self.rng, replicas, drop_p, report_from_view, self.checker.record_commit,
                               label=f"seed {seed}")
        self.scenario = Scenario(self.cluster, self.checker, self.rng, clients, ops_per_client, chunks,
                                 crash_every, admin_p)

    def run(self) -> "Simulation":
        self.scenario.run()
        return self

    def check(self) -> None:
        self.checker.check(f"seed {self.seed}", self.cluster.nodes, self.scenario.chunks)

    # what tests and the soak read
    now = property(lambda self: self.cluster.now)
    nodes = property(lambda self: self.cluster.nodes)
    chain = property(lambda self: self.cluster.chain)
    faults = property(lambda self: self.cluster.faults)
    ops = property(lambda self: self.scenario.ops)
    acked = property(lambda self: self.checker.acked)
    reads = property(lambda self: self.checker.reads)
    history = property(lambda self: self.checker.history)


__all__ = ["CHUNK_SIZE", "LEGACY", "Checker", "Cluster", "Node", "Scenario", "Simulation"]
