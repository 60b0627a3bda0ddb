"""What every engine shares: key ranges, the write buffer and the transaction logic around it.

`BufferedTransaction` does read-your-writes, conflict-set bookkeeping, limits and lifecycle; an engine only
supplies four hooks: take a read version, read a key or a range at a version, and commit atomically (check
conflicts, apply the buffer, log the written ranges). Keeping this logic in one place is what makes the
engines differ in scale and not in semantics.
"""

from __future__ import annotations

import abc
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.kv.api import KEY_BYTES_MAX, MVCC_WINDOW_S, TXN_BYTES_MAX, VALUE_BYTES_MAX, Transaction

Range = tuple[bytes, bytes]  # half-open [begin, end)


def key_after(key: bytes) -> bytes:
    """The first key greater than `key`, so [key, key_after(key)) holds exactly `key`."""
    return key + b"\x00"


def coalesce(ranges: Iterable[Range]) -> list[Range]:
    """Sorted, disjoint, non-touching ranges covering the same keys; empty ranges dropped."""
    merged: list[Range] = []
    for begin, end in sorted(r for r in ranges if r[0] < r[1]):
        if merged and begin <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((begin, end))
    return merged


def find_overlap(ranges: list[Range], begins: list[bytes], begin: bytes, end: bytes) -> Range | None:
    """The range of coalesced `ranges` (with `begins` their begin keys) that overlaps [begin, end), if any."""
    # Ranges are disjoint and sorted, so the last one starting before `end` reaches furthest right.
    i = bisect_left(begins, end) - 1
    if i >= 0 and ranges[i][1] > begin:
        return ranges[i]
    return None


class WriteBuffer:
    """A transaction's uncommitted writes, in a form that answers reads and commits in two steps:
    first delete every range in `cleared`, then apply `ops` (a value, or None for a point clear).
    A clear_range drops the ops it covers, and a later set re-adds one, so this order reproduces the
    order in which the caller issued them."""

    def __init__(self) -> None:
        self.ops: dict[bytes, bytes | None] = {}
        self.cleared: list[Range] = []  # coalesced
        self._cleared_begins: list[bytes] = []
        self.write_conflicts: list[Range] = []  # add_write_conflict_key: conflict without a mutation
        self._op_keys: list[bytes] | None = []  # sorted keys of ops; None = rebuild on demand

    def put(self, key: bytes, value: bytes | None) -> None:
        if key not in self.ops and self._op_keys is not None:
            # Appending in ascending order (the common case) keeps the index; anything else rebuilds it lazily,
            # so n random sets cost one sort instead of n list insertions.
            if not self._op_keys or key > self._op_keys[-1]:
                self._op_keys.append(key)
            else:
                self._op_keys = None
        self.ops[key] = value

    def clear_range(self, begin: bytes, end: bytes) -> None:
        keys = self._sorted_keys()
        i, j = bisect_left(keys, begin), bisect_left(keys, end)
        for key in keys[i:j]:
            del self.ops[key]
        del keys[i:j]
        self.cleared = coalesce([*self.cleared, (begin, end)])
        self._cleared_begins = [r[0] for r in self.cleared]

    def lookup(self, key: bytes) -> tuple[bool, bytes | None]:
        """(True, value or None) when the buffer decides `key`; (False, None) when the snapshot does."""
        if key in self.ops:
            return True, self.ops[key]
        i = bisect_right(self._cleared_begins, key) - 1  # the last cleared range beginning at or before key
        if i >= 0 and self.cleared[i][0] <= key < self.cleared[i][1]:
            return True, None
        return False, None

    def op_count(self, begin: bytes, end: bytes) -> int:
        keys = self._sorted_keys()
        return bisect_left(keys, end) - bisect_left(keys, begin)

    def values_in(self, begin: bytes, end: bytes) -> list[tuple[bytes, bytes]]:
        """Buffered (key, value) sets in [begin, end), ascending; point clears left out."""
        keys = self._sorted_keys()
        in_range = keys[bisect_left(keys, begin) : bisect_left(keys, end)]
        return [(k, v) for k in in_range if (v := self.ops[k]) is not None]

    def uncleared(self, begin: bytes, end: bytes) -> list[Range]:
        """The parts of [begin, end) not covered by a clear_range, ascending: only these need the snapshot."""
        parts: list[Range] = []
        cursor = begin
        for c_begin, c_end in self.cleared:
            if c_end <= cursor:
                continue
            if c_begin >= end:
                break
            if c_begin > cursor:
                parts.append((cursor, c_begin))
            cursor = max(cursor, c_end)
        if cursor < end:
            parts.append((cursor, end))
        return parts

    def write_ranges(self) -> list[Range]:
        """Everything this transaction writes, as coalesced ranges: what others' reads conflict with."""
        points = ((k, key_after(k)) for k in self.ops)
        return coalesce([*points, *self.cleared, *self.write_conflicts])

    def is_empty(self) -> bool:
        return not (self.ops or self.cleared or self.write_conflicts)

    def _sorted_keys(self) -> list[bytes]:
        if self._op_keys is None:
            self._op_keys = sorted(self.ops)
        return self._op_keys


