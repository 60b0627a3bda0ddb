"""The plain-Python planning of small read batches (StorageClient._plan_small: what a FUSE read of a few
kernel requests goes through) makes the same choices as the vectorised general plan, and reads the right
bytes, on the shared cluster's real routing (3 storage services, R=3)."""

from __future__ import annotations

import itertools

import numpy as np

from threefs.client.aio import AsyncClient
from threefs.cluster import storage_client as sc


def _batch(aio: AsyncClient, fs, attr, ios: list[tuple[int, int]]) -> sc.ReadBatch:
    items = []
    for off, n in ios:
        items += fs.run(aio._read_items(attr, off, memoryview(bytearray(n))))
    return sc.ReadBatch.of_items(items)


def test_small_plans_match_the_general_plan_and_read_the_right_bytes(fs, rng, monkeypatch):
    chunk = 1 << 20
    data = rng.randbytes(24 * chunk)
    fs.mkdir("/plan-small", exist_ok=True)
    fs.write_bytes("/plan-small/f", data)
    attr = fs.stat("/plan-small/f")
    aio, storage = fs.aio, fs.aio.storage
    routing = fs.run(aio.mgmtd.get())
    for trial in range(80):
        n = rng.randint(1, sc.PLAN_SMALL_IOS_MAX)
        ios = [(rng.randrange(len(data) - chunk), rng.choice([1, 4096, 65536, 200_000, chunk - 7]))
               for _ in range(n)]
        ios = [(off, min(size, chunk - off % chunk)) for off, size in ios]  # one chunk IO each
        small, general = _batch(aio, fs, attr, ios), _batch(aio, fs, attr, ios)
        idx = np.flatnonzero(small.ios["length"] > 0)
        storage._rr = itertools.count(trial)
        got = storage._plan(routing, small, idx)
        with monkeypatch.context() as patch:
            patch.setattr(sc, "PLAN_SMALL_IOS_MAX", 0)  # the vectorised plan
            storage._rr = itertools.count(trial)
            want = storage._plan(routing, general, idx)
        assert [(a, i.tolist()) for a, i in got] == [(a, i.tolist()) for a, i in want], (trial, ios)
        assert small.ios["target"].tolist() == general.ios["target"].tolist()
        assert not small.errors and not general.errors
        # and what the small plan reads is the file's bytes
        fs.run(storage.read_batch(small))
        for k, (off, size) in enumerate(ios):
            assert not small.errors and bytes(small.dest(k)) == data[off:off + size], (trial, k)
    fs.remove("/plan-small/f")
