"""The chain/target state machine: one table case per transition, then seeded random sequences.

Cases are data (h11 style): chain before as "id:STATE ...", local states as "id:LOCAL ...", chain after.
Every (public state, local state, rule) of `TRANSITIONS`, and the joint LASTSRV rule, must be exercised by
some case: `test_every_transition_has_a_case` fails when a rule is added without one.
"""

from __future__ import annotations

import random

import pytest

from threefs.cluster.routing import serving_targets, write_targets
from threefs.mgmtd.chain_state import ORDER, TRANSITIONS, TransitionError, next_chain, rotate_lastsrv
from threefs.rpc.schemas.mgmtd import (LASTSRV, LOCAL_OFFLINE, LOCAL_STATES, OFFLINE, ONLINE, PUBLIC_STATES,
                                       SERVING, SYNCING, UPTODATE, WAITING, ChainInfo, ChainTarget)

SHORT = {"S": SERVING, "L": LASTSRV, "Y": SYNCING, "W": WAITING, "O": OFFLINE}
LOCAL = {"U": UPTODATE, "N": ONLINE, "X": LOCAL_OFFLINE}


def chain(spec: str, version: int = 5) -> ChainInfo:
    """'1S 2Y 3O' -> chain 7 with target 1 SERVING, 2 SYNCING, 3 OFFLINE (head first)."""
    return ChainInfo(7, version, [ChainTarget(int(x[:-1]), SHORT[x[-1]]) for x in spec.split()])


def locals_(spec: str) -> dict[int, str]:
    return {int(x[:-1]): LOCAL[x[-1]] for x in spec.split()}


def show(c: ChainInfo) -> str:
    inverse = {v: k for k, v in SHORT.items()}
    return " ".join(f"{t.target_id}{inverse[t.public_state]}" for t in c.targets)


# (name, chain before, local states, chain after). The name says which rule the first target exercises.
CASES = [
    # SERVING
    ("SERVING+UPTODATE stays", "1S 2S", "1U 2U", "1S 2S"),
    ("SERVING+ONLINE stays", "1S 2S", "1N 2U", "1S 2S"),
    ("first dead SERVING, none left: LASTSRV", "1S 2O", "1X 2X", "1L 2O"),
    ("second dead SERVING: OFFLINE (only one LASTSRV)", "1S 2S", "1X 2X", "1L 2O"),
    ("dead SERVING while another serves: OFFLINE, moved to the end", "1S 2S 3O", "1X 2U 3X", "2S 3O 1O"),
    ("dead head, SYNCING finishes in the same pass: no LASTSRV", "1S 2Y", "1X 2U", "2S 1O"),
    # LASTSRV
    ("LASTSRV back UPTODATE, none SERVING: SERVING", "1L 2O", "1U 2X", "1S 2O"),
    ("LASTSRV back ONLINE, none SERVING: SERVING", "1L 2O", "1N 2X", "1S 2O"),
    ("LASTSRV alive but another SERVING: OFFLINE", "2S 1L", "1N 2U", "2S 1O"),
    ("LASTSRV UPTODATE but another SERVING: OFFLINE", "2S 1L", "1U 2U", "2S 1O"),
    ("LASTSRV still dead, none SERVING: waits", "1L 2W", "1X 2N", "1L 2W"),
    ("LASTSRV dead, another SERVING: OFFLINE", "2S 1L", "1X 2U", "2S 1O"),
    ("two LASTSRV: the first alive one serves, the rest go OFFLINE", "1L 2L", "1X 2N", "2S 1O"),
    # SYNCING
    ("SYNCING+UPTODATE (sync done): SERVING", "1S 2Y", "1U 2U", "1S 2S"),
    ("SYNCING+ONLINE with a SERVING: keeps syncing", "1S 2Y", "1U 2N", "1S 2Y"),
    ("SYNCING+ONLINE, its source died: WAITING", "1S 2Y", "1X 2N", "1L 2W"),
    ("SYNCING dies: OFFLINE", "1S 2Y", "1U 2X", "1S 2O"),
    # WAITING
    ("WAITING+ONLINE, a SERVING and no SYNCING: SYNCING", "1S 2W", "1U 2N", "1S 2Y"),
    ("WAITING+ONLINE but one already SYNCING: WAITING", "1S 2Y 3W", "1U 2N 3N", "1S 2Y 3W"),
    ("WAITING+ONLINE, nothing SERVING: WAITING", "1L 2W", "1X 2N", "1L 2W"),
    ("WAITING+UPTODATE is never trusted: WAITING", "1S 2W", "1U 2U", "1S 2W"),
    ("WAITING dies: OFFLINE", "1S 2W", "1U 2X", "1S 2O"),
    # OFFLINE
    ("OFFLINE+ONLINE, a SERVING and no SYNCING: SYNCING", "1S 2O", "1U 2N", "1S 2Y"),
    ("OFFLINE+ONLINE but one already SYNCING: WAITING", "1S 2Y 3O", "1U 2N 3N", "1S 2Y 3W"),
    ("OFFLINE+ONLINE, nothing SERVING: WAITING", "1L 2O", "1X 2N", "1L 2W"),
    ("OFFLINE+UPTODATE: WAITING", "1S 2O", "1U 2U", "1S 2W"),
    ("OFFLINE stays dead: OFFLINE", "1S 2O", "1U 2X", "1S 2O"),
    # ordering and priority between groups
    ("WAITING gets the SYNCING slot before an earlier OFFLINE", "1S 3O 2W", "1U 2N 3N", "1S 2Y 3W"),
    ("missing local state counts as OFFLINE", "1S 2S", "1U", "1S 2O"),
    ("single-target chain: dead -> LASTSRV -> back", "1S", "1X", "1L"),
]


