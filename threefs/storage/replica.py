"""CRAQ replica decisions, sans-IO: (chunk metadata, incoming update) -> what to do.

The storage service (asyncio, disks, sockets) and tests drive the same functions. Versions follow 3FS:
the head assigns `update_ver = commit_ver + 1`; a successor applies an update only when it is the next
version after its committed one, reports an already-committed version as success, and asks for a
full-chunk replace when it has missed versions.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple, Protocol


class Meta(Protocol):  # the fields of storage.chunk_engine.ChunkMeta these decisions read
    update_ver: int
    commit_ver: int


class Decision(Enum):
    APPLY = "apply"  # write the update as the pending version, forward, commit
    COMMITTED = "committed"  # already have this version committed: answer with the current state
    MISSING = "missing"  # versions between ours and this update are missing: need a full replace


class HeadPlan(NamedTuple):
    update_ver: int
    full_replace: bool  # compose the whole chunk on top of our newest (pending) version


def plan_at_head(meta: Meta | None) -> HeadPlan:
    """Version for a new update arriving at the head (the head holds the chunk lock).

    A leftover pending version (an earlier update whose forwarding failed) may already be committed
    further down the chain and seen by readers there, so the new version builds on top of it and is
    sent as a full-chunk replace: every replica converges whatever it had.
    """
    if meta is None:
        return HeadPlan(1, False)
    if meta.update_ver != meta.commit_ver:
        return HeadPlan(meta.update_ver + 1, True)
    return HeadPlan(meta.commit_ver + 1, False)


def decide_at_successor(meta: Meta | None, update_ver: int, full_replace: bool) -> Decision:
    assert update_ver >= 1
    committed = meta.commit_ver if meta is not None else 0
    if update_ver <= committed:
        return Decision.COMMITTED
    if full_replace or update_ver == committed + 1:
        return Decision.APPLY
    return Decision.MISSING


def readable(meta: Meta | None, allow_uncommitted: bool) -> bool:
    """A chunk with a pending version answers ChunkNotCommit unless uncommitted reads are allowed."""
    return meta is None or allow_uncommitted or meta.update_ver == meta.commit_ver
