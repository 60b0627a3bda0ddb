"""Seeded random interleavings of transactions, checked against a serial model of FoundationDB's semantics.

The model is written independently of the engines: snapshots are dict copies, conflict sets are Python sets of
keys. That equivalence holds because every key and range bound comes from a small universe of keys (so two
ranges overlap exactly when they share a universe key).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from threefs.common.status import KVConflictError
from threefs.kv import KVEngine

UNIVERSE = [b"k%02d" % i for i in range(12)]
BOUNDS = [*UNIVERSE, b"k99"]
SLOTS = 3  # transactions open at once
STEPS = 1500


class ModelTxn:
    def __init__(self) -> None:
        self.rv_index: int | None = None  # number of commits visible to the snapshot
        self.local: dict[bytes, bytes] | None = None  # snapshot + own writes, once a snapshot is taken
        self.ops: list[tuple] = []  # writes to replay onto the committed state
        self.reads: set[bytes] = set()
        self.writes: set[bytes] = set()


class Model:
    def __init__(self) -> None:
        self.state: dict[bytes, bytes] = {}
        self.log: list[set[bytes]] = []  # write set of each commit, in order
        self.rejected = 0

    def snapshot(self, txn: ModelTxn) -> dict[bytes, bytes]:
        if txn.local is None:
            txn.rv_index = len(self.log)
            txn.local = dict(self.state)
            for op in txn.ops:
                apply(txn.local, op)
        return txn.local

    def commit(self, txn: ModelTxn) -> bool:
        """True if the commit succeeds (and applies it)."""
        if not txn.ops and not txn.writes:
            return True
        if txn.reads and any(txn.reads & written for written in self.log[txn.rv_index :]):
            self.rejected += 1
            return False
        for op in txn.ops:
            apply(self.state, op)
        self.log.append(set(txn.writes))
        return True


def apply(state: dict[bytes, bytes], op: tuple) -> None:
    if op[0] == "set":
        state[op[1]] = op[2]
    elif op[0] == "clear":
        state.pop(op[1], None)
    else:
        for key in [k for k in state if op[1] <= k < op[2]]:
            del state[key]


def in_range(begin: bytes, end: bytes) -> set[bytes]:
    return {k for k in UNIVERSE if begin <= k < end}


async def step(rng: random.Random, model: Model, engine: KVEngine, slots: list, counter: list[int],
               clock: Callable[[], float]) -> None:
    i = rng.randrange(SLOTS)
    if slots[i] is None:
        slots[i] = (engine.transaction(), ModelTxn())
    tr, mt = slots[i]
    action = rng.choices(["get", "range", "set", "clear", "clear_range", "wconf", "rconf", "commit", "cancel",
                          "tick"],
                         [20, 20, 20, 6, 4, 2, 2, 12, 2, 1])[0]
    key = rng.choice(UNIVERSE)
    begin, end = sorted(rng.sample(BOUNDS, 2))
    snapshot = rng.random() < 0.2
    if action == "get":
        expect = model.snapshot(mt).get(key)
        assert await tr.get(key, snapshot=snapshot) == expect
        if not snapshot:
            mt.reads.add(key)
    elif action == "range":
        limit, reverse = rng.choice([0, 0, 1, 2, 3, 5]), rng.random() < 0.4
        rows = sorted(((k, v) for k, v in model.snapshot(mt).items() if begin <= k < end), reverse=reverse)
        if limit:
            rows = rows[:limit]
        assert await tr.get_range(begin, end, limit=limit, reverse=reverse, snapshot=snapshot) == rows
        if not snapshot:
            if limit and len(rows) == limit:
                last = rows[-1][0]
                mt.reads |= in_range(begin, last + b"\x00") if not reverse else in_range(last, end)
            else:
                mt.reads |= in_range(begin, end)
    elif action in ("set", "clear", "clear_range"):
        counter[0] += 1
        if action == "set":
            op: tuple = ("set", key, b"v%d" % counter[0])
            tr.set(key, op[2])
        elif action == "clear":
            op = ("clear", key)
            tr.clear(key)
        else:
            op = ("clear_range", begin, end)
            tr.clear_range(begin, end)
        mt.ops.append(op)
        mt.writes |= {key} if action != "clear_range" else in_range(begin, end)
        if mt.local is not None:
            apply(mt.local, op)
    elif action == "wconf":
        tr.add_write_conflict_key(key)
        mt.writes.add(key)
    elif action == "rconf":
        model.snapshot(mt)  # declaring a read conflict takes the read version
        tr.add_read_conflict_range(begin, end)
        mt.reads |= in_range(begin, end)
    elif action == "tick":
        # Time passes beyond the MVCC window, so commits garbage-collect old versions. Open transactions are
        # cancelled first: they would (rightly) fail with KV_TOO_OLD, which this model does not track.
        for j, slot in enumerate(slots):
            if slot is not None:
                slot[0].cancel()
                slots[j] = None
        clock.advance(rng.choice([0.5, 3.0, 6.0]))
    elif action == "commit":
        slots[i] = None
        expect_ok = model.commit(mt)
        try:
            await tr.commit()
            assert expect_ok, "engine committed where the model sees a conflict"
        except KVConflictError:
            assert not expect_ok, "engine reported a conflict the model does not see"
        assert dict(await engine.transaction().get_range(b"", b"\xff")) == model.state
    else:
        slots[i] = None
        tr.cancel()


@pytest.mark.parametrize("seed", range(4))
def test_random_interleavings_match_serial_model(kv, clock, seed):
    async def body() -> None:
        engine = await kv.open(clock=clock)  # a fake clock: "tick" steps make garbage collection run
        try:
            rng = random.Random(seed)
            model, slots, counter = Model(), [None] * SLOTS, [0]
            for _ in range(STEPS):
                await step(rng, model, engine, slots, counter, clock)
        finally:
            await engine.close()
        # not vacuous: the mix commits writes and the model expects (and the engine reports) conflicts
        assert len(model.log) > 50 and model.rejected > 10, (len(model.log), model.rejected)

    asyncio.run(body())
