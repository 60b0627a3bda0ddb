"""The transactional KV interface (FoundationDB's shape) that mgmtd and meta code against.

Semantics every engine provides (see `Transaction`):
- a transaction reads one consistent snapshot, as of its read version;
- reads see the transaction's own uncommitted writes (read-your-writes);
- non-snapshot reads are conflict-tracked: commit fails with `KVConflictError` when a transaction that
  committed after our read version wrote (set, clear, clear_range, write-conflict key) anything we read;
- writes become visible atomically at the commit version; versions increase monotonically;
- limits: KEY_BYTES_MAX, VALUE_BYTES_MAX, TXN_BYTES_MAX; transactions older than MVCC_WINDOW_S may fail with
  KV_TOO_OLD. `KVEngine.run` retries conflicts and too-old errors with a fresh transaction.

Engines differ in scale, not semantics. They are found by URL scheme in `ENGINE_MODULES`, imported lazily so
an engine's dependencies are only needed when it is used.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from threefs.common.eager import Resumed
from threefs.common.status import StatusCode, ThreeFSError, status_error

# FoundationDB's limits: they keep a transaction small enough to resolve and apply quickly.
KEY_BYTES_MAX = 10_000
VALUE_BYTES_MAX = 100_000
TXN_BYTES_MAX = 10_000_000  # keys and values written plus conflict ranges (reads included), as in FDB
# How long a read version stays valid (FDB: 5 s). Older versions of values and the conflict log are pruned
# past this window, so an older transaction cannot be checked and fails with KV_TOO_OLD instead.
MVCC_WINDOW_S = 5.0

# run(): exponential backoff with full jitter; starts near 1 ms so light contention costs little.
RETRY_BACKOFF_S_MIN = 0.001
RETRY_BACKOFF_S_MAX = 0.100
RETRYABLE_CODES = frozenset({StatusCode.KV_CONFLICT, StatusCode.KV_TOO_OLD})

T = TypeVar("T")


class Transaction(abc.ABC):
    """One optimistic transaction. Not reusable: after commit() or cancel() every call raises.

    Keys and values are `bytes`, ordered bytewise. Ranges are half-open: [begin, end).
    """

    @property
    @abc.abstractmethod
    def read_version(self) -> int:
        """The version of the snapshot this transaction reads (taken at the first read, or here if none yet)."""

    @abc.abstractmethod
    async def get(self, key: bytes, *, snapshot: bool = False) -> bytes | None:
        """The value of `key` (None if absent). Conflict-tracked unless `snapshot`."""

    @abc.abstractmethod
    async def get_range(
        self, begin: bytes, end: bytes, *, limit: int = 0, reverse: bool = False, snapshot: bool = False
    ) -> list[tuple[bytes, bytes]]:
        """(key, value) pairs with begin <= key < end, ascending (descending if `reverse`).

        `limit` 0 means no limit; with `reverse` the limit takes the last keys of the range. Unless `snapshot`,
        the range actually read is conflict-tracked: all of [begin, end), or up to the last key returned when
        the limit was reached.
        """

    @abc.abstractmethod
    def set(self, key: bytes, value: bytes) -> None:
        """Write `value` at `key` (buffered until commit)."""

    @abc.abstractmethod
    def clear(self, key: bytes) -> None:
        """Delete `key` (buffered until commit)."""

    @abc.abstractmethod
    def clear_range(self, begin: bytes, end: bytes) -> None:
        """Delete every key in [begin, end) (buffered until commit)."""

    @abc.abstractmethod
    def add_read_conflict_key(self, key: bytes) -> None:
        """Make commit fail if another transaction writes `key` after our read version, as if we had read it."""

    @abc.abstractmethod
    def add_read_conflict_range(self, begin: bytes, end: bytes) -> None:
        """Same as add_read_conflict_key for every key in [begin, end)."""

    @abc.abstractmethod
    def add_write_conflict_key(self, key: bytes) -> None:
        """Make others' conflict-tracked reads of `key` conflict with this commit without writing `key`."""

    @abc.abstractmethod
    async def commit(self) -> int:
        """Apply the writes atomically and return the commit version.

        Raises KVConflictError (KV_CONFLICT) on a conflict and KV_TOO_OLD when the read version is too old to
        check. A transaction without writes commits trivially and returns its read version.
        """

    @abc.abstractmethod
    def cancel(self) -> None:
        """Abandon the transaction; its writes are dropped and later calls raise CANCELLED."""


