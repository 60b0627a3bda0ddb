"""The embedded durable engine: `open_engine("sqlite:///abs/path/kv.db")`, safe for several processes.

Why MVCC lives in the table. A sqlite3 connection holds at most one read transaction, but a server runs many KV
transactions at once, and long-open readers would also hold back WAL checkpoints. So the table keeps recent
versions of each key and a KV transaction reads "the newest row at or below my read version" with short,
independent statements; any connection in any process can serve any read version.

Tables:
  kv(key, version, value)  WITHOUT ROWID, primary key (key, version); value NULL = deleted at that version
  write_log(version, ranges)  the coalesced ranges each commit wrote (msgpack), for conflict checks
  meta(version, horizon)  one row: the version of the last commit, and the GC horizon (see GC)

Commit: BEGIN IMMEDIATE takes SQLite's write lock, so the commits of all processes are serialised (busy_timeout
waits for it). Inside: look in the write log for a commit after our read version that wrote into our read
ranges (-> KV_CONFLICT); else insert the new rows at version max(last + 1, now in µs), log the write ranges,
set meta.version, COMMIT. meta.version moves in the same SQLite transaction as the rows, so a reader that saw version
V sees exactly the commits <= V.

GC (inside a commit, at most every GC_INTERVAL_S): the horizon moves to the newest commit older than the MVCC
window. For the ranges written by the commits it passes, rows superseded at or below the horizon and deletions
at or below it are removed, then those log entries. A read version below the horizon gets KV_TOO_OLD, because
rows or log entries it needs may be gone. Readers check the horizon after reading: it only grows, so a GC that
ran concurrently with the read cannot go unnoticed.

Durability: journal_mode=WAL with synchronous=NORMAL (the default) keeps every returned commit across the crash
of any process (kill -9): the commit is in the WAL, in the OS page cache. A power loss or OS crash never corrupts
the file but may lose the last commits. `?sync=full` (synchronous=FULL) fsyncs the WAL at every commit, so a
returned commit survives power loss too, for the price of one fsync per commit.

Read cache (exact). Each engine remembers the values it read at the newest version it knows of (`_cache_version`)
and answers a read at exactly that version from memory: MVCC makes the value of a key at a version immutable,
and a transaction whose read version equals the cache's reads the same snapshot. When the read version moved
on (another process or connection committed), the same statement that reads it returns the write ranges those
commits logged, and only the keys they wrote are forgotten (all of them if the log was already pruned past
the cache's version). Our own commit moves the cache to the new version with its writes applied (a
clear_range empties it instead); what other connections committed between the cache's version and ours is
forgotten first, read from the write log inside the commit's own locked snapshot (so two meta servers on one
file keep their caches across each other's commits). So a stat storm of cached records costs no statement at
all (the newest version comes from the WAL index, below), and a burst of creates in one directory reads the
directory's records from memory. Conflict tracking is untouched: reads are recorded by the transaction before
they reach the engine, and checked against the write log at commit.

The newest version without a statement. Every read transaction starts by asking for the newest version, and
that statement (plus the shared-memory locks SQLite takes for it) costs more than the rest of a cached stat.
SQLite's WAL index (the "-shm" file, mapped by every connection) begins with a header that every commit of
any connection rewrites before its COMMIT returns (its change counter grows by one per commit); SQLite keeps
two copies, written in opposite order, so a reader can tell a header being rewritten. The engine maps the
first bytes of that file read-only and remembers the header as it was just before its last version query:
while both copies still equal it, no commit has finished since, and that query's answer is still the newest
version. Anything else (a commit, a WAL restart, a header being written, no mapping) runs the statement.
After its own commit the engine knows the newest version without asking either: the header's commit counter,
read under SQLite's write lock and again after COMMIT, moved by exactly one (any later commit of another
connection would have moved it again). The file is opened once per process and file and closed with the last
engine on it, after SQLite's connections: closing any descriptor of a file drops all of the process's POSIX
locks on it, SQLite's included.

SQLite calls block, and they run directly inside the async methods: a local statement takes microseconds and a
commit one WAL append, cheaper than a hop to a thread. Only waiting for another process's write lock (bounded by
BUSY_TIMEOUT_S; commits are short, so waits are too) blocks the event loop for longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import sqlite3
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator

import msgspec

from threefs.common.status import KVConflictError, StatusCode, ThreeFSError, status_error
from threefs.kv.api import MVCC_WINDOW_S, KVEngine, Transaction
from threefs.kv.txn import LocalEngineTransaction, Range, WriteBuffer, coalesce, find_overlap

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 10.0  # longest wait for another process's write lock before KV_ERROR
GC_INTERVAL_S = 0.5  # GC runs in at most one commit per interval and engine
GC_COMMITS_PER_PASS_MAX = 1000  # bounds the extra latency of the commit that runs GC
# Checkpoints (copying the WAL back into the file) fsync, which would stall the event loop for milliseconds:
# a thread per engine runs them every CHECKPOINT_INTERVAL_S. SQLite's own automatic checkpoint stays on, at a
# high mark, as the safety net that bounds the WAL should that thread fall behind.
CHECKPOINT_INTERVAL_S = 0.1
WAL_AUTOCHECKPOINT_PAGES = 10_000
FORMAT_VERSION = 1  # PRAGMA user_version of the file; bump when the schema changes
READ_CACHE_KEYS_MAX = 65_536  # values remembered at the newest known version (emptied past this)
CATCH_UP_COMMITS_MAX = 256  # more commits by others since the cache's version: empty it instead
_MISS = object()
_LATEST = ("SELECT meta.version, meta.horizon, write_log.ranges FROM meta LEFT JOIN write_log "
           "ON write_log.version > ? AND write_log.version <= meta.version LIMIT ?")
SYNC_MODES = ("normal", "full")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kv (key BLOB NOT NULL, version INTEGER NOT NULL, value BLOB, "
    "PRIMARY KEY (key, version)) WITHOUT ROWID",
    # One row per commit, keyed by version: a commit adds one B-tree entry, not one per range plus an index.
    "CREATE TABLE IF NOT EXISTS write_log (version INTEGER PRIMARY KEY, ranges BLOB NOT NULL)",
    # One row: the version of the last commit and the GC horizon.
    "CREATE TABLE IF NOT EXISTS meta (id INTEGER PRIMARY KEY CHECK (id = 0), version INTEGER NOT NULL, "
    "horizon INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO meta VALUES (0, 0, 0)",
)
# One statement runs in one SQLite snapshot: the horizon is read in the same snapshot as the value.
_GET = (
    "SELECT (SELECT horizon FROM meta), "
    "(SELECT value FROM kv WHERE key = ? AND version <= ? ORDER BY version DESC LIMIT 1)"
)
# What the commits after the cache's version wrote, read by a commit under the write lock (catch-up).
_MISSED = "SELECT ranges FROM write_log WHERE version > ? AND version <= ? LIMIT ?"
_RANGES_ENCODER = msgspec.msgpack.Encoder()
_RANGES_DECODER = msgspec.msgpack.Decoder(list[tuple[bytes, bytes]])
_RANGE = "SELECT key, value FROM kv WHERE key >= ? AND key < ? AND version <= ? ORDER BY key {0}, version {0}"
_GC_DELETE = (
    "DELETE FROM kv WHERE key >= :begin AND key < :end AND version <= :horizon AND (value IS NULL OR EXISTS "
    "(SELECT 1 FROM kv AS newer WHERE newer.key = kv.key AND newer.version > kv.version "
    "AND newer.version <= :horizon))"
)


WAL_HEADER_BYTES = 48  # one copy of SQLite's WAL-index header (https://sqlite.org/walformat.html)
_CHANGE_COUNTER = slice(8, 12)  # its iChange: a native u32 that every commit increments by one
_shm_maps: dict[tuple[int, int], list] = {}  # (st_dev, st_ino) of a -shm file -> [fd, mmap, engines using it]
_shm_maps_lock = threading.Lock()


def _map_wal_index(db_path: str) -> tuple[tuple[int, int] | None, mmap.mmap | None]:
    """(key, the mapped WAL-index header) of an open WAL database, shared with the other engines of this
    process on the same file; the header is None when it cannot be mapped (the engine then asks SQLite every
    time), the key None when the file cannot be opened. Give a key back with _unmap_wal_index."""
    try:  # the file SQLite uses: beside the database file, symbolic links resolved (as SQLite resolves them)
        fd = os.open(os.path.realpath(db_path) + "-shm", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        log.info("SQLite KV %s: no WAL index to map (%s); the newest version comes from a query", db_path, exc)
        return None, None
    with _shm_maps_lock:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        shared = _shm_maps.get(key)
        if shared is not None:
            # Another engine's descriptor serves; ours goes at once (while that engine's connections are
            # open, closing it drops none of SQLite's locks).
            os.close(fd)
            shared[2] += 1
            return key, shared[1]
        view = None
        try:
            if st.st_size < 2 * WAL_HEADER_BYTES:
                raise OSError("the WAL index is not initialised")
            view = mmap.mmap(fd, 2 * WAL_HEADER_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            log.info("SQLite KV %s: cannot map the WAL index (%s); the newest version comes from a query",
                     db_path, exc)
        # Kept open even unmapped: the descriptor closes only after SQLite's connections (module docstring).
        _shm_maps[key] = [fd, view, 1]
        return key, view


def _wal_header(shm: mmap.mmap) -> bytes | None:
    """The WAL-index header now, or None while it is being rewritten (its two copies differ). Raises
    ValueError once the mapping is closed."""
    both = shm[:2 * WAL_HEADER_BYTES]
    first = both[:WAL_HEADER_BYTES]
    return first if first == both[WAL_HEADER_BYTES:] else None


def _unmap_wal_index(key: tuple[int, int]) -> None:
    """One engine on the file is done, its connections closed; the last one closes the mapping."""
    with _shm_maps_lock:
        shared = _shm_maps[key]
        shared[2] -= 1
        if shared[2] == 0:
            del _shm_maps[key]
            if shared[1] is not None:
                shared[1].close()
            os.close(shared[0])


def _newest_per_key(
    rows: Iterable[tuple[bytes, bytes | None]], newest_first: bool
) -> Iterator[tuple[bytes, bytes | None]]:
    """From rows grouped by key (versions ascending, or descending if `newest_first`), each key's newest row."""
    pending: tuple[bytes, bytes | None] | None = None
    for key, value in rows:
        if newest_first:
            if pending is None or key != pending[0]:
                pending = (key, value)
                yield pending
        else:
            if pending is not None and key != pending[0]:
                yield pending
            pending = (key, value)
    if not newest_first and pending is not None:
        yield pending