def check_key(key: bytes, what: str = "key", bytes_max: int = KEY_BYTES_MAX) -> None:
    if not isinstance(key, bytes):
        raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"KV {what} must be bytes, not {type(key).__name__}")
    if len(key) > bytes_max:
        raise status_error(StatusCode.KV_TOO_LARGE, f"KV {what} is {len(key)} bytes, over the limit of "
                           f"{bytes_max} (KEY_BYTES_MAX)")


def check_range(begin: bytes, end: bytes) -> None:
    # A range bound may be one byte longer than a key so that key_after(longest key) is a valid end.
    check_key(begin, "range begin", KEY_BYTES_MAX + 1)
    check_key(end, "range end", KEY_BYTES_MAX + 1)


class BufferedTransaction(Transaction):
    """Transaction logic over four engine hooks (the `_engine_*` methods)."""

    def __init__(self, *, clock: Callable[[], float] = time.time, window_s: float = MVCC_WINDOW_S):
        self._clock = clock
        self._window_s = window_s
        self._read_version: int | None = None
        self._read_time_s = 0.0
        self._reads: list[Range] = []
        self._writes = WriteBuffer()
        self._size_bytes = 0  # mutations and conflict ranges, limited by TXN_BYTES_MAX
        self._state = "open"  # -> "committed" | "failed" | "cancelled"

    # -- engine hooks ---------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _engine_read_version(self) -> int:
        """The latest committed version: every commit at or below it is visible, none above it."""

    # A plain (blocking, quick) function doing what _engine_get does, for engines that have one.
    _engine_get_now: Callable[[bytes, int], bytes | None] | None = None

    @abc.abstractmethod
    async def _engine_get(self, key: bytes, version: int) -> bytes | None:
        """The committed value of `key` as of `version`; KV_TOO_OLD if that version was pruned."""

    @abc.abstractmethod
    async def _engine_range(
        self, begin: bytes, end: bytes, version: int, limit: int, reverse: bool
    ) -> list[tuple[bytes, bytes]]:
        """Committed pairs in [begin, end) as of `version`, ordered; limit 0 = all."""

    @abc.abstractmethod
    async def _engine_commit(self, read_version: int | None, reads: list[Range], writes: WriteBuffer) -> int:
        """Atomically: raise KVConflictError if a commit after `read_version` wrote into `reads` (coalesced;
        empty means no check), else apply `writes` at a new, higher version, log its write ranges, and
        return that version."""

    # -- Transaction ----------------------------------------------------------------------------------------
    @property
    def read_version(self) -> int:
        return self._ensure_read_version()

    async def get(self, key: bytes, *, snapshot: bool = False) -> bytes | None:
        # The hot path of every metadata call (a stat reads 3 keys, an unlink 5): _check_open, check_key,
        # _ensure_read_version and _check_age are called only when their inline test says they have work.
        if self._state != "open":
            self._check_open()
        if type(key) is not bytes or len(key) > KEY_BYTES_MAX:
            check_key(key)
        version = self._read_version
        if version is None:
            version = self._ensure_read_version()
        if not snapshot:
            # Tracked even when the buffer answers: conservative, and it keeps the rule simple to state.
            self._add_read((key, key + b"\x00"))
        writes = self._writes
        if key in writes.ops:
            return writes.ops[key]
        if writes.cleared:
            found, value = writes.lookup(key)
            if found:
                return value
        if self._clock() - self._read_time_s > self._window_s:
            self._check_age()
        engine_get_now = self._engine_get_now
        if engine_get_now is not None:  # an engine that answers at once: no coroutine for it
            return engine_get_now(key, version)
        return await self._engine_get(key, version)

    async def get_range(
        self, begin: bytes, end: bytes, *, limit: int = 0, reverse: bool = False, snapshot: bool = False
    ) -> list[tuple[bytes, bytes]]:
        self._check_open()
        check_range(begin, end)
        if limit < 0:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"get_range limit must be >= 0, not {limit}")
        if begin >= end:
            return []
        version = self._ensure_read_version()
        self._check_age()
        rows = await self._merged_range(begin, end, version, limit, reverse)
        if not snapshot:
            if limit and len(rows) == limit:  # only the part up to the last key returned was read
                read = (begin, key_after(rows[-1][0])) if not reverse else (rows[-1][0], end)
            else:
                read = (begin, end)
            self._add_read(read)
        return rows

    async def _merged_range(
        self, begin: bytes, end: bytes, version: int, limit: int, reverse: bool
    ) -> list[tuple[bytes, bytes]]:
        """The snapshot range with the buffer laid over it."""
        buffered = self._writes.values_in(begin, end)
        snapshot_rows: list[tuple[bytes, bytes]] = []
        segments = self._writes.uncleared(begin, end)
        for seg_begin, seg_end in reversed(segments) if reverse else segments:
            if limit and len(snapshot_rows) >= limit:
                break
            # Buffered ops can hide at most op_count snapshot rows, so this many always yields enough survivors.
            fetch = limit - len(snapshot_rows) + self._writes.op_count(seg_begin, seg_end) if limit else 0
            rows = await self._engine_range(seg_begin, seg_end, version, fetch, reverse)
            snapshot_rows.extend(row for row in rows if row[0] not in self._writes.ops)
        merged = sorted(snapshot_rows + buffered, reverse=reverse)  # keys are unique: values never compared
        return merged[:limit] if limit else merged

    def set(self, key: bytes, value: bytes) -> None:
        self._check_open()
        check_key(key)
        if not isinstance(value, bytes):
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"KV value must be bytes, not {type(value).__name__}")
        if len(value) > VALUE_BYTES_MAX:
            raise status_error(StatusCode.KV_TOO_LARGE, f"KV value is {len(value)} bytes, over the limit of "
                               f"{VALUE_BYTES_MAX} (VALUE_BYTES_MAX); key {key[:64]!r}")
        self._count_bytes(len(key) + len(value))
        self._writes.put(key, value)

    def clear(self, key: bytes) -> None:
        self._check_open()
        check_key(key)
        self._count_bytes(len(key))
        self._writes.put(key, None)

    def clear_range(self, begin: bytes, end: bytes) -> None:
        self._check_open()
        check_range(begin, end)
        if begin >= end:
            return
        self._count_bytes(len(begin) + len(end))
        self._writes.clear_range(begin, end)

    def add_read_conflict_key(self, key: bytes) -> None:
        check_key(key)
        self.add_read_conflict_range(key, key_after(key))

    def add_read_conflict_range(self, begin: bytes, end: bytes) -> None:
        self._check_open()
        check_range(begin, end)
        if begin < end:
            self._ensure_read_version()  # the conflict is "written after our read version": we need one
            self._add_read((begin, end))

    def add_write_conflict_key(self, key: bytes) -> None:
        self._check_open()
        check_key(key)
        self._count_bytes(len(key))
        self._writes.write_conflicts.append((key, key_after(key)))

    async def commit(self) -> int:
        self._check_open()
        self._state = "failed"  # until proven otherwise; a failed transaction is not retried in place
        if self._writes.is_empty():
            version = self._ensure_read_version()
        else:
            reads = coalesce(self._reads)
            if reads:
                self._check_age()
            version = await self._engine_commit(self._read_version if reads else None, reads, self._writes)
        self._state = "committed"
        return version

    def cancel(self) -> None:
        if self._state == "open":
            self._state = "cancelled"
            self._writes = WriteBuffer()  # drop the memory now; the object may live on

    # -- helpers --------------------------------------------------------------------------------------------
    def _ensure_read_version(self) -> int:
        if self._read_version is None:
            self._read_version = self._engine_read_version()
            self._read_time_s = self._clock()
        return self._read_version

    def _check_age(self) -> None:
        age_s = self._clock() - self._read_time_s
        if age_s > self._window_s:
            raise status_error(StatusCode.KV_TOO_OLD, f"transaction read version {self._read_version} is "
                               f"{age_s:.1f} s old, over the {self._window_s} s MVCC window; retry with a new "
                               f"transaction (KVEngine.run does)")

    def _check_open(self) -> None:
        if self._state == "open":
            return
        if self._state == "cancelled":
            raise ThreeFSError(StatusCode.CANCELLED, "KV transaction was cancelled")
        raise status_error(StatusCode.KV_ERROR, f"KV transaction already {self._state}; start a new one "
                           f"(KVEngine.run does)")

    def _add_read(self, read: Range) -> None:
        self._count_bytes(len(read[0]) + len(read[1]))
        self._reads.append(read)

    def _count_bytes(self, size: int) -> None:
        # As in FoundationDB, conflict ranges count too: they bound the memory of both the transaction and the
        # commit's conflict check.
        if self._size_bytes + size > TXN_BYTES_MAX:
            raise status_error(StatusCode.KV_TOO_LARGE, f"KV transaction would total {self._size_bytes + size} "
                               f"bytes of mutations and conflict ranges, over the limit of {TXN_BYTES_MAX} "
                               f"(TXN_BYTES_MAX); split it into smaller transactions")
        self._size_bytes += size


class LocalEngineTransaction(BufferedTransaction):
    """The transaction of an in-process engine whose primitives are plain (blocking, fast) calls:
    `latest_version()`, `get_at(key, version)`, `range_at(...)`, `commit(read_version, reads, writes)`.
    The memory and SQLite engines share it."""

    def __init__(self, engine):
        super().__init__(clock=engine.clock, window_s=engine.window_s)
        self._engine = engine
        self._engine_get_now = engine.get_at

    def _engine_read_version(self) -> int:
        return self._engine.latest_version()

    async def _engine_get(self, key: bytes, version: int) -> bytes | None:
        return self._engine.get_at(key, version)

    async def _engine_range(
        self, begin: bytes, end: bytes, version: int, limit: int, reverse: bool
    ) -> list[tuple[bytes, bytes]]:
        return self._engine.range_at(begin, end, version, limit, reverse)

    async def _engine_commit(self, read_version: int | None, reads: list[Range], writes: WriteBuffer) -> int:
        return self._engine.commit(read_version, reads, writes)
