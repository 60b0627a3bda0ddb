"""The chain / target state machine (3FS `updateChain.cc::generateNewChain`), as a pure function.

Everything that decides a target's public state lives in this file: mgmtd's service only feeds it the
chain and the local states reported by heartbeats, and persists what comes out. No IO, no clock.

Public states: SERVING (read + write), SYNCING (write only, catching up), WAITING, LASTSRV, OFFLINE.
Local states (reported by the storage service): UPTODATE, ONLINE, OFFLINE ("alive" = ONLINE|UPTODATE).

| current   | local state / chain condition                         | new       |
|-----------|-------------------------------------------------------|-----------|
| SERVING   | alive                                                 | SERVING   |
| SERVING   | dead, no other target stays SERVING, first such one   | LASTSRV   |
| SERVING   | dead, otherwise                                       | OFFLINE   |
| LASTSRV   | another target is SERVING                             | OFFLINE   |
| LASTSRV   | alive (it holds the newest data), none SERVING        | SERVING   |
| LASTSRV   | dead, none SERVING                                    | LASTSRV   |
| SYNCING   | UPTODATE (sync done)                                  | SERVING   |
| SYNCING   | ONLINE, some target SERVING                           | SYNCING   |
| SYNCING   | ONLINE, none SERVING                                  | WAITING   |
| SYNCING   | dead                                                  | OFFLINE   |
| WAITING / OFFLINE | alive, some SERVING, none SYNCING (first such)| SYNCING   |
| WAITING / OFFLINE | alive, otherwise                              | WAITING   |
| WAITING / OFFLINE | dead                                          | OFFLINE   |

After each pass the chain is ordered SERVING < LASTSRV < SYNCING < WAITING < OFFLINE (stable), and the
chain version is bumped when anything changed. At most one target per chain is SYNCING.
"""

from __future__ import annotations

from threefs.rpc.schemas.mgmtd import (
    LASTSRV,
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

_ORDER = {state: i for i, state in enumerate(PUBLIC_STATES)}


def _alive(local: str) -> bool:
    return local in (ONLINE, UPTODATE)


def _pass_serving(targets: list[ChainTarget], local: dict[int, str]) -> dict[int, str]:
    """New states of the SERVING and LASTSRV targets (they decide whether the chain has a server)."""
    new: dict[int, str] = {}
    serving_alive = [t.target_id for t in targets if t.public_state == SERVING and _alive(local[t.target_id])]
    lastsrv_given = any(t.public_state == LASTSRV for t in targets)
    for t in targets:
        alive = _alive(local[t.target_id])
        if t.public_state == SERVING:
            if alive:
                new[t.target_id] = SERVING
            elif not serving_alive and not lastsrv_given:
                new[t.target_id] = LASTSRV
                lastsrv_given = True
            else:
                new[t.target_id] = OFFLINE
        elif t.public_state == LASTSRV:
            if serving_alive:
                new[t.target_id] = OFFLINE
            else:
                new[t.target_id] = SERVING if alive else LASTSRV
    return new


def _pass_others(targets: list[ChainTarget], local: dict[int, str], new: dict[int, str]) -> None:
    some_serving = SERVING in new.values()
    syncing_taken = any(
        t.public_state == SYNCING and local[t.target_id] == ONLINE and some_serving for t in targets
    )
    for t in targets:
        if t.target_id in new:
            continue
        state = local[t.target_id]
        if t.public_state == SYNCING:
            if state == UPTODATE:
                new[t.target_id] = SERVING
            elif state == ONLINE:
                new[t.target_id] = SYNCING if some_serving else WAITING
            else:
                new[t.target_id] = OFFLINE
        elif _alive(state) and some_serving and not syncing_taken:
            new[t.target_id] = SYNCING
            syncing_taken = True
        else:
            new[t.target_id] = WAITING if _alive(state) else OFFLINE


def next_chain(chain: ChainInfo, local_states: dict[int, str]) -> ChainInfo:
    """One pass of the state machine over a chain. Returns the same object when nothing changed."""
    local = {t.target_id: local_states.get(t.target_id, OFFLINE) for t in chain.targets}
    new = _pass_serving(chain.targets, local)
    _pass_others(chain.targets, local, new)
    assert len(new) == len(chain.targets)
    targets = [ChainTarget(t.target_id, new[t.target_id]) for t in chain.targets]
    targets.sort(key=lambda t: _ORDER[t.public_state])  # stable: keeps the order inside a state
    if targets == chain.targets:
        return chain
    assert sum(t.public_state == SYNCING for t in targets) <= 1
    return ChainInfo(chain.chain_id, chain.version + 1, targets)


def serving_targets(chain: ChainInfo) -> list[int]:
    return [t.target_id for t in chain.targets if t.public_state == SERVING]


def write_targets(chain: ChainInfo) -> list[int]:
    """The targets a write goes through, head first (SERVING then SYNCING)."""
    return [t.target_id for t in chain.targets if t.public_state in (SERVING, SYNCING)]