class SqliteEngine(KVEngine):
    """The KV in one SQLite file shared by any number of processes. `clock` (seconds) drives versions and the
    MVCC window; tests may fake it."""

    def __init__(self, path: str, *, sync: str = "normal", clock: Callable[[], float] = time.time,
                 window_s: float = MVCC_WINDOW_S):
        assert sync in SYNC_MODES, sync
        self.path = path
        self.clock = clock
        self.window_s = window_s
        self._lock = threading.Lock()  # one connection, shared by every transaction of this engine
        self._gc_next_s = 0.0
        self._conn: sqlite3.Connection | None = None
        self._cache: dict[bytes, bytes | None] = {}  # key -> value at _cache_version (see module docstring)
        self._cache_version = -1
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                         check_same_thread=False)
            self._setup(self._conn, sync)
        except (OSError, sqlite3.Error) as exc:
            if self._conn is not None:
                self._conn.close()
            raise status_error(StatusCode.KV_ERROR, f"cannot open SQLite KV {path}: {exc}") from exc
        self._checkpointer = _Checkpointer(path, sync)
        self._shm_key, self._shm = _map_wal_index(path)
        self._shm_known: tuple[bytes | None, int] = (None, -1)  # (header before the last query, its answer)

    @staticmethod
    def _setup(conn: sqlite3.Connection, sync: str) -> None:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        # Switching to WAL can fail with "locked" while another process creates the file, without waiting.
        deadline_s = time.monotonic() + BUSY_TIMEOUT_S
        while True:  # bounded by the deadline
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                break
            except sqlite3.OperationalError:
                if time.monotonic() > deadline_s:
                    raise
                time.sleep(0.01)
        if mode.lower() != "wal":
            raise sqlite3.OperationalError(f"journal_mode is {mode}, WAL is required (is it on a network FS?)")
        conn.execute(f"PRAGMA synchronous = {sync.upper()}")
        conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}")
        conn.execute("BEGIN IMMEDIATE")  # processes opening a new file at once create the schema one by one
        try:
            found = conn.execute("PRAGMA user_version").fetchone()[0]
            if found not in (0, FORMAT_VERSION):
                raise sqlite3.DatabaseError(f"file format {found} is not this version's {FORMAT_VERSION}")
            for statement in _SCHEMA:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def transaction(self) -> Transaction:
        if self._conn is None:
            raise status_error(StatusCode.KV_ERROR, f"SQLite KV {self.path} is closed")
        return LocalEngineTransaction(self)

    async def close(self) -> None:
        with self._lock:
            if self._conn is None:
                return
            self._conn.close()
            self._conn = None
            self._shm = None
        await asyncio.to_thread(self._checkpointer.stop)  # may wait for a checkpoint's fsync
        if self._shm_key is not None:  # after both our connections closed (module docstring)
            _unmap_wal_index(self._shm_key)
            self._shm_key = None

    @contextlib.contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        """The connection, under the lock, with SQLite errors turned into KV_ERROR."""
        with self._lock:
            if self._conn is None:
                raise status_error(StatusCode.KV_ERROR, f"SQLite KV {self.path} is closed")
            try:
                yield self._conn
            except sqlite3.Error as exc:
                raise status_error(StatusCode.KV_ERROR, f"SQLite KV {self.path}: {exc}") from exc

    # -- called by LocalEngineTransaction --------------------------------------------------------------------
    def latest_version(self) -> int:
        shm = self._shm
        if shm is not None:  # no commit finished since the last query: its answer stands (module docstring)
            known = self._shm_known
            try:
                head = _wal_header(shm)
                if head is not None and head == known[0]:
                    return known[1]
            except ValueError:  # closed under us: the statement below says so
                pass
        with self._connection() as conn:
            shm = self._shm
            # Read before the query: a commit that lands in between changes the header from this copy, so
            # the next call asks again; the query itself sees every commit this copy does. (A header being
            # rewritten is remembered as unknown: None.)
            head = _wal_header(shm) if shm is not None else None
            # One statement, so one snapshot: the newest version, the horizon, and what every commit since
            # the cache's version wrote (none: one row with NULL).
            since = self._cache_version if self._cache else 1 << 62  # nothing to forget: no log wanted
            rows = conn.execute(_LATEST, (since, CATCH_UP_COMMITS_MAX + 1)).fetchall()
            version, horizon = rows[0][0], rows[0][1]
            if version != self._cache_version:
                self._catch_up(version, horizon, [blob for _, _, blob in rows if blob is not None])
            if shm is not None:
                self._shm_known = (head, version)
            return version

    def _catch_up(self, version: int, horizon: int, logged: list[bytes]) -> None:
        """Others committed since the cache's version (lock held): forget what they wrote, keep the rest."""
        cache = self._cache
        if self._cache_version < horizon or len(logged) > CATCH_UP_COMMITS_MAX:
            cache.clear()  # the log of some of those commits may be gone: start over
        elif cache:
            for blob in logged:
                for begin, end in _RANGES_DECODER.decode(blob):
                    if end == begin + b"\x00":
                        cache.pop(begin, None)
                    else:
                        for key in [k for k in cache if begin <= k < end]:
                            del cache[key]
        self._cache_version = version

    def get_at(self, key: bytes, version: int) -> bytes | None:
        with self._lock:  # the hot path: no context manager of our own, the cache checked first
            cached = version == self._cache_version
            if cached:
                value = self._cache.get(key, _MISS)
                if value is not _MISS:
                    return value
            conn = self._conn
            if conn is None:
                raise status_error(StatusCode.KV_ERROR, f"SQLite KV {self.path} is closed")
            try:
                horizon, value = conn.execute(_GET, (key, version)).fetchone()
            except sqlite3.Error as exc:
                raise status_error(StatusCode.KV_ERROR, f"SQLite KV {self.path}: {exc}") from exc
            self._check_horizon(version, horizon)
            if cached:
                if len(self._cache) >= READ_CACHE_KEYS_MAX:
                    self._cache.clear()
                self._cache[key] = value
            return value

    def range_at(self, begin: bytes, end: bytes, version: int, limit: int, reverse: bool) -> list[tuple[bytes, bytes]]:
        with self._connection() as conn:
            cursor = conn.execute(_RANGE.format("DESC" if reverse else "ASC"), (begin, end, version))
            rows: list[tuple[bytes, bytes]] = []
            for key, value in _newest_per_key(cursor, newest_first=reverse):
                if value is not None:
                    rows.append((key, value))
                    if len(rows) == limit:  # never true for limit 0
                        break
            cursor.close()
            self._check_horizon(version, conn.execute("SELECT horizon FROM meta").fetchone()[0])
            return rows

    def commit(self, read_version: int | None, reads: list[Range], writes: WriteBuffer) -> int:
        with self._connection() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                last, horizon = conn.execute("SELECT version, horizon FROM meta").fetchone()
                # The WAL index's commit counter now: under the write lock, no other commit moves it.
                shm = self._shm
                counter = shm[_CHANGE_COUNTER] if shm is not None else None
                # Others committed since the cache's version: what they wrote, to forget it below (in this
                # snapshot, under the write lock) rather than the whole cache.
                since = self._cache_version
                missed = (conn.execute(_MISSED, (since, last, CATCH_UP_COMMITS_MAX + 1)).fetchall()
                          if last != since and self._cache and since >= horizon else None)
                if read_version is not None:
                    self._check_horizon(read_version, horizon)  # below it, needed log entries may be gone
                    if read_version != last:  # else nothing committed since our snapshot: no conflict
                        self._check_conflicts(conn, read_version, reads)
                version = max(last + 1, int(self.clock() * 1_000_000))
                self._apply(conn, version, writes)
                conn.execute("UPDATE meta SET version = ?", (version,))
                if self.clock() >= self._gc_next_s:
                    self._gc_next_s = self.clock() + GC_INTERVAL_S
                    self._collect_garbage(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            if missed is not None and self._cache_version == since:
                self._catch_up(last, horizon, [blob for (blob,) in missed])
            self._advance_cache(last, version, writes)
            if counter is not None:
                self._know_own_commit(shm, counter, version)
            return version

    def _know_own_commit(self, shm: mmap.mmap, counter: bytes, version: int) -> None:
        """After our COMMIT: if the header's commit counter moved by exactly one (ours; any other commit since
        would have moved it again), our version is the newest while the header stays as it is now."""
        try:
            head = _wal_header(shm)
        except ValueError:
            return
        if head is not None and (int.from_bytes(head[_CHANGE_COUNTER], sys.byteorder)
                                 == (int.from_bytes(counter, sys.byteorder) + 1) & 0xFFFFFFFF):
            self._shm_known = (head, version)

    def _advance_cache(self, last: int, version: int, writes: WriteBuffer) -> None:
        """After our commit at `version` (lock held): the cache, if it was of `last` (the version just before
        ours), becomes the cache of `version` with our writes applied; else it starts empty at `version`."""
        cache = self._cache
        if last != self._cache_version or writes.cleared or len(cache) + len(writes.ops) > READ_CACHE_KEYS_MAX:
            cache.clear()
        else:
            cache.update(writes.ops)  # a value, or None for a cleared key
        self._cache_version = version

    # -- internals (lock held) ------------------------------------------------------------------------------
    def _check_horizon(self, version: int, horizon: int) -> None:
        if version < horizon:
            raise status_error(StatusCode.KV_TOO_OLD, f"read version {version} is older than the MVCC horizon "
                               f"{horizon} ({self.window_s} s window); retry with a new transaction")

    def _check_conflicts(self, conn: sqlite3.Connection, read_version: int, reads: list[Range]) -> None:
        begins = [r[0] for r in reads]
        logged = conn.execute("SELECT version, ranges FROM write_log WHERE version > ?", (read_version,))
        for version, blob in logged:
            for begin, end in _RANGES_DECODER.decode(blob):
                hit = find_overlap(reads, begins, begin, end)
                if hit is not None:
                    raise KVConflictError(StatusCode.KV_CONFLICT, f"KV conflict: range [{hit[0][:64]!r}, "
                                          f"{hit[1][:64]!r}) read at version {read_version} was written by the "
                                          f"commit at version {version}")

    @staticmethod
    def _apply(conn: sqlite3.Connection, version: int, writes: WriteBuffer) -> None:
        for begin, end in writes.cleared:  # deletion markers for every key live in the range
            cursor = conn.execute(_RANGE.format("ASC"), (begin, end, version))
            live = [(key, version) for key, value in _newest_per_key(cursor, False) if value is not None]
            conn.executemany("INSERT INTO kv VALUES (?, ?, NULL)", live)
        # After the clears: a set issued after a clear_range replaces its marker (same key and version).
        conn.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?, ?)",
                         [(key, version, value) for key, value in writes.ops.items()])
        conn.execute("INSERT INTO write_log VALUES (?, ?)", (version, _RANGES_ENCODER.encode(writes.write_ranges())))

    def _collect_garbage(self, conn: sqlite3.Connection) -> None:
        cutoff = int((self.clock() - self.window_s) * 1_000_000)
        horizon = conn.execute(
            "SELECT max(version) FROM (SELECT version FROM write_log WHERE version <= ? ORDER BY version LIMIT ?)",
            (cutoff, GC_COMMITS_PER_PASS_MAX)).fetchone()[0]
        if horizon is None:
            return
        logged = conn.execute("SELECT ranges FROM write_log WHERE version <= ?", (horizon,))
        expired = coalesce(r for (blob,) in logged for r in _RANGES_DECODER.decode(blob))
        conn.executemany(_GC_DELETE, [{"begin": b, "end": e, "horizon": horizon} for b, e in expired])
        conn.execute("DELETE FROM write_log WHERE version <= ?", (horizon,))
        conn.execute("UPDATE meta SET horizon = ?", (horizon,))