@pytest.mark.parametrize("name,before,local,after", CASES, ids=[c[0] for c in CASES])
def test_transition(name, before, local, after):
    old = chain(before)
    new = next_chain(old, locals_(local))
    assert show(new) == after
    if after == before:
        assert new is old  # unchanged: same object, same version
    else:
        assert new.version == old.version + 1


def test_every_transition_has_a_case():
    covered = set()
    for _, before, local, _ in CASES:
        trace = []
        next_chain(chain(before), locals_(local), trace)
        covered.update((s.public, s.local, s.rule_index) for s in trace)
    rules = {(p, loc, i) for (p, loc), row in TRANSITIONS.items() for i in range(len(row))}
    rules.add((LASTSRV, "", -1))  # the joint rule
    assert rules - covered == set(), "transitions without a table case"


def test_table_is_total_and_ends_in_a_fallback():
    assert set(TRANSITIONS) == {(p, loc) for p in PUBLIC_STATES for loc in LOCAL_STATES}
    for row in TRANSITIONS.values():
        assert row[-1][0].__name__ == "ALWAYS"


def test_unknown_states_are_refused():
    with pytest.raises(TransitionError, match="local state 'BOGUS'"):
        next_chain(chain("1S 2S"), {1: "BOGUS", 2: UPTODATE})
    with pytest.raises(TransitionError, match="unknown public state"):
        next_chain(ChainInfo(7, 1, [ChainTarget(1, "BROKEN")]), {1: UPTODATE})


# -- admin override -------------------------------------------------------------------------------------
def test_rotate_lastsrv():
    c = chain("1L 2O 3W")
    r = rotate_lastsrv(c)
    assert show(r) == "2L 3O 1O" and r.version == c.version + 1
    # the new LASTSRV serves as soon as it is alive, the others resync from it
    r = next_chain(r, locals_("1X 2N 3N"))
    assert show(r) == "2S 3Y 1O"


@pytest.mark.parametrize("spec", ["1S 2O", "1L", "1O 2O"])
def test_rotate_lastsrv_refuses_without_a_lastsrv_head(spec):
    with pytest.raises(TransitionError, match="no LASTSRV head"):
        rotate_lastsrv(chain(spec))


def test_read_and_write_sets():
    c = chain("1S 2S 3Y 4W")
    assert serving_targets(c) == [1, 2] and write_targets(c) == [1, 2, 3]


# -- seeded random sequences ----------------------------------------------------------------------------
def random_chain(rng: random.Random) -> ChainInfo:
    """A chain the machine could have produced: sorted, <= 1 SYNCING, no LASTSRV beside a SERVING."""
    states = [rng.choice(PUBLIC_STATES) for _ in range(rng.randint(1, 4))]
    syncing = [i for i, s in enumerate(states) if s == SYNCING]
    for i in syncing[1:]:
        states[i] = WAITING
    if SERVING in states:
        states = [OFFLINE if s == LASTSRV else s for s in states]
    states.sort(key=ORDER.get)
    return ChainInfo(1, 1, [ChainTarget(10 + i, s) for i, s in enumerate(states)])


def check_pass(old: ChainInfo, local: dict[int, str], new: ChainInfo) -> None:
    states = [t.public_state for t in new.targets]
    assert sorted(t.target_id for t in new.targets) == sorted(t.target_id for t in old.targets)
    assert states.count(SYNCING) <= 1
    assert [ORDER[s] for s in states] == sorted(ORDER[s] for s in states)
    assert not (SERVING in states and LASTSRV in states)
    changed = new.targets != old.targets
    assert (new.version == old.version + 1) if changed else (new is old)
    before = {t.target_id: t.public_state for t in old.targets}
    after = {t.target_id: t.public_state for t in new.targets}
    alive = {tid for tid, s in local.items() if s in (ONLINE, UPTODATE)}
    if any(before[t] == SERVING and t in alive for t in before):
        assert SERVING in states, "lost the last SERVING target while an up-to-date one is alive"
    for tid, state in after.items():
        if before[tid] == SERVING and tid in alive:
            assert state == SERVING
        if state == SERVING:
            assert before[tid] in (SERVING, LASTSRV) or (before[tid] == SYNCING and local.get(tid) == UPTODATE)
        if state == SYNCING and before[tid] != SYNCING:
            assert local.get(tid) == ONLINE and before[tid] in (WAITING, OFFLINE)


@pytest.mark.parametrize("seed", range(20))
def test_random_passes_keep_the_invariants(seed):
    rng = random.Random(seed)
    for _ in range(300):
        c = random_chain(rng)
        for _ in range(rng.randint(1, 6)):
            local = {t.target_id: rng.choice(LOCAL_STATES) for t in c.targets if rng.random() < 0.95}
            new = next_chain(c, local)
            check_pass(c, local, new)
            c = new


@pytest.mark.parametrize("seed", range(20))
def test_fixed_local_states_reach_a_fixed_point(seed):
    """With nothing changing underneath, the machine settles within a few passes (no flapping)."""
    rng = random.Random(1000 + seed)
    for _ in range(200):
        c = random_chain(rng)
        local = {t.target_id: rng.choice(LOCAL_STATES) for t in c.targets}
        for _ in range(4):
            c = next_chain(c, local)
        assert next_chain(c, local) is c
