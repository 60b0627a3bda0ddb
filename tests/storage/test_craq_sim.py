"""The CRAQ flows under the seeded simulator: crashes, live targets taken offline and back online by an
admin, lost/reordered messages, stale routing, resync.

CI runs 2,500 seeds (~35 s of one core); THREEFS_SIM_SEEDS=N runs another count, and the soak is
`python -m threefs.testing.craq_sim --seeds 100000 --jobs 2` (threefs/testing/sim/soak.py). A failing seed
is named in the assertion and replays exactly: `Simulation(seed).run().check()`.
"""

from __future__ import annotations

import inspect
import os

import pytest

from threefs.cluster.routing import write_targets
from threefs.common.status import StatusCode, status_error
from threefs.storage import craq
from threefs.testing import craq_sim
from threefs.testing.craq_sim import LEGACY, Simulation
from threefs.testing.sim import driver

SEEDS = int(os.environ.get("THREEFS_SIM_SEEDS", "2500"))
BATCHES = 10


@pytest.mark.parametrize("batch", range(BATCHES))
def test_no_lost_write_no_stale_read_replicas_converge(batch):
    seeds = range(batch * SEEDS // BATCHES, (batch + 1) * SEEDS // BATCHES)
    faults, acked = {}, 0
    for seed in seeds:
        sim = Simulation(seed).run()
        sim.check()
        acked += len(sim.acked)
        for kind, n in sim.faults.items():
            faults[kind] = faults.get(kind, 0) + n
    assert acked > 20 * len(seeds), "the simulation must exercise writes"
    assert faults["crash"] > len(seeds) and faults["admin offline"] > len(seeds) // 2, faults


def test_a_seed_replays_exactly():
    a, b = Simulation(1234).run(), Simulation(1234).run()
    assert a.acked == b.acked and a.reads == b.reads and a.history == b.history and a.now == b.now


def test_the_checker_catches_a_replica_that_forgets_pending_versions(monkeypatch):
    """Sensitivity: with pending versions dropped on restart (the engine's behaviour before it logged
    them), some seeds lose a version that was committed further down the chain."""
    original = craq_sim.SimStore.__init__
    monkeypatch.setattr(craq_sim.SimStore, "__init__", lambda self: original(self, durable_pending=False))
    assert failing_seeds(range(300), **LEGACY)


def failing_seeds(seeds, **scenario) -> list[int]:
    failed = []
    for seed in seeds:
        try:
            Simulation(seed, **scenario).run().check()
        except AssertionError:
            failed.append(seed)
    return failed


# Seeds that failed once, each kept with the cause it found (they replay exactly), with the scenario
# they were found under.
LEGACY_REGRESSION_SEEDS = {
    # Stale read: a resync started while the target was SYNCING at chain v3; the target then went OFFLINE
    # (a write was acknowledged without it) and SYNCING again, and the old resync's sync_done made it
    # SERVING without that write. mgmtd now refuses a sync_done whose chain version is not current.
    3568: "stale sync_done",
    # Never healed: a resync retry timer fired on a crashed node, which took a chunk lock in its dead
    # epoch that no one could release, so every later resync of that chunk waited forever (a simulator
    # bug: a dead process starts nothing and takes no lock).
    2845: "lock taken by a dead process",
    4799: "lock taken by a dead process",
    5624: "lock taken by a dead process",
}


REGRESSION_SEEDS = {  # found with live targets taken offline and back online by an admin
    # Two contents under one version: the head took a write at chain v1 and forwarded it; while the
    # forward timed out an admin took the head offline, the chain committed another write as v1, and the
    # admin put the target back: the old flow refreshed its routing, saw itself SYNCING (the last of the
    # write order) and committed its stale pending v1 "as the tail". A forwarder that comes back as
    # SYNCING was dropped meanwhile: the update fails (craq.forward_flow).
    760: "forwarder dropped and back as SYNCING commits as the tail",
    106: "forwarder dropped and back as SYNCING commits as the tail",
    # Stale read: a target resyncing its successor was taken offline by an admin and kept running its
    # resync; the successor, SERVING by then, took its full-chunk replace of v3 over the committed v5.
    # A successor now accepts updates only from its predecessor in the chain, and a resync write only
    # while SYNCING (craq.admit).
    464: "resync from a target that left the chain",
}


@pytest.mark.parametrize("seed", sorted(LEGACY_REGRESSION_SEEDS))
def test_legacy_regression_seed(seed):
    Simulation(seed, **LEGACY).run().check()


@pytest.mark.parametrize("seed", sorted(REGRESSION_SEEDS))
def test_regression_seed(seed):
    Simulation(seed).run().check()


def test_the_checker_catches_a_stale_sync_done(monkeypatch):
    """Sensitivity: with mgmtd accepting every sync_done (the protocol before the fix), seed 3568 reads
    a version older than one acknowledged before the read started."""
    monkeypatch.setattr(driver, "sync_done_refusal", lambda *args: None)
    with pytest.raises(AssertionError, match="stale read"):
        Simulation(3568, **LEGACY).run().check()


def patched_forward_flow(monkeypatch, *replacements: tuple[str, str]) -> None:
    """craq.forward_flow with lines of its source replaced (an earlier version of the protocol)."""
    source = inspect.getsource(craq.forward_flow)
    for old, new in replacements:
        assert old in source, "forward_flow changed: update this sensitivity test"
        source = source.replace(old, new)
    namespace = dict(vars(craq))
    exec(source, namespace)
    monkeypatch.setattr(craq, "forward_flow", namespace["forward_flow"])


DROPPED_CHECK = "if me not in order or (_state_of(chain, me) == ms.SYNCING and started_as != ms.SYNCING):"


def test_admin_offline_catches_the_forwarder_that_commits_as_tail(monkeypatch):
    """Sensitivity: the bug of commit 8bffb8a (a forwarder dropped from the chain committed as if it were
    the tail) passes every seed with crashes only, and fails seeds once live targets go offline."""
    patched_forward_flow(monkeypatch, (DROPPED_CHECK, "if False:"),
                         ("if order.index(me) + 1 >= len(order):",
                          "if me not in order or order.index(me) + 1 >= len(order):"))
    assert not failing_seeds(range(40), **LEGACY)  # how it hid
    assert failing_seeds(range(10))


def test_the_checker_catches_a_forwarder_back_as_syncing(monkeypatch):
    """Sensitivity: without the SYNCING half of the dropped-forwarder check, seed 760 commits two
    contents under one version."""
    patched_forward_flow(monkeypatch, (DROPPED_CHECK, "if me not in order:"))
    with pytest.raises(AssertionError, match="committed with two contents"):
        Simulation(760).run().check()


def test_the_checker_catches_a_resync_from_a_target_that_left(monkeypatch):
    """Sensitivity: with successors accepting updates from any target (admission before the fix),
    seed 464 reads a version older than an acknowledged one."""
    def admit_without_predecessor_check(me, chain, req):
        order = write_targets(chain)
        if me not in order:
            raise status_error(StatusCode.TARGET_OFFLINE, "not writable")
        if req.from_target == 0 and order[0] != me:
            raise status_error(StatusCode.NOT_HEAD, "not the head")

    monkeypatch.setattr(craq, "admit", admit_without_predecessor_check)
    with pytest.raises(AssertionError, match="stale read"):
        Simulation(464).run().check()


@pytest.mark.xfail(strict=True, reason="known gap: an admin-offlined live target serves reads on its stale "
                   "routing while the chain acknowledges writes without it (docs/storage.md, Simulation)")
def test_a_live_target_taken_offline_serves_no_stale_read():
    """Found while adding the admin faults, by hand (the random clients refresh their routing after every
    operation, so they rarely read with routing as stale as this): the tail is taken offline, a client
    with fresh routing writes v2 through the new chain (acknowledged ~40 ms later), and the old tail,
    whose routing has not arrived yet, still serves v1 to a client whose routing lists it. The real
    service has the same window (up to a heartbeat interval: a storage node learns routing from its
    heartbeats; a failed node is fenced, an admin-offlined one is not). A fix must keep the chain from
    acknowledging writes without the target until the target has seen that it is offline."""
    import crc32c

    from threefs.rpc.schemas import storage as ss

    sim = Simulation(1, drop_p=0.0)
    cluster, cid = sim.cluster, sim.scenario.chunks[0]
    cluster.start()

    def write(data: bytes, tag: int):
        box = []
        head = write_targets(cluster.chain)[0]
        req = ss.UpdateReq(1, cluster.chain.version, cid, ss.WRITE, 0, len(data), 64, crc32c.crc32c(data),
                           ss.RequestTag("writer", tag))
        cluster.send(cluster.client_node, head, req, data, lambda rsp, err: box.append((rsp, err)))
        assert cluster.run_until(lambda: bool(box), cluster.now + 5) and box[0][1] is None
        return box[0][0].commit_ver

    assert write(b"one", 1) == 1
    tail = cluster.nodes[write_targets(cluster.chain)[-1]]
    cluster.set_admin_offline(tail.target_id, True)
    assert write(b"two", 2) == 2
    read = cluster.serve_read(tail, cid)
    assert read is None or read[0] >= 2, f"target {tail.target_id} served v{read[0]} after v2 was acknowledged"


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="the known gap above, found by the random "
                   "soak once in 100,000 seeds: target 12 taken offline at t=6.385, v15 acknowledged without "
                   "it at 6.428, read from it (routing still v15) at 6.450 -> v14")
def test_known_gap_seed_98733():
    Simulation(98733).run().check()
