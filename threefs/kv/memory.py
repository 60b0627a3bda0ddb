"""The in-process engine: `open_engine("memory://")`. For tests and the simulator; nothing is durable.

MVCC: every key keeps its (version, value-or-None) history, so any number of transactions read their own
snapshots. A log of each commit's write ranges decides conflicts. Both are pruned past a horizon: the newest
commit older than the MVCC window. A value superseded at or below the horizon can no longer be read by a
transaction that is still valid, so it is dropped; a read version below the horizon gets KV_TOO_OLD.

Every method takes a threading.Lock and never awaits while holding it: asyncio callers see each call as
atomic, and threads may share the engine too.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable

from threefs.common.status import KVConflictError, StatusCode, ThreeFSError, status_error
from threefs.kv.api import MVCC_WINDOW_S, KVEngine, Transaction
from threefs.kv.txn import LocalEngineTransaction, Range, WriteBuffer, find_overlap

# Commit-log entries garbage-collected per commit at most: keeps one commit's latency bounded after a burst.
GC_LOG_ENTRIES_PER_COMMIT_MAX = 1000


class MemoryEngine(KVEngine):
    """An in-process MVCC store. `clock` (seconds) drives versions and the MVCC window; tests may fake it."""

    def __init__(self, *, clock: Callable[[], float] = time.time, window_s: float = MVCC_WINDOW_S):
        self.clock = clock
        self.window_s = window_s
        self._lock = threading.Lock()
        self._history: dict[bytes, list[tuple[int, bytes | None]]] = {}  # ascending versions; None = deleted
        self._keys: list[bytes] = []  # sorted keys of _history, for range reads
        self._log: deque[tuple[int, list[Range]]] = deque()  # (commit version, coalesced write ranges)
        self._version = 0
        self._horizon = 0
        self._closed = False

    def transaction(self) -> Transaction:
        self._check_open()
        return LocalEngineTransaction(self)

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            self._history.clear()
            self._keys.clear()
            self._log.clear()

    # -- called by LocalEngineTransaction --------------------------------------------------------------------
    def latest_version(self) -> int:
        with self._lock:
            self._check_open()
            return self._version

    def get_at(self, key: bytes, version: int) -> bytes | None:
        with self._lock:
            self._check_readable(version)
            return self._value_at(key, version)

    def range_at(self, begin: bytes, end: bytes, version: int, limit: int, reverse: bool) -> list[tuple[bytes, bytes]]:
        with self._lock:
            self._check_readable(version)
            lo, hi = bisect_left(self._keys, begin), bisect_left(self._keys, end)
            rows: list[tuple[bytes, bytes]] = []
            for i in range(hi - 1, lo - 1, -1) if reverse else range(lo, hi):
                key = self._keys[i]
                value = self._value_at(key, version)
                if value is not None:
                    rows.append((key, value))
                    if len(rows) == limit:  # never true for limit 0
                        break
            return rows

    def commit(self, read_version: int | None, reads: list[Range], writes: WriteBuffer) -> int:
        with self._lock:
            self._check_open()
            if read_version is not None:
                self._check_conflicts(read_version, reads)
            version = max(self._version + 1, int(self.clock() * 1_000_000))
            for begin, end in writes.cleared:
                for key in self._keys[bisect_left(self._keys, begin) : bisect_left(self._keys, end)]:
                    self._append(key, version, None)
            for key, value in writes.ops.items():
                self._append(key, version, value)
            self._log.append((version, writes.write_ranges()))
            assert version > self._version
            self._version = version
            self._collect_garbage()
            return version

    # -- internals (lock held) ------------------------------------------------------------------------------
    def _value_at(self, key: bytes, version: int) -> bytes | None:
        for v, value in reversed(self._history.get(key, ())):  # histories stay short: GC trims them
            if v <= version:
                return value
        return None

    def _append(self, key: bytes, version: int, value: bytes | None) -> None:
        history = self._history.get(key)
        if history is None:
            if value is None:
                return  # clearing an absent key changes nothing any reader could see
            history = self._history[key] = []
            insort(self._keys, key)
        if history and history[-1][0] == version:
            history[-1] = (version, value)  # a set after a clear_range in the same commit
        elif value is not None or history[-1][1] is not None:  # (deleting a deleted key adds nothing)
            history.append((version, value))

    def _check_conflicts(self, read_version: int, reads: list[Range]) -> None:
        if read_version < self._horizon:
            raise status_error(StatusCode.KV_TOO_OLD, f"read version {read_version} is older than the MVCC "
                               f"horizon {self._horizon}; conflicts can no longer be checked")
        begins = [r[0] for r in reads]
        for version, written in reversed(self._log):  # newest first; stop at our snapshot
            if version <= read_version:
                break
            for begin, end in written:
                hit = find_overlap(reads, begins, begin, end)
                if hit is not None:
                    raise KVConflictError(StatusCode.KV_CONFLICT, f"KV conflict: range [{hit[0][:64]!r}, "
                                          f"{hit[1][:64]!r}) read at version {read_version} was written by the "
                                          f"commit at version {version}")

    def _collect_garbage(self) -> None:
        cutoff = int((self.clock() - self.window_s) * 1_000_000)
        expired: list[Range] = []
        while self._log and self._log[0][0] <= cutoff and len(expired) < GC_LOG_ENTRIES_PER_COMMIT_MAX:
            version, written = self._log.popleft()
            self._horizon = version
            expired.extend(written)
        for begin, end in expired:
            self._prune(begin, end)

    def _prune(self, begin: bytes, end: bytes) -> None:
        """Drop versions in [begin, end) that no read version at or above the horizon can see."""
        dead: list[bytes] = []
        for key in self._keys[bisect_left(self._keys, begin) : bisect_left(self._keys, end)]:
            history = self._history[key]
            visible = 0  # index of the newest version at or below the horizon
            while visible + 1 < len(history) and history[visible + 1][0] <= self._horizon:
                visible += 1
            del history[:visible]
            if history[0][0] <= self._horizon and history[0][1] is None:
                del history[0]  # a deletion everyone can see: the key reads as absent without it
            if not history:
                dead.append(key)
        for key in dead:
            del self._history[key]
            del self._keys[bisect_left(self._keys, key)]

    def _check_readable(self, version: int) -> None:
        self._check_open()
        if version < self._horizon:
            raise status_error(StatusCode.KV_TOO_OLD, f"read version {version} is older than the MVCC horizon "
                               f"{self._horizon} ({self.window_s} s window); retry with a new transaction")

    def _check_open(self) -> None:
        if self._closed:
            raise status_error(StatusCode.KV_ERROR, "KV engine memory:// is closed")


async def open_memory(url: str) -> KVEngine:
    """`memory://`: a fresh, empty engine each call."""
    if url != "memory://":
        raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"unsupported KV URL {url!r}: the memory engine takes "
                           f"no name or options; use memory://")
    return MemoryEngine()
