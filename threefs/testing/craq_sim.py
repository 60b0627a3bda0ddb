"""The CRAQ simulator's historical entry point: the simulator lives in threefs/testing/sim/ (driver,
scenario, checker, soak); this module keeps `from threefs.testing.craq_sim import Simulation` working and
runs the soak: `python -m threefs.testing.craq_sim --seeds 100000 [--start N] [--jobs 2]`."""

from __future__ import annotations

from threefs.testing.sim import CHUNK_SIZE, LEGACY, Checker, Cluster, Node, Scenario, Simulation
from threefs.testing.sim.soak import main, run_seeds, soak
from threefs.testing.sim_store import SimStore

__all__ = ["CHUNK_SIZE", "LEGACY", "Checker", "Cluster", "Node", "Scenario", "SimStore", "Simulation", "main",
           "run_seeds", "soak"]

if __name__ == "__main__":
    raise SystemExit(main())