class KVEngine(abc.ABC):
    """A store that hands out transactions. Open one with `open_engine(url)`."""

    @abc.abstractmethod
    def transaction(self) -> Transaction:
        """A new transaction."""

    async def run(
        self,
        fn: Callable[[Transaction], Awaitable[T]],
        *,
        retries_max: int = 100,
        timeout_s: float = 10.0,
    ) -> T:
        """FoundationDB's retry loop: `result = await fn(tr); await tr.commit(); return result`.

        On KV_CONFLICT or KV_TOO_OLD it backs off (exponential, full jitter, 1 ms .. 100 ms) and calls `fn`
        again with a new transaction, so `fn` must have no effects outside `tr` (or tolerate repeats). Any
        other error is raised at once; when `retries_max` retries or `timeout_s` are used up, the last error is
        raised. An attempt still running at the deadline is cancelled and raises TIMEOUT.

        Engines adapt it through two hooks rather than a loop of their own: `_attempt_transaction(attempt,
        previous)` makes each attempt's transaction, and `_check_error(tr, exc)` may turn an error raised by `fn` into a
        retryable one (it runs inside the attempt's deadline).
        """
        if retries_max < 0 or timeout_s <= 0:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"run(): retries_max={retries_max} must be >= 0 "
                               f"and timeout_s={timeout_s} > 0")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        backoff_s = RETRY_BACKOFF_S_MIN
        attempt = 0
        previous: Transaction | None = None  # the previous attempt's (cancelled) transaction
        while True:  # bounded: each pass uses one of retries_max + 1 attempts
            tr = self._attempt_transaction(attempt, previous)
            scope = None
            try:
                # Stepped by hand (common/eager.py): an attempt that never waits (a read served from the
                # engine's cache, a local commit) needs no deadline timer; one that waits gets it from there.
                coro = self._run_attempt(fn, tr)
                try:
                    first = coro.send(None)
                except StopIteration as done:
                    return done.value
                scope = asyncio.timeout_at(deadline)
                async with scope:
                    return await Resumed(coro, first)
            except ThreeFSError as exc:
                tr.cancel()
                if exc.code not in RETRYABLE_CODES or attempt >= retries_max:
                    raise
                delay_s = random.uniform(0, backoff_s)
                if loop.time() + delay_s >= deadline:
                    raise
                # Not the error: its traceback would keep the failed attempt's frames alive (seen: a SQLite
                # statement's open read snapshot, which made the next BEGIN IMMEDIATE fail "database is locked").
                previous = tr
            except TimeoutError:
                tr.cancel()
                if scope is None or not scope.expired():  # fn's own timeout, not our deadline
                    raise
                raise status_error(StatusCode.TIMEOUT, f"KV transaction did not finish within {timeout_s} s "
                                   f"({attempt + 1} attempts)") from None
            except BaseException:
                tr.cancel()
                raise
            await asyncio.sleep(delay_s)
            backoff_s = min(backoff_s * 2, RETRY_BACKOFF_S_MAX)
            attempt += 1

    async def _run_attempt(self, fn: Callable[[Transaction], Awaitable[T]], tr: Transaction) -> T:
        """One attempt of run(): fn, then the commit."""
        try:
            result = await fn(tr)
        except Exception as exc:
            if not (isinstance(exc, ThreeFSError) and exc.code in RETRYABLE_CODES):
                await self._check_error(tr, exc)
            raise
        await tr.commit()
        return result

    def _attempt_transaction(self, attempt: int, previous: Transaction | None) -> Transaction:
        """run()'s hook: the transaction of attempt number `attempt` (0 first); `previous` is the previous
        attempt's, which ended with KV_CONFLICT or KV_TOO_OLD (None for the first). Default: `transaction()`."""
        return self.transaction()

    async def _check_error(self, tr: Transaction, exc: Exception) -> None:
        """run()'s hook, called when `fn` raised `exc` (neither KV_CONFLICT nor KV_TOO_OLD), before it is
        raised: raise a retryable error instead if `exc` may not be the answer (it rests on stale reads).
        Default: nothing, `exc` is raised."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the engine's resources; transactions of a closed engine fail."""


# URL scheme -> "module:opener". The opener is `async def open_x(url: str) -> KVEngine`.
# A new engine plugs in with one line here (e.g. "etcd": "threefs.kv.etcd:open_etcd").
ENGINE_MODULES: dict[str, str] = {
    "memory": "threefs.kv.memory:open_memory",
    "sqlite": "threefs.kv.sqlite:open_sqlite",
    "etcd": "threefs.kv.etcd:open_etcd",
}


def register_engine(scheme: str, opener: str) -> None:
    """Make `open_engine` handle URLs `scheme://...` with `opener` ("package.module:function")."""
    assert ":" in opener, opener
    ENGINE_MODULES[scheme] = opener


async def open_engine(url: str) -> KVEngine:
    """Open the engine named by `url`: "memory://" (a fresh in-process store) or "sqlite:///abs/path.db"
    (created if missing, parent directories too; add "?sync=full" to fsync every commit)."""
    scheme, sep, _ = url.partition("://")
    target = ENGINE_MODULES.get(scheme) if sep else None
    if target is None:
        raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"unsupported KV URL {url!r}; use memory://, "
                           f"sqlite:///path or etcd://host:port[,host:port...][/prefix]")
    module_name, _, function_name = target.partition(":")
    opener: Any = getattr(importlib.import_module(module_name), function_name)
    engine = await opener(url)
    assert isinstance(engine, KVEngine), engine
    return engine