class _Checkpointer:
    """The thread that checkpoints the WAL of one engine, with its own connection, until stop()."""

    def __init__(self, path: str, sync: str):
        self._path = path
        self._sync = sync
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kv-checkpoint {path}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        conn = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute(f"PRAGMA synchronous = {self._sync.upper()}")
            failing_since = None  # a failing checkpoint is logged once a minute, not ten times a second
            while not self._stop.wait(CHECKPOINT_INTERVAL_S):  # runs until stop()
                try:
                    # PASSIVE: copies what no reader still needs and never waits for or blocks a writer.
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    if failing_since is not None:
                        log.warning("SQLite KV %s: checkpoints work again", self._path)
                        failing_since = None
                except sqlite3.Error as exc:  # transient (e.g. busy); the autocheckpoint is the fallback
                    now = time.monotonic()
                    if failing_since is None or now - failing_since >= 60:
                        log.warning("SQLite KV %s: checkpoint failed: %s", self._path, exc)
                        failing_since = now
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        # The thread wakes at once; a checkpoint in progress is bounded by SQLite's busy timeout.
        self._thread.join(BUSY_TIMEOUT_S + CHECKPOINT_INTERVAL_S)
        if self._thread.is_alive():
            log.warning("SQLite KV %s: checkpoint thread still running after stop", self._path)


async def open_sqlite(url: str) -> KVEngine:
    """`sqlite:///abs/path/kv.db[?sync=normal|full]`: the file and its parent directories are created if missing."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc or not parts.path.startswith("/"):
        raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"KV URL {url!r} needs an absolute path: "
                           f"sqlite:///abs/path/kv.db")
    options = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(options) - {"sync"})
    sync = options.get("sync", ["normal"])[-1].lower()
    if unknown or sync not in SYNC_MODES:
        raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"KV URL {url!r}: the only option is "
                           f"sync={'|'.join(SYNC_MODES)}")
    return SqliteEngine(urllib.parse.unquote(parts.path), sync=sync)
