"""The chain / target state machine (3FS `updateChain.cc::generateNewChain`), as data plus a tiny interpreter.

Everything that decides a target's public state lives in this file (h11's rule): mgmtd's service only feeds
it the chain and the local states reported by heartbeats, and persists what comes out. No IO, no clock.

Public states: SERVING (read + write), LASTSRV (was the last SERVING, holds the newest data), SYNCING (write
only, catching up), WAITING, OFFLINE. Local states (reported by the storage service that hosts the target):
UPTODATE, ONLINE, OFFLINE; "alive" = ONLINE or UPTODATE.

One pass (`next_chain`) visits the targets grouped by their current public state, in the order SERVING,
LASTSRV, SYNCING, WAITING, OFFLINE (chain order inside a group), and gives each the first new state of its
`TRANSITIONS` row whose condition holds *on the chain built so far in this pass*. Then one joint rule: if the
new chain has a SERVING target, every LASTSRV becomes OFFLINE (appended at the very end). The new chain is
ordered SERVING < LASTSRV < SYNCING < WAITING < OFFLINE, each group in the order its targets were decided;
its version is bumped iff anything (a state or the order) changed. At most one target per chain is SYNCING.

Admin overrides (3FS `admin_cli`): `rotate_lastsrv` gives up on a LASTSRV head that will not come back.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from typing import NamedTuple

from threefs.rpc.schemas.mgmtd import (
    LASTSRV,
    LOCAL_OFFLINE,
    LOCAL_STATES,
    OFFLINE,
    ONLINE,
    PUBLIC_STATES,
    SERVING,
    SYNCING,
    UPTODATE,
    WAITING,
    ChainInfo,
    ChainTarget,
)

# A condition looks at the new states given so far in this pass: {public state: [target ids]}.
Condition = Callable[[Mapping[str, list[int]]], bool]


def ALWAYS(new: Mapping[str, list[int]]) -> bool:
    return True


def NO_LASTSRV_YET(new: Mapping[str, list[int]]) -> bool:
    """Only the first SERVING target that dies becomes LASTSRV (the chain then waits for it)."""
    return not new[LASTSRV]


def NO_SERVING(new: Mapping[str, list[int]]) -> bool:
    return not new[SERVING]


def HAS_SERVING(new: Mapping[str, list[int]]) -> bool:
    return bool(new[SERVING])


def HAS_SERVING_NO_SYNCING(new: Mapping[str, list[int]]) -> bool:
    """A target may start syncing only from a SERVING predecessor, and only one at a time."""
    return bool(new[SERVING]) and not new[SYNCING]


_WAITING_OR_OFFLINE = {
    ONLINE: ((HAS_SERVING_NO_SYNCING, SYNCING), (ALWAYS, WAITING)),
    UPTODATE: ((ALWAYS, WAITING),),  # claims to be up to date while not serving: never trusted directly
    LOCAL_OFFLINE: ((ALWAYS, OFFLINE),),
}

# (current public state, local state) -> ((condition, new public state), ...): the first that holds wins.
TRANSITIONS: dict[tuple[str, str], tuple[tuple[Condition, str], ...]] = {
    (SERVING, UPTODATE): ((ALWAYS, SERVING),),
    (SERVING, ONLINE): ((ALWAYS, SERVING),),
    (SERVING, LOCAL_OFFLINE): ((NO_LASTSRV_YET, LASTSRV), (ALWAYS, OFFLINE)),
    (LASTSRV, UPTODATE): ((NO_SERVING, SERVING), (ALWAYS, OFFLINE)),
    (LASTSRV, ONLINE): ((NO_SERVING, SERVING), (ALWAYS, OFFLINE)),
    (LASTSRV, LOCAL_OFFLINE): ((NO_SERVING, LASTSRV), (ALWAYS, OFFLINE)),
    (SYNCING, UPTODATE): ((ALWAYS, SERVING),),  # sync done
    (SYNCING, ONLINE): ((HAS_SERVING, SYNCING), (ALWAYS, WAITING)),
    (SYNCING, LOCAL_OFFLINE): ((ALWAYS, OFFLINE),),
    **{(WAITING, local): rule for local, rule in _WAITING_OR_OFFLINE.items()},
    **{(OFFLINE, local): rule for local, rule in _WAITING_OR_OFFLINE.items()},
}
assert set(TRANSITIONS) == {(p, loc) for p in PUBLIC_STATES for loc in LOCAL_STATES}

ORDER = {state: i for i, state in enumerate(PUBLIC_STATES)}


class Step(NamedTuple):
    """One decision of a pass: target, its state before, its local state, the rule taken, the result."""

    target_id: int
    public: str
    local: str
    rule_index: int
    new: str


class TransitionError(ValueError):
    """A state the table does not know (a programming error upstream, never a runtime condition)."""


def decide(public: str, local: str, new: Mapping[str, list[int]]) -> tuple[int, str]:
    """(index of the winning rule in the target's TRANSITIONS row, new public state) for one target,
    given what the earlier targets of this pass became."""
    rule = TRANSITIONS.get((public, local))
    if rule is None:
        raise TransitionError(f"no transition for public state {public!r} with local state {local!r}")
    for index, (condition, state) in enumerate(rule):
        if condition(new):
            return index, state
    raise AssertionError(f"rule for ({public}, {local}) has no fallback")  # every row ends with ALWAYS


def next_chain(chain: ChainInfo, local_states: Mapping[int, str], trace: list | None = None) -> ChainInfo:
    """One pass of the state machine over a chain. Returns `chain` itself when nothing changed.

    `local_states` maps target id -> local state; a target missing from it counts as OFFLINE. `trace`, if
    given, receives one `Step` per decision (the joint rule's as rule index -1), for logs and tests.
    """
    new: dict[str, list[int]] = {state: [] for state in PUBLIC_STATES}
    for group in PUBLIC_STATES:
        for t in chain.targets:
            if t.public_state == group:
                local = local_states.get(t.target_id, LOCAL_OFFLINE)
                index, state = decide(t.public_state, local, new)
                new[state].append(t.target_id)
                if trace is not None:
                    trace.append(Step(t.target_id, t.public_state, local, index, state))
    if new[SERVING] and new[LASTSRV]:  # joint rule: a LASTSRV is only kept while nothing serves
        if trace is not None:
            trace.extend(Step(tid, LASTSRV, "", -1, OFFLINE) for tid in new[LASTSRV])
        new[OFFLINE].extend(new[LASTSRV])
        new[LASTSRV] = []
    targets = [ChainTarget(tid, state) for state in PUBLIC_STATES for tid in new[state]]
    if len(targets) != len(chain.targets):
        raise TransitionError(f"chain {chain.chain_id} has a target in an unknown public state: "
                              f"{[t.public_state for t in chain.targets]}")
    if targets == chain.targets:
        return chain
    assert len(new[SYNCING]) <= 1 and not (new[SERVING] and new[LASTSRV])
    return ChainInfo(chain.chain_id, chain.version + 1, targets)


def rotate_lastsrv(chain: ChainInfo) -> ChainInfo:
    """Admin override (3FS `rotate-lastsrv`): the LASTSRV head is not coming back; try the next target.

    The head moves to the end as OFFLINE, the next target becomes LASTSRV (it turns SERVING as soon as
    it is alive) and the others OFFLINE (they resync from it). Writes acknowledged only by the old head
    are lost: this is the operator's explicit choice. Raises TransitionError when it does not apply.
    """
    if len(chain.targets) < 2 or chain.targets[0].public_state != LASTSRV:
        raise TransitionError(f"chain {chain.chain_id} has no LASTSRV head to rotate "
                              f"({', '.join(f'{t.target_id}:{t.public_state}' for t in chain.targets)})")
    rest = chain.targets[1:]
    targets = ([ChainTarget(rest[0].target_id, LASTSRV)]
               + [ChainTarget(t.target_id, OFFLINE) for t in rest[1:]]
               + [ChainTarget(chain.targets[0].target_id, OFFLINE)])
    return ChainInfo(chain.chain_id, chain.version + 1, targets)


def sync_done_refusal(chain: ChainInfo, target_id: int, sync_chain_ver: int) -> str | None:
    """Why a finished resync of `target_id`, started when the chain was at `sync_chain_ver`, must NOT
    make it UPTODATE (None: it may).

    A resync is complete only if every write after its start reached the target. That holds while the
    chain stays at the version the resync started under: the predecessor forwards every update admitted
    from then on to the SYNCING target. Any version change in between may hide a period in which the
    target was OFFLINE (writes committed without it) and SYNCING again: a stale resync reported then
    would put a target that misses acknowledged writes into SERVING, and readers would see old data.
    So a resync that saw the chain change is refused and starts over (the cost: a resync restarts
    when another member of its chain changes state meanwhile)."""
    state = next((t.public_state for t in chain.targets if t.target_id == target_id), None)
    if state is None:
        return f"target {target_id} is not in chain {chain.chain_id}"
    if state != SYNCING:
        return f"target {target_id} is {state}, not SYNCING, in chain {chain.chain_id} v{chain.version}"
    if chain.version != sync_chain_ver:
        return (f"chain {chain.chain_id} changed from v{sync_chain_ver} to v{chain.version} during the "
                f"resync of target {target_id}; the resync starts over")
    return None


def offline_refusal(chain: ChainInfo, target_id: int, leaving: Container[int] = ()) -> str | None:
    """Why an admin may not take `target_id` offline without --force (None: it may): it is the only
    SERVING target of its chain that is not already being taken offline (`leaving`: the targets whose
    admin_offline is set), and all IO to the chain would stop."""
    serving = [t.target_id for t in chain.targets if t.public_state == SERVING and t.target_id not in leaving]
    if serving == [target_id]:
        return (f"target {target_id} is the only SERVING target of chain {chain.chain_id}: taking it "
                "offline stops all IO to that chain (add --force to do it anyway)")
    return None


def admin_offline_effective(public_state: str, offline_ver: int, node_alive: bool, node_routing_ver: int) -> bool:
    """Does a target that an admin took offline (routing version `offline_ver` set its admin_offline)
    count as locally OFFLINE yet, so that the chain drops it?

    Dropping a SERVING target at once opens a stale-read window (the simulator, seed 98733): the chain
    acknowledges writes without it while it still serves reads on its old routing, to clients whose
    routing also still lists it. So a SERVING target stays in the chain (it keeps taking every write)
    until it can no longer serve a read: its node has heartbeated with routing at least `offline_ver`
    (`node_routing_ver`, carried by the heartbeat: from then on the target refuses reads,
    `storage.craq.read_check`), or its node is failed (silent for the heartbeat timeout: it fenced
    itself after half of it). A target that serves no reads (SYNCING, WAITING, OFFLINE, LASTSRV) has
    nothing to wait for."""
    return public_state != SERVING or not node_alive or node_routing_ver >= offline_ver
