"""Helpers for the meta tests. No pytest-asyncio: a test builds its coroutine and hands it to `run`."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random

from threefs.common.status import StatusCode, ThreeFSError
from threefs.kv import KVEngine, Transaction, open_engine
from threefs.meta.store import MetaStore

N_CHAINS = 16


def run(coro):
    return asyncio.run(coro)


class FakeClock:
    """Nanoseconds that advance by `step` on every reading, so every operation gets its own time."""

    def __init__(self, start: int = 1_000_000_000, step: int = 1_000):
        self.now, self.step = start, step

    def __call__(self) -> int:
        self.now += self.step
        return self.now


class _YieldingTransaction(Transaction):
    """Hands control to the event loop before every read, so concurrent operations interleave inside their
    transactions and really conflict (the real engines answer reads without yielding)."""

    def __init__(self, inner: Transaction, stats: dict, rng: random.Random):
        self._inner, self._stats, self._rng = inner, stats, rng

    async def _yield(self):
        for _ in range(self._rng.randint(1, 4)):  # varied, seeded interleavings: races go both ways
            await asyncio.sleep(0)

    @property
    def read_version(self) -> int:
        return self._inner.read_version

    async def get(self, key, *, snapshot=False):
        await self._yield()
        return await self._inner.get(key, snapshot=snapshot)

    async def get_range(self, begin, end, *, limit=0, reverse=False, snapshot=False):
        await self._yield()
        rows = await self._inner.get_range(begin, end, limit=limit, reverse=reverse, snapshot=snapshot)
        self._stats["range_rows_max"] = max(self._stats["range_rows_max"], len(rows))
        return rows

    def set(self, key, value):
        self._inner.set(key, value)

    def clear(self, key):
        self._inner.clear(key)

    def clear_range(self, begin, end):
        self._inner.clear_range(begin, end)

    def add_read_conflict_key(self, key):
        self._inner.add_read_conflict_key(key)

    def add_read_conflict_range(self, begin, end):
        self._inner.add_read_conflict_range(begin, end)

    def add_write_conflict_key(self, key):
        self._inner.add_write_conflict_key(key)

    async def commit(self):
        await self._yield()
        try:
            version = await self._inner.commit()
        except ThreeFSError as exc:
            if exc.code == StatusCode.KV_CONFLICT:
                self._stats["conflicts"] += 1
            raise
        self._stats["commits"] += 1
        return version

    def cancel(self):
        self._inner.cancel()


class YieldingEngine(KVEngine):
    def __init__(self, inner: KVEngine, seed: int = 1):
        self.inner = inner
        self.rng = random.Random(seed)
        self.stats = {"range_rows_max": 0, "commits": 0, "conflicts": 0}

    def transaction(self) -> Transaction:
        return _YieldingTransaction(self.inner.transaction(), self.stats, self.rng)

    async def close(self) -> None:
        await self.inner.close()


class MetaEnv:
    """Opens engines and stores for one test (the engine kind comes from the parametrized fixture)."""

    def __init__(self, url: str):
        self.url = url

    @contextlib.asynccontextmanager
    async def engine(self, yielding: bool = False):
        kv = await open_engine(self.url)
        engine = YieldingEngine(kv) if yielding else kv
        try:
            yield engine
        finally:
            await engine.close()

    @contextlib.asynccontextmanager
    async def store(self, n_chains: int = N_CHAINS, yielding: bool = False, **kwargs):
        """A fresh engine with an initialised MetaStore on it."""
        kwargs.setdefault("clock_ns", FakeClock())
        async with self.engine(yielding) as kv:
            store = MetaStore(kv, table_info=lambda table_id: (table_id, 1, n_chains), **kwargs)
            await store.init()
            yield store


async def errno_of(coro) -> int:
    """0 if `coro` succeeds, else the errno of the ThreeFSError it raised."""
    try:
        await coro
    except ThreeFSError as exc:
        return exc.errno
    return 0


def errname(code: int) -> str:
    return "OK" if code == 0 else errno.errorcode.get(code, str(code))
