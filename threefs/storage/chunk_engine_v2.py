"""Chunk engine v2: size-classed blocks in long-lived data files, chunk metadata in SQLite (WAL).

Same interface and semantics as `chunk_engine.ChunkEngine` (v1; the chunk-store conformance suite runs on
both): one committed and at most one pending version per chunk, pending versions logged before a write
returns, commit the atomic switch. docs/chunk-engine.md has the design, the on-disk format, the durability
policy and measured figures. In short::

    LOCK                     flock()ed while open (the same file v1 locks: one engine per target)
    meta.sqlite (+ -wal)     SQLite in WAL mode: tables `info`, `chunks`, `groups`
    blocks/c<kk>.<fff>       data file fff of size class kk (block size BLOCK_MIN << kk)

Size classes: 512 B .. 64 MiB (18 classes); a version of length L lives in the smallest block >= L
(length 0 takes no block). Blocks come in groups of 256 with a 256-bit bitmap per group (table `groups`,
updated in the same SQLite transaction as the chunk rows that take or free the blocks); groups go round-robin
into FILES_PER_CLASS files per class, a file grows with fallocate one group at a time (classes whose group
would exceed 64 MiB fallocate one block at a time). The lowest group with a free block is used first.

Updates (a pending version never changes bytes the committed version or a reader may use):
  * new chunk, full replace, a write covering everything: a new block;
  * write / zero-extend at or past the committed length that still fits the block: in place, in the
    committed block's tail (CRC continued from the committed one: O(bytes written));
  * write strictly inside the committed bytes (at most half of them): an *overlay* - the bytes go to a
    small block of their own and the pending version is (committed block, overlay). Commit switches the
    metadata, then folds the overlay into the committed block (a pwrite of the written bytes: readers take
    that range from the overlay until the fold's metadata is persisted, so they never see a mix) and frees
    the overlay with the next metadata transaction. The per-chunk CRC32C is patched from the bytes
    replaced (`crc_math.patch`): the whole write is O(bytes written);
  * anything else (shrink, a write that straddles the end, growth past the block): copy-on-write to a new
    block (O(chunk size)).
Freed blocks are not reused while a read that looked them up may still run (epochs of in-flight reads).

Crash safety: blocks taken by an unfinished write are not in any persisted bitmap, so a restart frees them;
a commit whose overlay was not folded yet is folded again at start-up (idempotent).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import heapq
import logging
import os
import sqlite3
import struct
import threading
import time
from contextlib import contextmanager

import msgspec

from threefs.common import crc32c
from threefs.common.limits import CHUNK_SIZE_BYTES_MAX, MiB
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.storage import crc_math
from threefs.storage.chunk_state import (
    ChunkMeta,
    as_byte_view as _as_byte_view,
    check_chunk_id as _check_chunk_id,
    check_extent as _check_extent,
    check_update as _check_update,
    crc_zeros as _crc_zeros,
    pwritev_all,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
BLOCK_MIN = 512
CLASSES = 18  # 512 B << 17 = 64 MiB
assert BLOCK_MIN << (CLASSES - 1) == CHUNK_SIZE_BYTES_MAX
GROUP_BLOCKS = 256
FILES_PER_CLASS_DEFAULT = 16
GROUP_FALLOCATE_MAX = 64 * MiB  # bigger groups are fallocated one block at a time
IO_PIECE = 4 * MiB  # bounds buffers of copies, verify and migration
DIRECT_ALIGN = 4096  # O_DIRECT reads (read_direct): buffer address, file offset and length multiples of this
JOURNAL_FLUSH_RECORDS = 4096  # the journal is flushed into SQLite (one transaction) past this many records
JOURNAL_FLUSH_BYTES = 2 * MiB  # ... or bytes (it is replayed at start-up: this bounds that time)
_JHEAD = struct.Struct("<II")  # journal record: payload length, CRC32C of the payload
JOURNAL_FILES = ("journal", "journal.1")  # appends go to one; the other holds records a flush is writing
INLINE_ZERO_FILL_MAX = MiB // 16  # an inline write (see `inline`) zero-fills at most this much before its bytes
JOURNAL_FORCE_FACTOR = 4  # past this many times the limit, an update flushes inline (flushes fail or lag)
CACHE_MAX = 1 << 18  # chunk states kept in memory (write-through; cleared when full)
METADATA_HEADROOM = 4 * MiB  # data may not take the last bytes: commits and removals must still fit
FREE_RECHECK_BYTES = 256 * MiB  # statvfs before each fallocate only this close to the headroom ...
FREE_RECHECK_S = 1.0  # ... or when the last answer is older than this
_ZEROS = memoryview(bytes(1 * MiB))
RWF_DONTCACHE = getattr(os, "RWF_DONTCACHE", 0x80)  # Linux 6.14 (Python 3.11 does not name it)
_FULL = (1 << GROUP_BLOCKS) - 1
_BLOCK_MASK = (1 << 40) - 1
_MISSING = object()


# Below this many bytes a crc32c of the data costs less than combining a known one in Python (crc_math.shift:
# ~6.6 us here, against ~4.5 us for a crc32c of 64 KiB)
CRC_COMBINE_BYTES_MIN = 256 * 1024


def _crc_after(crc: int, prefix: int, view, data_crc: int | None) -> int:
    """crc32c of (`prefix` bytes whose crc32c is `crc`) followed by `view`, whose own crc32c is `data_crc`
    (or None: unknown). A known crc32c is used as it is after an empty prefix and combined (crc_math) after
    a non-empty one when `view` is long enough for that to pay; otherwise `view` is read."""
    if data_crc is not None:
        if prefix == 0:
            return data_crc
        if len(view) >= CRC_COMBINE_BYTES_MIN:
            return crc_math.shift(crc, len(view)) ^ data_crc
    return crc32c.crc32c(view, value=crc)


def block_size(cls: int) -> int:
    return BLOCK_MIN << cls


def _per_block(cls: int) -> bool:
    """Classes whose group would exceed GROUP_FALLOCATE_MAX are fallocated one block at a time."""
    return block_size(cls) * GROUP_BLOCKS > GROUP_FALLOCATE_MAX


def class_for(length: int) -> int:
    """The smallest class whose block holds `length` bytes (length >= 1)."""
    return max(0, (length - 1).bit_length() - (BLOCK_MIN.bit_length() - 1))


# A block position: class, file, block index in the file. The group id is pos >> 8.
def make_pos(cls: int, file: int, block: int) -> int:
    return (cls << 56) | (file << 40) | block


def pos_class(pos: int) -> int:
    return pos >> 56


def pos_file(pos: int) -> int:
    return (pos >> 40) & 0xFFFF


def pos_block(pos: int) -> int:
    return pos & ((1 << 40) - 1)


def pos_str(pos: int) -> str:
    return f"class {pos_class(pos)} ({block_size(pos_class(pos))} B) file {pos_file(pos)} block {pos_block(pos)}"


class Pending(msgspec.Struct, frozen=True, gc=False):
    update_ver: int
    chain_ver: int
    length: int
    crc: int
    pos: int | None  # base block (None: length 0 or a removal)
    ov: tuple | None  # (offset, length, pos) of an overlay on the base block
    remove: bool
    last_request: bytes


class State(msgspec.Struct, frozen=True, gc=False):
    """One chunk: committed version (commit_ver 0: never committed) plus the pending one."""

    chain_ver: int
    commit_ver: int
    length: int
    crc: int
    pos: int | None
    ov: tuple | None  # only between a commit and its fold
    last_request: bytes
    p: Pending | None


def blocks_of(st: State | None) -> set[int]:
    out: set[int] = set()
    if st is None:
        return out
    for pos, ov in ((st.pos, st.ov), (st.p.pos, st.p.ov) if st.p is not None else (None, None)):
        if pos is not None:
            out.add(pos)
        if ov is not None:
            out.add(ov[2])
    return out


def make_meta(chunk_id: bytes, st: State) -> ChunkMeta:
    p = st.p
    if p is None:
        return ChunkMeta(chunk_id, st.chain_ver, st.commit_ver, st.commit_ver, st.length, st.crc, st.length,
                         st.crc, False, st.last_request)
    plen, pcrc = (0, 0) if p.remove else (p.length, p.crc)
    return ChunkMeta(chunk_id, st.chain_ver, p.update_ver, st.commit_ver, st.length, st.crc, plen, pcrc, p.remove,
                     p.last_request)


_COLUMNS = ("id, chain_ver, commit_ver, length, crc, pos, ov_off, ov_len, ov_pos, last_request, "
            "p_update_ver, p_chain_ver, p_length, p_crc, p_pos, p_ov_off, p_ov_len, p_ov_pos, p_remove, "
            "p_last_request")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS info (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS chunks (id BLOB PRIMARY KEY, chain_ver INT, commit_ver INT, length INT, crc INT,
    pos INT, ov_off INT, ov_len INT, ov_pos INT, last_request BLOB, p_update_ver INT, p_chain_ver INT,
    p_length INT, p_crc INT, p_pos INT, p_ov_off INT, p_ov_len INT, p_ov_pos INT, p_remove INT,
    p_last_request BLOB) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS groups (gid INTEGER PRIMARY KEY, bits BLOB NOT NULL);
"""
_UPSERT = f"INSERT OR REPLACE INTO chunks ({_COLUMNS}) VALUES ({', '.join('?' * 20)})"


def _ov(off, length, pos):
    return None if pos is None else (off, length, pos)


def row_to_state(row) -> State:
    p = None
    if row[10] is not None:
        p = Pending(row[10], row[11], row[12], row[13], row[14], _ov(row[15], row[16], row[17]), bool(row[18]),
                    row[19])
    return State(row[1], row[2], row[3], row[4], row[5], _ov(row[6], row[7], row[8]), row[9], p)


def state_to_row(chunk_id: bytes, st: State) -> tuple:
    ov = st.ov or (None, None, None)
    p = st.p
    if p is None:
        prow = (None,) * 10
    else:
        pov = p.ov or (None, None, None)
        prow = (p.update_ver, p.chain_ver, p.length, p.crc, p.pos, *pov, int(p.remove), p.last_request)
    return (chunk_id, st.chain_ver, st.commit_ver, st.length, st.crc, st.pos, *ov, st.last_request, *prow)


def _sql_error(exc: sqlite3.Error, path: str) -> ThreeFSError:
    text = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and ("full" in text or "disk" in text and "space" in text):
        return status_error(StatusCode.NO_SPACE, f"target {path} is full: metadata update failed: {text}")
    return status_error(StatusCode.IO_ERROR, f"target {path}: metadata store error: {text}")


def _os_error(exc: OSError, message: str) -> ThreeFSError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return status_error(StatusCode.NO_SPACE, f"{message}: disk is full ({exc.strerror})")
    return status_error(StatusCode.IO_ERROR, f"{message}: {exc.strerror or exc}")


def read_journal(path: str) -> tuple[list, int]:
    """The whole records of a journal file ([seq, chunk id, row or None], in order) and the byte offset
    where they end (a torn or damaged record ends the journal)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return [], 0
    out, at, view = [], 0, memoryview(data)
    while at + _JHEAD.size <= len(data):
        length, crc = _JHEAD.unpack_from(data, at)
        payload = view[at + _JHEAD.size: at + _JHEAD.size + length]
        if len(payload) != length or crc32c.crc32c(payload) != crc:
            break
        try:
            out.append(msgspec.msgpack.decode(payload))
        except msgspec.DecodeError:
            break
        at += _JHEAD.size + length
    return out, at


def read_journals(target: str) -> list:
    """The whole records of both journal files of a target, in sequence order."""
    out: list = []
    for name in JOURNAL_FILES:
        out += read_journal(os.path.join(target, name))[0]
    out.sort(key=lambda r: r[0])
    return out


def committed_position(target: str, chunk_id: bytes) -> tuple[int, int] | None:
    """(block position, committed length) of a chunk's committed bytes, read from outside the engine
    (tests that damage bytes on purpose, while the storage service runs): the journal first, then SQLite
    read-only; a journal record newer than SQLite's applied_seq wins (this order is right whatever
    flushes run between the two reads). None: no committed bytes."""
    records = read_journals(target)
    db = sqlite3.connect(f"file:{os.path.join(target, 'meta.sqlite')}?mode=ro", uri=True, timeout=10)
    try:
        applied = db.execute("SELECT value FROM info WHERE key = 'applied_seq'").fetchone()
        row = db.execute(f"SELECT {_COLUMNS} FROM chunks WHERE id = ?", (chunk_id,)).fetchone()
    finally:
        db.close()
    applied = int(applied[0]) if applied else 0
    st = None if row is None else row_to_state(row)
    for seq, cid, jrow in records:
        if seq > applied and cid == chunk_id:
            st = None if jrow is None else row_to_state(jrow)
    if st is None or not st.commit_ver or st.pos is None:
        return None
    return st.pos, st.length


class _Reader:
    """Epochs of in-flight reads: a block freed at epoch E is reused only when no read that started at
    an epoch <= E still runs (it may have looked the block up before the free)."""

    def __init__(self):
        self.epoch = 0
        self.active: dict[int, int] = {}

    def enter(self) -> int:
        e = self.epoch
        self.active[e] = self.active.get(e, 0) + 1
        return e

    def leave(self, e: int) -> None:
        n = self.active[e] - 1
        if n:
            self.active[e] = n
        else:
            del self.active[e]

    def oldest(self) -> int | None:
        return min(self.active) if self.active else None


def _chunk_op(fn):
    """An update of one chunk. Updates of one chunk run one at a time, and never during compaction's
    move of that chunk. The engine enforces this itself, whatever its callers do: an update builds its
    new state on the state it read first (`_drop_pending` ... `_install`), so two at once would let the
    later one put back a committed block the earlier one freed - a block the allocator then gives to
    another chunk, whose bytes overwrite it (a committed chunk failing its checksum, the commit in between
    lost). That happened in the storage service when a request's task was cancelled while its engine call
    still ran in a disk thread, and the retry took the chunk lock (the 30-minute soak, two chunks)."""
    @functools.wraps(fn)
    def run(self, chunk_id, *args, **kwargs):
        if not isinstance(chunk_id, bytes):
            return fn(self, chunk_id, *args, **kwargs)  # refused by its checks
        inline = self._inline_now()
        with self._lock:
            while chunk_id in self._moving or chunk_id in self._busy:
                if inline:  # an event loop's thread never waits here: the caller hands it to a thread
                    raise BlockingIOError(f"chunk {chunk_id.hex()} is busy")
                self._waiters += 1
                try:
                    self._moved.wait()
                finally:
                    self._waiters -= 1
            self._busy[chunk_id] = 1
        try:
            result = fn(self, chunk_id, *args, **kwargs)
            self._durable()  # fsync: the journal on disk up to this update's records (group commit)
            if not inline:  # inline: the caller has a thread flush (flush_due, flush_owed)
                self._flush_owed()  # a flush this update owes, outside the engine lock
            return result
        finally:
            with self._lock:
                del self._busy[chunk_id]
                if self._waiters:
                    self._moved.notify_all()

    return run


class ChunkEngineV2:
    """The chunks of one storage target, stored under `path` (see the module docstring)."""

    engine_version = 2

    def __init__(self, path: str, *, fsync: bool = False, files_per_class: int = FILES_PER_CLASS_DEFAULT,
                 migrate: bool = True, write_cache: bool = True):
        """Open or create a v2 target. A v1 target (meta.log) is migrated in place when `migrate`
        (resumable: a killed migration continues at the next open), else refused with a message.
        `write_cache` False: data is written with RWF_DONTCACHE (its pages leave the page cache once
        written back), where the kernel and file system have it."""
        self.path = os.path.abspath(path)
        self._fsync = fsync
        self._wflags = 0 if write_cache else RWF_DONTCACHE
        self._lock = threading.Lock()
        self._moved = threading.Condition(self._lock)
        self._busy: dict[bytes, int] = {}  # chunks with an update running (one at a time per chunk)
        self._waiters = 0  # threads waiting in _chunk_op
        self._moving: set[bytes] = set()  # chunks compaction is moving
        self._local = threading.local()  # .inline: this thread runs updates inline (see `inline`)
        self._closed = True
        os.makedirs(self.path, exist_ok=True)
        self._lock_fd = _lock_target(self.path)
        try:
            v1 = os.path.exists(os.path.join(self.path, "meta.log"))
            if v1 and not migrate:
                raise status_error(StatusCode.INVALID_ARGUMENT, (
                    f"target {self.path} holds a v1 chunk engine (meta.log); run `threefs admin target-migrate "
                    f"{self.path}` with the storage service stopped, or set chunk_engine = \"v1\""))
            from threefs.storage.engine_migrate import finish_cleanup
            finish_cleanup(self.path)  # a migration killed while deleting v1's files
            self._open(files_per_class)
            if v1:
                from threefs.storage.engine_migrate import migrate_v1
                migrate_v1(self)
        except BaseException:
            self._close_files()
            os.close(self._lock_fd)
            raise

    # -- opening ---------------------------------------------------------------------------------
    def _open(self, files_per_class: int) -> None:
        self._block_dir = os.path.join(self.path, "blocks")
        os.makedirs(self._block_dir, exist_ok=True)
        self._fds: dict[tuple[int, int], int] = {}
        self._direct_fds: dict[int, int] = {}  # data file fd -> its O_DIRECT descriptor, or -1 (read_direct)
        self._db = self._wdb = None
        self._journal_fd = self._retired_fd = None
        # Two connections: `_db` reads (under the engine lock), `_wdb` writes: the flushes, which take
        # `_flush_mutex` (always before the engine lock) and write SQLite outside the engine lock (WAL: the
        # reads go on meanwhile and see the last committed flush).
        self._flush_mutex = threading.Lock()
        db = sqlite3.connect(os.path.join(self.path, "meta.sqlite"), isolation_level=None, check_same_thread=False)
        self._db = db
        db.execute("PRAGMA journal_mode=WAL")
        db.executescript(_SCHEMA)
        self._wdb = sqlite3.connect(os.path.join(self.path, "meta.sqlite"), isolation_level=None,
                                    check_same_thread=False, timeout=60)
        self._wdb.execute(f"PRAGMA synchronous={'FULL' if self._fsync else 'NORMAL'}")
        self._wdb.execute("PRAGMA wal_autocheckpoint=256")  # the WAL stays near 1 MiB (it fits the headroom)
        info = dict(db.execute("SELECT key, value FROM info"))
        if not info:
            db.execute("BEGIN")
            db.executemany("INSERT INTO info VALUES (?, ?)", [("format", FORMAT_VERSION),
                                                              ("files_per_class", files_per_class)])
            db.execute("COMMIT")
            info = {"format": FORMAT_VERSION, "files_per_class": files_per_class}
        if info["format"] != FORMAT_VERSION:
            raise status_error(StatusCode.IO_ERROR, f"target {self.path}: unknown v2 format {info['format']}")
        self.files_per_class = int(info["files_per_class"])
        self._batch = 0
        self._cache: dict[bytes, State | None] = {}  # states as SQLite holds them
        self._metas: dict[bytes, tuple[State, ChunkMeta]] = {}  # ChunkMeta of a state (reads answer it)
        self._locs: dict[bytes, tuple[State, tuple | bool]] = {}  # read_locations of a state
        self._dirty: dict[bytes, tuple[State | None, State | None]] = {}  # (in SQLite, now): journaled only
        self._touched: set[int] = set()  # groups whose bitmap changed since the last flush
        self._reader = _Reader()
        self._limbo: list[tuple[int, int, list[int]]] = []  # (epoch freed, journal seq of the free, blocks)
        # folds begun (see _fold): a read of a committed block compares it before and after, and reads again
        # if a fold may have written into the block meanwhile
        self.folds = 0
        self._sync_lock = threading.Lock()
        self._count_unsaved = "chunk_count" not in info  # a target written before the count was kept
        self._seq = self._applied_seq = int(info.get("applied_seq", 0))
        self._synced_seq = self._seq
        self._journal_records = self._journal_bytes = 0
        self._retired_dirty = False  # the retired journal file holds records not yet in SQLite
        self._flush_due = False  # the journal is past its limit: the next update ends with a flush
        self._replaying = False
        self._free_known = (0, 0.0)  # (free bytes of the file system, when statvfs said so) minus fallocations
        # the chunk count is kept in `info` by every flush (opening a big target must not scan it)
        self._count = int(info["chunk_count"]) if "chunk_count" in info else \
            db.execute("SELECT count(*) FROM chunks").fetchone()[0]
        self._load_groups()
        self._replay_journal()
        self._closed = False
        self._redo_folds()

    def _replay_journal(self) -> None:
        """Apply the journals' records newer than SQLite's `applied_seq` (a torn last record, from a crash
        in the middle of its write, ends a journal file), flush them into SQLite, empty the journals."""
        fds, records = [], []
        for name in JOURNAL_FILES:
            path = os.path.join(self.path, name)
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644))
            if self._journal_fd is None:
                self._journal_fd = fds[0]
            else:
                self._retired_fd = fds[1]
            found, good = read_journal(path)
            if good < os.fstat(fds[-1]).st_size:
                log.warning("target %s: %s ends in a torn record at byte %d (a crash while it was written); "
                            "it is dropped (that update had not returned)", self.path, name, good)
            records += found
        records.sort(key=lambda r: r[0])
        self._retired_dirty = True  # (until the flush below empties both)
        replayed = 0
        self._replaying = True
        try:
            for seq, chunk_id, row in records:
                if seq <= self._applied_seq:
                    continue
                self._seq = max(self._seq, seq)
                self._apply(chunk_id, self._get(chunk_id), None if row is None else row_to_state(row))
                replayed += 1
        finally:
            self._replaying = False
        self._synced_seq = self._seq
        if replayed:
            log.info("target %s: replayed %d journal records", self.path, replayed)
        self._flush()
        self._empty_journals()
        if replayed:
            self._load_groups()  # the allocator's view from the bitmaps just written

    def _load_groups(self) -> None:
        self._db_bits: dict[int, int] = {}  # gid -> bitmap of blocks that chunk states own (SQLite + journal)
        self._mem_bits: dict[int, int] = {}  # + blocks being written, freed blocks readers may still use
        self._ready: set[int] = set()  # groups known fallocated (classes fallocated a group at a time)
        self._ready_blocks: dict[int, int] = {}  # gid -> bitmap of blocks known fallocated (bigger classes)
        self._free_heap: list[list[int]] = [[] for _ in range(CLASSES)]
        self._groups_per_file: dict[tuple[int, int], int] = {}
        for gid, bits in self._db.execute("SELECT gid, bits FROM groups"):
            b = int.from_bytes(bits, "little")
            self._db_bits[gid] = self._mem_bits[gid] = b
            cls, file, group = gid >> 48, (gid >> 32) & 0xFFFF, gid & 0xFFFFFFFF
            key = (cls, file)
            self._groups_per_file[key] = max(self._groups_per_file.get(key, 0), group + 1)
            if b != _FULL:
                heapq.heappush(self._free_heap[cls], gid)
            if b and not _per_block(cls):
                self._ready.add(gid)
            elif b:
                self._ready_blocks[gid] = b
        for name in os.listdir(self._block_dir):
            try:
                cls, file = name[1:].split(".")
                key = (int(cls), int(file))
            except ValueError:
                continue
            self._groups_per_file.setdefault(key, 0)
        for cls, file in self._groups_per_file:
            self._fd(cls, file)

    def _redo_folds(self) -> None:
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM chunks WHERE ov_pos IS NOT NULL").fetchall()
        for row in rows:
            st = row_to_state(row)
            self._fold(row[0], st)
        if rows:
            log.info("target %s: folded %d overlays of commits a crash interrupted", self.path, len(rows))
            with self._flush_mutex, self._lock:
                self._flush()

    def _fd(self, cls: int, file: int) -> int:
        fd = self._fds.get((cls, file))
        if fd is None:
            path = os.path.join(self._block_dir, f"c{cls:02d}.{file:03d}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            # No kernel read-ahead: the next block of a data file belongs to another chunk, so read-ahead
            # past the bytes asked for reads (and caches) unrelated data. Measured: a buffered read of a
            # whole 1 MiB chunk also cached all of the next block (read_ahead_kb 8192 here); 200 cold
            # reads of whole chunks read 166 MiB from disk with read-ahead, the 142 MiB asked without, in
            # the same time. Reads still get every byte they ask for in one go.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._fds[(cls, file)] = fd
        return fd

    def _close_files(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
        for fd in getattr(self, "_direct_fds", {}).values():
            if fd >= 0:
                os.close(fd)
        self._direct_fds = {}
        for name in ("_journal_fd", "_retired_fd"):
            if getattr(self, name, None) is not None:
                os.close(getattr(self, name))
                setattr(self, name, None)
        for name in ("_db", "_wdb"):
            if getattr(self, name, None) is not None:
                getattr(self, name).close()

    def close(self) -> None:
        """Persist deferred metadata, close the files and unlock the target. Idempotent."""
        with self._flush_mutex, self._lock:
            if self._lock_fd is None:
                return
            if not self._closed:  # (closed but not released: a failed batch; its memory is not persisted)
                try:
                    self._flush()
                except ThreeFSError as exc:
                    log.warning("target %s: journal not flushed into SQLite at close (start-up replays it): %s",
                                self.path, exc)
            self._closed = True
            lock_fd, self._lock_fd = self._lock_fd, None
        self._close_files()
        os.close(lock_fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise status_error(StatusCode.TARGET_OFFLINE, f"chunk engine of target {self.path} is closed")

    # -- state -----------------------------------------------------------------------------------
    def _get(self, chunk_id: bytes) -> State | None:
        """Caller holds the lock."""
        dirty = self._dirty.get(chunk_id)
        if dirty is not None:
            return dirty[1]
        try:
            return self._cache[chunk_id]
        except KeyError:
            pass
        # fetchall steps the statement to its end, which ends its read transaction at once: a statement
        # left open would pin this connection to an old snapshot while flushes commit on the writer's
        rows = self._db.execute(f"SELECT {_COLUMNS} FROM chunks WHERE id = ?", (chunk_id,)).fetchall()
        st = row_to_state(rows[0]) if rows else None
        if len(self._cache) >= CACHE_MAX:
            self._cache.clear()
        self._cache[chunk_id] = st
        return st

    def _apply(self, chunk_id: bytes, old: State | None, new: State | None) -> None:
        """Make `new` the chunk's state (caller holds the lock): the journal record first (one append;
        this is the update's durability point), then memory. Blocks the old state owned and the new one
        does not are freed once no read can still use them. Raises (nothing changed) if the append fails."""
        if not self._batch and not self._replaying:
            self._journal(chunk_id, new)
        before, after = blocks_of(old), blocks_of(new)
        bits = self._db_bits
        for pos in after - before:
            gid = pos >> 8
            bits[gid] = bits.get(gid, 0) | (1 << (pos & 0xFF))
            self._touched.add(gid)
        freed = before - after
        for pos in freed:
            gid = pos >> 8
            bits[gid] = bits.get(gid, 0) & ~(1 << (pos & 0xFF))
            self._touched.add(gid)
        entry = self._dirty.get(chunk_id)
        self._dirty[chunk_id] = (entry[0] if entry is not None else old, new)
        self._count += (new is not None) - (old is not None)
        if freed and not self._replaying:
            self._limbo.append((self._reader.epoch, self._seq, list(freed)))
            self._reader.epoch += 1
            self._release_limbo()

    def _journal(self, chunk_id: bytes, new: State | None) -> None:
        seq = self._seq + 1
        payload = msgspec.msgpack.encode((seq, chunk_id, None if new is None else state_to_row(chunk_id, new)))
        record = _JHEAD.pack(len(payload), crc32c.crc32c(payload)) + payload
        try:
            written = os.write(self._journal_fd, record)
        except OSError as exc:
            raise _os_error(exc, f"target {self.path}: metadata journal append failed") from exc
        if written != len(record):  # a full disk: cut the partial record so that the journal stays whole
            os.ftruncate(self._journal_fd, os.fstat(self._journal_fd).st_size - written)
            raise status_error(StatusCode.NO_SPACE, f"target {self.path} is full: metadata journal append failed")
        self._seq = seq
        self._journal_records += 1
        self._journal_bytes += len(record)

    def _set(self, chunk_id: bytes, old: State | None, new: State | None) -> None:
        """A state change (caller holds the lock). When the journal is long, the update that made it so
        flushes it into SQLite once it has let go of the lock (`_flush_soon`), so reads and other
        updates go on meanwhile; only far past the limit (flushes failing or lagging) inline."""
        self._apply(chunk_id, old, new)
        if not self._batch and (self._journal_records >= JOURNAL_FLUSH_RECORDS
                                or self._journal_bytes >= JOURNAL_FLUSH_BYTES):
            self._flush_due = True
            if not self._inline_now() and ((self._journal_records >= JOURNAL_FORCE_FACTOR * JOURNAL_FLUSH_RECORDS
                 or self._journal_bytes >= JOURNAL_FORCE_FACTOR * JOURNAL_FLUSH_BYTES)
                    and self._flush_mutex.acquire(blocking=False)):
                try:
                    self._flush()
                except ThreeFSError as exc:  # the journal holds it all; a later flush retries
                    log.warning("target %s: journal flush into SQLite failed (retried later): %s", self.path, exc)
                finally:
                    self._flush_mutex.release()

    def _flush_owed(self) -> None:
        """`_flush_soon`, whose failure fails nothing: the update that owed it is done and journaled, and
        the journal files still hold whatever the flush did not write (a later flush writes it)."""
        try:
            self._flush_soon()
        except (ThreeFSError, OSError) as exc:
            log.warning("target %s: journal flush into SQLite failed (retried later): %s", self.path, exc)

    def _flush_soon(self) -> None:
        """The flush an update owes (`_flush_due`), written to SQLite outside the engine lock. Caller
        holds no lock. Under the lock: the journaled states are taken as they are and appends move to
        the other journal file; outside it: one SQLite transaction of them; under the lock again: states
        not changed since become cached ones, and the retired journal file is emptied. A kill at any point
        leaves every record either in SQLite (applied_seq) or in a journal file start-up replays."""
        if not self._flush_due or not self._flush_mutex.acquire(blocking=False):
            return  # nothing owed, or a flush runs (the next update checks again)
        try:
            with self._lock:
                if self._closed or self._batch or not self._flush_due:
                    return
                self._flush_due = False
                if self._retired_dirty:  # an earlier flush failed: both files hold records; flush it all
                    try:
                        self._flush()
                    except ThreeFSError as exc:
                        self._flush_due = True
                        log.warning("target %s: journal flush into SQLite failed (retried later): %s", self.path,
                                    exc)
                    return
                snap = dict(self._dirty)
                touched = {gid: self._db_bits.get(gid, 0) for gid in self._touched}
                self._touched = set()
                seq, count = self._seq, self._count
                self._journal_fd, self._retired_fd = self._retired_fd, self._journal_fd
                self._retired_dirty = True
                self._journal_records = self._journal_bytes = 0
            try:
                self._write_store(snap, touched, seq, count)
            except ThreeFSError as exc:
                with self._lock:
                    self._touched |= touched.keys()
                    self._flush_due = True
                log.warning("target %s: journal flush into SQLite failed (retried later): %s", self.path, exc)
                return
            with self._lock:
                dirty, cache = self._dirty, self._cache
                if len(cache) + len(snap) >= CACHE_MAX:
                    cache.clear()
                for c, (_, new) in snap.items():
                    now = dirty[c]  # (only flushes remove entries, and this one holds the flush mutex)
                    if now[1] is new:
                        del dirty[c]
                        cache[c] = new
                    else:
                        dirty[c] = (new, now[1])  # SQLite holds `new` now
                self._applied_seq = seq
                self._count_unsaved = False
                os.ftruncate(self._retired_fd, 0)  # its records are all <= applied_seq
                self._retired_dirty = False
                self._synced_seq = max(self._synced_seq, seq)  # SQLite synced them (FULL)
        finally:
            self._flush_mutex.release()

    def _durable(self) -> None:
        """With fsync, the journal on disk up to the caller's record (group commit: one fdatasync covers
        every record appended before it started). Caller does not hold the lock."""
        if not self._fsync:
            return
        mine = self._seq
        with self._sync_lock:
            if self._synced_seq >= mine:
                return
            upto = self._seq
            try:  # both files: a flush may have moved appends to the other one since our record
                for fd in (self._journal_fd, self._retired_fd):
                    os.fdatasync(fd)
            except OSError as exc:
                raise _os_error(exc, f"target {self.path}: metadata journal sync failed") from exc
            self._synced_seq = max(self._synced_seq, upto)
        with self._lock:
            self._release_limbo()

    def _write_store(self, dirty: dict, touched: dict, seq: int, count: int) -> None:
        """One SQLite transaction (the writer connection; caller holds the flush mutex): the states of
        `dirty` ({chunk: (state SQLite holds, new state)}), the group bitmaps `touched`, applied_seq and
        the chunk count. On failure SQLite is unchanged."""
        db = self._wdb
        try:
            db.execute("BEGIN")
            puts = [state_to_row(c, new) for c, (_, new) in dirty.items() if new is not None]
            if puts:
                db.executemany(_UPSERT, puts)
            dels = [(c,) for c, (old, new) in dirty.items() if new is None and old is not None]
            if dels:
                db.executemany("DELETE FROM chunks WHERE id = ?", dels)
            if touched:
                db.executemany("INSERT OR REPLACE INTO groups VALUES (?, ?)",
                               [(gid, bits.to_bytes(32, "little")) for gid, bits in touched.items()])
            db.execute("INSERT OR REPLACE INTO info VALUES ('applied_seq', ?)", (seq,))
            db.execute("INSERT OR REPLACE INTO info VALUES ('chunk_count', ?)", (count,))
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise _sql_error(exc, self.path) from exc

    def _empty_journals(self) -> None:
        for fd in (self._journal_fd, self._retired_fd):
            if fd is not None:
                os.ftruncate(fd, 0)  # records up to applied_seq are skipped if this is lost
        self._retired_dirty = False
        self._journal_records = self._journal_bytes = 0

    def _flush(self) -> None:
        """Write every journaled state into SQLite in one transaction, then empty both journal files
        (caller holds the flush mutex, then the lock; or is opening the engine). On failure SQLite is
        unchanged and the journals still hold everything."""
        if not self._dirty and not self._touched and not self._count_unsaved:
            return
        self._write_store(self._dirty, {gid: self._db_bits.get(gid, 0) for gid in self._touched}, self._seq,
                          self._count)
        self._applied_seq = self._seq
        self._count_unsaved = False
        self._flush_due = False
        if len(self._cache) + len(self._dirty) >= CACHE_MAX:
            self._cache.clear()
        for c, (_, new) in self._dirty.items():
            self._cache[c] = new
        self._dirty.clear()
        self._touched.clear()
        if not self._replaying and self._journal_fd is not None:
            self._empty_journals()
            self._synced_seq = max(self._synced_seq, self._applied_seq)  # SQLite synced them (FULL)

    @contextmanager
    def batch(self):
        """Group every metadata change inside into one SQLite transaction, without journal records (bulk
        loads, migration). A kill inside loses all of them (their blocks are in no persisted bitmap). A
        failure inside leaves memory ahead of the store: the engine must then be closed and reopened."""
        with self._flush_mutex, self._lock:
            self._check_open()
            self._flush()
            self._batch += 1
        try:
            yield self
        except BaseException:
            with self._lock:
                self._batch = 0
                self._closed = True  # in-memory state no longer matches: reopen
            raise
        with self._flush_mutex, self._lock:
            self._batch = 0
            try:
                self._flush()
            except ThreeFSError:
                self._closed = True
                raise

    # -- allocator -------------------------------------------------------------------------------
    def _release_limbo(self) -> None:
        oldest = self._reader.oldest()
        keep = []
        for epoch, seq, blocks in self._limbo:
            # a read that may have looked the block up still runs, or (fsync) the free is not on disk yet:
            # a power loss would bring back the old owner, whose bytes the next writer would have replaced
            if (oldest is not None and epoch >= oldest) or (self._fsync and seq > self._synced_seq):
                keep.append((epoch, seq, blocks))
                continue
            for pos in blocks:
                self._unmark(pos)
        self._limbo = keep

    def _unmark(self, pos: int) -> None:
        gid = pos >> 8
        was = self._mem_bits[gid]
        self._mem_bits[gid] = was & ~(1 << (pos & 0xFF))
        if was == _FULL:
            heapq.heappush(self._free_heap[pos_class(pos)], gid)

    def _alloc(self, length: int) -> int | None:
        """Take a block for `length` bytes (None for 0): marked in memory only until a transaction
        persists a state that owns it. NO_SPACE if the file system cannot give a new group."""
        if length == 0:
            return None
        cls = class_for(length)
        with self._lock:
            self._check_open()
            self._release_limbo()
            heap = self._free_heap[cls]
            while heap:
                gid = heap[0]
                bits = self._mem_bits[gid]
                if bits == _FULL:
                    heapq.heappop(heap)
                    continue
                free = ~bits & _FULL
                index = (free & -free).bit_length() - 1
                self._mem_bits[gid] = bits | (1 << index)
                if self._mem_bits[gid] == _FULL:
                    heapq.heappop(heap)
                pos = (gid << 8) | index
                break
            else:
                gid = self._new_group(cls)
                self._mem_bits[gid] = 1
                heapq.heappush(heap, gid)
                pos = gid << 8
            if _per_block(cls):
                ready = self._ready_blocks.get(gid, 0) >> (pos & 0xFF) & 1
            else:
                ready = gid in self._ready
        if not ready:
            self._fallocate(pos, gid)
        return pos

    def _new_group(self, cls: int) -> int:
        groups = [(n, f) for (c, f), n in self._groups_per_file.items() if c == cls]
        counts = {f: n for n, f in groups}
        file = min(range(self.files_per_class), key=lambda f: (counts.get(f, 0), f))
        group = counts.get(file, 0)
        self._groups_per_file[(cls, file)] = group + 1
        self._fd(cls, file)
        return (cls << 48) | (file << 32) | group

    def _fallocate(self, pos: int, gid: int) -> None:
        cls = pos_class(pos)
        bs = block_size(cls)
        fd = self._fds[(cls, pos_file(pos))]
        if bs * GROUP_BLOCKS <= GROUP_FALLOCATE_MAX:
            start, length = (pos_block(pos) & ~0xFF) * bs, bs * GROUP_BLOCKS
        else:
            start, length = pos_block(pos) * bs, bs
        try:
            if not self._room_for(length):
                raise OSError(errno.ENOSPC, f"{length} bytes for data would leave less than {METADATA_HEADROOM} "
                              "bytes for the metadata store")
            os.posix_fallocate(fd, start, length)
            if self._fsync:
                os.fsync(fd)  # the file size is metadata
        except OSError as exc:
            self._unalloc([pos])
            raise _os_error(exc, f"target {self.path}: cannot grow {pos_str(pos)}") from exc
        with self._lock:
            if _per_block(cls):
                self._ready_blocks[gid] = self._ready_blocks.get(gid, 0) | (1 << (pos & 0xFF))
            else:
                self._ready.add(gid)

    def _room_for(self, length: int) -> bool:
        """Does the file system keep METADATA_HEADROOM after `length` more bytes? statvfs is asked again
        only within FREE_RECHECK_BYTES of the limit or after FREE_RECHECK_S (a sequential write of 1 MiB
        chunks fallocates each block: this keeps a statvfs out of most of them)."""
        now = time.monotonic()
        with self._lock:
            known, at = self._free_known
            if known - length > METADATA_HEADROOM + FREE_RECHECK_BYTES and now - at < FREE_RECHECK_S:
                self._free_known = (known - length, at)
                return True
        vfs = os.statvfs(self._block_dir)
        free = vfs.f_bavail * vfs.f_frsize
        with self._lock:
            self._free_known = (free - length, now)
        return free >= length + METADATA_HEADROOM

    def _unalloc(self, blocks) -> None:
        """Give back blocks taken by a write that failed (never persisted, never seen by readers)."""
        with self._lock:
            for pos in blocks:
                if pos is not None:
                    self._unmark(pos)

    # -- data IO ---------------------------------------------------------------------------------
    def _where(self, pos: int) -> tuple[int, int]:
        return self._fds[(pos_class(pos), pos_file(pos))], pos_block(pos) * block_size(pos_class(pos))

    def _pwrite(self, pos: int, offset: int, buffers: list) -> None:
        buffers = [memoryview(b) for b in buffers if len(b)]
        if not buffers:
            return
        fd, base = self._where(pos)
        try:
            pwritev_all(fd, buffers, base + offset, self._wflags)
        except OSError as exc:
            if self._wflags and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # no RWF_DONTCACHE here
                log.warning("target %s: the kernel or file system does not take RWF_DONTCACHE (%s); data is "
                            "written through the page cache (write_cache = false has no effect)", self.path,
                            exc.strerror)
                self._wflags = 0
                return self._pwrite(pos, offset, buffers)
            raise _os_error(exc, f"target {self.path}: writing {pos_str(pos)}") from exc

    def _pwrite_zeros(self, pos: int, offset: int, count: int) -> None:
        while count > 0:
            step = min(count, len(_ZEROS))
            self._pwrite(pos, offset, [_ZEROS[:step]])
            offset += step
            count -= step

    def _pread(self, pos: int, offset: int, out: memoryview, flags: int = 0) -> None:
        fd, base = self._where(pos)
        done = 0
        while done < len(out):
            got = os.preadv(fd, [out[done:]], base + offset + done, flags)
            if got == 0:
                raise status_error(StatusCode.IO_ERROR, f"target {self.path}: {pos_str(pos)} is beyond the end of "
                                   "its data file")
            done += got

    def _read_version(self, pos: int | None, ov: tuple | None, offset: int, out: memoryview, flags: int = 0) -> None:
        """Bytes [offset, offset+len(out)) of a version (base block plus its overlay, if any)."""
        if not len(out):
            return
        if ov is None:
            self._pread(pos, offset, out, flags)
            return
        ov_off, ov_len, ov_pos = ov
        end = offset + len(out)
        a, b = max(offset, ov_off), min(end, ov_off + ov_len)
        if a >= b:
            self._pread(pos, offset, out, flags)
            return
        self._pread(pos, offset, out[: a - offset], flags)
        self._pread(ov_pos, a - ov_off, out[a - offset : b - offset], flags)
        self._pread(pos, b, out[b - offset :], flags)

    def _crc_of(self, pos: int | None, ov: tuple | None, start: int, end: int, crc: int = 0) -> int:
        if end <= start:
            return crc
        buffer = memoryview(bytearray(min(end - start, IO_PIECE)))
        while start < end:
            piece = buffer[: min(len(buffer), end - start)]
            self._read_version(pos, ov, start, piece)
            crc = crc32c.crc32c(piece, value=crc)
            start += len(piece)
        return crc

    def _sync_all(self) -> None:
        """Data files and the metadata on disk (end of a migration)."""
        for fd in self._fds.values():
            os.fdatasync(fd)
        with self._flush_mutex, self._lock:
            self._wdb.execute("PRAGMA wal_checkpoint(FULL)")

    def _sync(self, *blocks) -> None:
        if self._fsync:
            for pos in {(pos_class(p), pos_file(p)) for p in blocks if p is not None}:
                os.fdatasync(self._fds[pos])

    # -- queries ---------------------------------------------------------------------------------
    def get_meta(self, chunk_id: bytes) -> ChunkMeta | None:
        _check_chunk_id(chunk_id)
        with self._lock:
            self._check_open()
            st = self._get(chunk_id)
            return None if st is None else self._meta_of(chunk_id, st)

    def iter_metas(self, begin: bytes = b"", end: bytes | None = None, *, reverse: bool = False,
                   limit: int = 0) -> list[ChunkMeta]:
        if limit < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"limit must be >= 0: {limit}")
        sql = f"SELECT {_COLUMNS} FROM chunks WHERE id >= ?"
        args: list = [begin]
        if end is not None:
            sql += " AND id < ?"
            args.append(end)
        sql += " ORDER BY id DESC" if reverse else " ORDER BY id"
        if limit:
            sql += " LIMIT ?"
            args.append(limit)
        with self._flush_mutex, self._lock:
            self._check_open()
            self._flush()  # range queries read SQLite
            rows = self._db.execute(sql, args).fetchall()
        return [make_meta(row[0], row_to_state(row)) for row in rows]

    def used_bytes(self) -> int:
        """Bytes of blocks that chunk versions own (from the allocator's persisted bitmaps)."""
        return self.space()["used_bytes"]

    def space(self) -> dict:
        """Allocator figures: used_bytes (owned blocks), reusable_bytes (free blocks in allocated groups),
        file_bytes (space the data files take on the file system)."""
        with self._lock:
            self._check_open()
            used = reserved = 0
            for gid, bits in self._db_bits.items():
                bs = block_size(gid >> 48)
                n = bits.bit_count()
                used += n * bs
                if gid in self._ready:
                    reserved += (GROUP_BLOCKS - n) * bs
                elif gid in self._ready_blocks:
                    reserved += (self._ready_blocks[gid] & ~bits).bit_count() * bs
            fds = list(self._fds.values())
        file_bytes = sum(os.fstat(fd).st_blocks * 512 for fd in fds)
        return {"used_bytes": used, "reusable_bytes": reserved, "file_bytes": file_bytes}

    def chunk_count(self) -> int:
        with self._lock:
            return self._count

    # -- reads -----------------------------------------------------------------------------------
    def read(self, chunk_id: bytes, offset: int, length: int, out: memoryview | None = None, *,
             pending: bool = False, nowait: bool = False) -> tuple[memoryview | bytes, ChunkMeta]:
        """As ChunkEngine.read: one preadv into `out` for a chunk without an overlay."""
        if type(chunk_id) is not bytes or len(chunk_id) != 16:
            _check_chunk_id(chunk_id)
        if out is None:
            view = None
        elif type(out) is memoryview and out.format == "B" and out.ndim == 1:
            view = out
        else:
            view = _as_byte_view(out)
        if offset < 0 or length < 0 or (view is not None and (view.readonly or len(view) < length)):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"bad read: offset {offset}, length {length}")
        reader = self._reader
        while True:  # (again if a fold wrote into the block while it was read: see _fold)
            with self._lock:
                if self._closed:
                    self._check_open()
                entry = self._dirty.get(chunk_id)
                if entry is not None:
                    st = entry[1]
                else:
                    st = self._cache.get(chunk_id, _MISSING)
                    if st is _MISSING:
                        st = self._get(chunk_id)
                if st is None:
                    raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {chunk_id.hex()} not found on {self.path}")
                p = st.p
                if pending and p is not None:
                    if p.remove:
                        raise status_error(StatusCode.CHUNK_NOT_FOUND,
                                           f"chunk {chunk_id.hex()} has a pending removal")
                    pos, ov, size = p.pos, p.ov, p.length
                else:
                    pos, ov, size = st.pos, st.ov, st.length
                count = min(length, size - offset)
                if count > 0:
                    epoch = reader.epoch  # (_Reader.enter, inlined: this is the hot path)
                    reader.active[epoch] = reader.active.get(epoch, 0) + 1
                meta = self._meta_of(chunk_id, st)
                folds = self.folds
            if count <= 0:
                return (b"" if view is None else view[:0]), meta
            try:
                cls = pos >> 56
                fd = self._fds[(cls, (pos >> 40) & 0xFFFF)]
                at = (pos & _BLOCK_MASK) * (BLOCK_MIN << cls) + offset
                if view is None and ov is None:
                    data = os.pread(fd, count, at)
                    if len(data) != count:
                        raise status_error(StatusCode.IO_ERROR, f"target {self.path}: {pos_str(pos)} is beyond "
                                           "the end of its data file")
                    if self.folds == folds:
                        return data, meta
                    continue
                target = memoryview(bytearray(count)) if view is None else view[:count]
                flags = os.RWF_NOWAIT if nowait and view is not None else 0
                if ov is not None or os.preadv(fd, (target,), at, flags) != count:
                    self._read_version(pos, ov, offset, target, flags)  # an overlay, or a short read
            finally:
                with self._lock:
                    n = reader.active[epoch] - 1
                    if n:
                        reader.active[epoch] = n
                    else:
                        del reader.active[epoch]
            if self.folds == folds:
                return (bytes(target) if view is None else target), meta

    def _meta_of(self, chunk_id: bytes, st: State) -> ChunkMeta:
        """make_meta, remembered per state (caller holds the lock; states are immutable)."""
        hit = self._metas.get(chunk_id)
        if hit is not None and hit[0] is st:
            return hit[1]
        meta = make_meta(chunk_id, st)
        if len(self._metas) >= CACHE_MAX:
            self._metas.clear()
        self._metas[chunk_id] = (st, meta)
        return meta

    # -- batched reads (the storage service's read_packed) ----------------------------------------
    def read_locations(self, chunk_ids: list, with_folds: bool = False) -> tuple:
        """Where the committed bytes of each chunk are, for a batch of reads of committed data, looked
        up under one lock acquisition: ([loc per chunk], epoch). loc is None for a chunk not stored (a
        hole), False for one that needs the general path (`read`: a pending version, an overlay, or no
        committed version), else (fd, file offset of the block, committed length, commit_ver, crc).

        The blocks stay owned by their reads until `end_reads(epoch)`: call it once the bytes were read
        (or sent: a zero-copy send reads the file after this returns), in a `finally`.

        with_folds: ([loc per chunk], epoch, folds), `folds` the fold count at the lookup: if `self.folds`
        differs once the bytes are read, a fold may have written into a block while it was read (a version
        committed meanwhile), and the read must be done again (`read` does so). A whole chunk sent zero-copy
        is checked by the client against its write-time crc32c instead."""
        locs: list = []
        append = locs.append
        reader, dirty, cache, memo = self._reader, self._dirty, self._cache, self._locs
        with self._lock:
            self._check_open()
            for cid in chunk_ids:
                entry = dirty.get(cid)
                if entry is not None:
                    st = entry[1]
                else:
                    st = cache.get(cid, _MISSING)
                    if st is _MISSING:
                        if type(cid) is not bytes or len(cid) != 16:
                            _check_chunk_id(cid)
                        st = self._get(cid)
                if st is None:
                    append(None)
                    continue
                hit = memo.get(cid)
                if hit is not None and hit[0] is st:
                    append(hit[1])
                    continue
                if st.p is not None or st.ov is not None or st.pos is None or not st.commit_ver:
                    loc = False
                else:
                    pos = st.pos
                    cls = pos >> 56
                    loc = (self._fds[(cls, (pos >> 40) & 0xFFFF)], (pos & _BLOCK_MASK) * (BLOCK_MIN << cls),
                           st.length, st.commit_ver, st.crc)
                if len(memo) >= CACHE_MAX:
                    memo.clear()
                memo[cid] = (st, loc)
                append(loc)
            epoch = reader.epoch
            reader.active[epoch] = reader.active.get(epoch, 0) + 1
            folds = self.folds
        return (locs, epoch, folds) if with_folds else (locs, epoch)

    def read_direct(self, fd: int, at: int, view: memoryview) -> int:
        """Read the bytes at `at` of the data file that read_locations named `fd` with O_DIRECT (from the
        disk into `view`, past the page cache: no new page-cache pages to fill, no copy out of them), for a
        caller holding a read epoch of those bytes. `view` and `at` must be DIRECT_ALIGN aligned and `view`
        a multiple of it long. Returns the bytes read (short at the file's end), or -1 where O_DIRECT is
        not available (a file system without it, an unaligned request): read it the ordinary way then.

        Dirty page-cache pages of the range are written back by the kernel before it reads (O_DIRECT reads
        see every completed write). The O_DIRECT descriptor of each data file is opened once; the read uses
        a duplicate taken under the engine lock, so a close meanwhile cannot hand it another file."""
        if at % DIRECT_ALIGN or len(view) % DIRECT_ALIGN or not len(view):
            return -1
        with self._lock:
            self._check_open()
            dfd = self._direct_fds.get(fd)
            if dfd is None:
                key = next((k for k, f in self._fds.items() if f == fd), None)
                if key is None:
                    return -1
                path = os.path.join(self._block_dir, f"c{key[0]:02d}.{key[1]:03d}")
                try:
                    dfd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0) | os.O_CLOEXEC)
                except OSError as exc:  # EINVAL: no O_DIRECT on this file system
                    log.info("target %s: no O_DIRECT reads of %s (%s); reads stay buffered", self.path, path, exc)
                    dfd = -1
                self._direct_fds[fd] = dfd
            if dfd < 0:
                return -1
            dup = os.dup(dfd)
        try:
            got = 0
            while got < len(view):
                n = os.preadv(dup, (view[got:],), at + got)
                if n <= 0:
                    break
                got += n
                if got % DIRECT_ALIGN:  # a short read inside the file's last block: the file ends here
                    break
            return got
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            return -1  # an alignment O_DIRECT refuses here (e.g. a bigger logical block size)
        finally:
            os.close(dup)

    def end_reads(self, epoch: int) -> None:
        """The reads of one read_locations call are over (their blocks may be reused once freed)."""
        with self._lock:
            self._reader.leave(epoch)

    def verify(self, chunk_id: bytes) -> bool:
        """Re-read the committed bytes and check them against the stored CRC32C (again if a fold wrote into
        the block meanwhile: a version committed during the check, see _fold)."""
        _check_chunk_id(chunk_id)
        while True:
            with self._lock:
                self._check_open()
                st = self._get(chunk_id)
                if st is None:
                    raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {chunk_id.hex()} not found on {self.path}")
                if st.commit_ver == 0:
                    return True
                epoch = self._reader.enter()
                folds = self.folds
            try:
                crc = self._crc_of(st.pos, st.ov, 0, st.length)
            except (OSError, ThreeFSError) as exc:
                log.error("target %s: chunk %s unreadable: %s", self.path, chunk_id.hex(), exc)
                return False
            finally:
                with self._lock:
                    self._reader.leave(epoch)
            if self.folds == folds:
                break
        if crc != st.crc:
            log.error("target %s: chunk %s checksum mismatch: %08x != %08x", self.path, chunk_id.hex(), crc, st.crc)
        return crc == st.crc

    # -- pending versions ------------------------------------------------------------------------
    def _drop_pending(self, chunk_id: bytes) -> State | None:
        """Forget the pending version (its blocks are freed); return the committed-only state."""
        with self._lock:
            self._check_open()
            st = self._get(chunk_id)
            if st is None or st.p is None:
                return st
            new = None if st.commit_ver == 0 else msgspec.structs.replace(st, p=None)
            self._set(chunk_id, st, new)
            return new

    def _install(self, chunk_id: bytes, base: State | None, pending: Pending, taken: list,
                 written: tuple = ()) -> ChunkMeta:
        """Persist the pending version (its data is complete: with fsync, on disk first). `taken`: blocks
        allocated for it (given back if this fails); `written`: other blocks it wrote into (in place)."""
        self._sync(*taken, *written)
        with self._lock:
            try:
                self._check_open()
                if base is None:
                    base = State(0, 0, 0, 0, None, None, b"", None)
                new = msgspec.structs.replace(base, p=pending)
                self._set(chunk_id, self._get(chunk_id), new)
            except BaseException:
                for pos in taken:
                    if pos is not None:
                        self._unmark(pos)
                raise
            return make_meta(chunk_id, new)

    @_chunk_op
    def write(self, chunk_id: bytes, *, update_ver: int, chain_ver: int, offset: int, data, chunk_size: int,
              full_replace: bool = False, last_request: bytes = b"", data_crc: int | None = None) -> ChunkMeta:
        """See ChunkEngine.write. `data_crc`: the crc32c of `data` when the caller has it (the storage
        service checked the request's payload against it): the new version's crc is derived from it
        instead of reading `data` again (a write's second crc32c pass, 71 us per MiB here)."""
        _check_chunk_id(chunk_id)
        _check_update(update_ver, chain_ver, last_request)
        view = _as_byte_view(data)
        if offset < 0 or (full_replace and offset != 0):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"bad write offset {offset} (full_replace={full_replace})")
        end = offset + len(view)
        _check_extent(end, chunk_size)
        st = self._drop_pending(chunk_id)
        clen = st.length if st is not None else 0
        tag = bytes(last_request)
        if st is None or st.pos is None or full_replace or (offset == 0 and len(view) >= clen):
            length = len(view) if full_replace else max(clen, end)
            if st is not None and st.pos is not None and not full_replace and length > end:
                if self._inline_now():
                    raise BlockingIOError(f"chunk {chunk_id.hex()}: the write copies older bytes")
                return self._write_copy(chunk_id, st, offset, view, length, update_ver, chain_ver, tag, data_crc)
            if offset > INLINE_ZERO_FILL_MAX and self._inline_now():
                raise BlockingIOError(f"chunk {chunk_id.hex()}: the write zero-fills {offset} bytes")
            pos = self._alloc(length)
            try:
                if offset:
                    self._pwrite_zeros(pos, 0, offset)
                self._pwrite(pos, offset, [view])
            except BaseException:
                self._unalloc([pos])
                raise
            crc = _crc_after(_crc_zeros(offset), offset, view, data_crc)
            return self._install(chunk_id, st, Pending(update_ver, chain_ver, length, crc, pos, None, False, tag),
                                 [pos])
        if st.ov is None and offset >= clen and end <= block_size(pos_class(st.pos)):
            if offset - clen > INLINE_ZERO_FILL_MAX and self._inline_now():
                raise BlockingIOError(f"chunk {chunk_id.hex()}: the write zero-fills {offset - clen} bytes")
            self._pwrite_zeros(st.pos, clen, offset - clen)
            self._pwrite(st.pos, offset, [view])
            crc = _crc_after(_crc_zeros(offset - clen, st.crc), offset, view, data_crc)
            return self._install(chunk_id, st, Pending(update_ver, chain_ver, end, crc, st.pos, None, False, tag),
                                 [], (st.pos,))
        if self._inline_now():  # both ways from here read the chunk's older bytes: maybe from the disk
            raise BlockingIOError(f"chunk {chunk_id.hex()}: the write reads older bytes")
        if st.ov is None and end <= clen and 0 < 2 * len(view) <= clen:
            ov_pos = self._alloc(len(view))
            try:
                self._pwrite(ov_pos, 0, [view])
                before = memoryview(bytearray(len(view)))  # the bytes it replaces: the CRC is patched, O(n)
                epoch = self._enter()
                try:
                    self._pread(st.pos, offset, before)
                finally:
                    self._leave(epoch)
                crc = crc_math.patch(st.crc, clen, offset, before, view)
            except BaseException:
                self._unalloc([ov_pos])
                raise
            pending = Pending(update_ver, chain_ver, clen, crc, st.pos, (offset, len(view), ov_pos), False, tag)
            return self._install(chunk_id, st, pending, [ov_pos])
        return self._write_copy(chunk_id, st, offset, view, max(clen, end), update_ver, chain_ver, tag, data_crc)

    def _enter(self) -> int:
        with self._lock:
            return self._reader.enter()

    def _leave(self, epoch: int) -> None:
        with self._lock:
            self._reader.leave(epoch)

    def _write_copy(self, chunk_id: bytes, st: State, offset: int, view: memoryview, length: int,
                    update_ver: int, chain_ver: int, tag: bytes, data_crc: int | None = None) -> ChunkMeta:
        """A new block = committed[0:offset] + view + committed[offset+len(view):length], zero-extended."""
        pos = self._alloc(length)
        try:
            crc = self._copy_into(pos, st, 0, min(offset, st.length), 0)
            if offset > st.length:
                self._pwrite_zeros(pos, st.length, offset - st.length)
                crc = _crc_zeros(offset - st.length, crc)
            self._pwrite(pos, offset, [view])
            crc = _crc_after(crc, offset, view, data_crc)
            end = offset + len(view)
            crc = self._copy_into(pos, st, end, min(length, st.length), crc)
            tail = max(end, min(length, st.length))
            self._pwrite_zeros(pos, tail, length - tail)
            crc = _crc_zeros(length - tail, crc)
        except BaseException:
            self._unalloc([pos])
            raise
        return self._install(chunk_id, st, Pending(update_ver, chain_ver, length, crc, pos, None, False, tag), [pos])

    def _copy_into(self, pos: int, st: State, start: int, end: int, crc: int) -> int:
        """Copy committed bytes [start, end) to the same offsets of block `pos`; continue `crc` over them."""
        if end <= start:
            return crc
        buffer = memoryview(bytearray(min(end - start, IO_PIECE)))
        epoch = self._enter()
        try:
            while start < end:
                piece = buffer[: min(len(buffer), end - start)]
                self._read_version(st.pos, st.ov, start, piece)
                self._pwrite(pos, start, [piece])
                crc = crc32c.crc32c(piece, value=crc)
                start += len(piece)
        finally:
            self._leave(epoch)
        return crc

    @_chunk_op
    def truncate(self, chunk_id: bytes, *, update_ver: int, chain_ver: int, length: int, chunk_size: int,
                 last_request: bytes = b"") -> ChunkMeta:
        _check_chunk_id(chunk_id)
        _check_update(update_ver, chain_ver, last_request)
        if length < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"bad truncate length {length}")
        _check_extent(length, chunk_size)
        st = self._drop_pending(chunk_id)
        tag = bytes(last_request)
        if st is None or st.pos is None:
            pos = self._alloc(length)
            try:
                if pos is not None:
                    self._pwrite_zeros(pos, 0, length)
            except BaseException:
                self._unalloc([pos])
                raise
            return self._install(chunk_id, st, Pending(update_ver, chain_ver, length, _crc_zeros(length), pos, None,
                                                       False, tag), [pos])
        if st.ov is None and st.length <= length <= block_size(pos_class(st.pos)):
            self._pwrite_zeros(st.pos, st.length, length - st.length)
            crc = _crc_zeros(length - st.length, st.crc)
            return self._install(chunk_id, st, Pending(update_ver, chain_ver, length, crc, st.pos, None, False, tag),
                                 [], (st.pos,))
        if length == 0:
            return self._install(chunk_id, st, Pending(update_ver, chain_ver, 0, 0, None, None, False, tag), [])
        return self._write_copy(chunk_id, st, length, memoryview(b""), length, update_ver, chain_ver, tag)

    @_chunk_op
    def remove(self, chunk_id: bytes, *, update_ver: int, chain_ver: int, last_request: bytes = b"") -> ChunkMeta | None:
        _check_chunk_id(chunk_id)
        _check_update(update_ver, chain_ver, last_request)
        if self.get_meta(chunk_id) is None:
            return None
        st = self._drop_pending(chunk_id)
        return self._install(chunk_id, st, Pending(update_ver, chain_ver, 0, 0, None, None, True, bytes(last_request)),
                             [])

    @_chunk_op
    def abort(self, chunk_id: bytes) -> None:
        _check_chunk_id(chunk_id)
        self._drop_pending(chunk_id)

    # -- updates on an event loop's thread ----------------------------------------------------------
    @property
    def inline_capable(self) -> bool:
        """Whether small updates may run on the caller's thread (`inline`): not with fsync (every update
        waits for the disk then)."""
        return not self._fsync

    @contextmanager
    def inline(self):
        """Run write / commit calls on this thread only if they need no wait: no read of a chunk's older
        bytes (they may be on the disk only), no fold of an overlay, no wait for another update of the chunk
        or for compaction's move of it, no journal flush into SQLite (`flush_due` says one is owed: the
        caller runs `flush_owed` in a thread). Such a call raises BlockingIOError instead, having changed
        nothing that a rerun in a thread would not change the same way (a write's dropped pending version
        is dropped by its rerun too). What remains are writes into the page cache: a storage service runs
        small updates this way on its event loop, sparing two thread hand-offs per replica."""
        if self._fsync:
            raise BlockingIOError("fsync: updates wait for the disk")
        self._local.inline = True
        try:
            yield
        finally:
            self._local.inline = False

    def _inline_now(self) -> bool:
        return getattr(self._local, "inline", False)

    @property
    def flush_due(self) -> bool:
        """The journal is long enough that an update owes a flush into SQLite (see `inline`)."""
        return self._flush_due

    def flush_owed(self) -> None:
        """The flush an inline update left owed (run it in a thread: it writes SQLite)."""
        self._flush_owed()

    # -- commit ----------------------------------------------------------------------------------
    @_chunk_op
    def commit(self, chunk_id: bytes, update_ver: int, *, chain_ver: int | None = None) -> ChunkMeta | None:
        """As ChunkEngine.commit. A commit of an overlay folds it into the committed block afterwards."""
        _check_chunk_id(chunk_id)
        with self._lock:
            self._check_open()
            st = self._get(chunk_id)
            p = st.p if st is not None else None
            if p is None or p.update_ver != update_ver:
                return self._commit_mismatch(chunk_id, update_ver, st)
            if p.ov is not None and not p.remove and self._inline_now():
                raise BlockingIOError(f"chunk {chunk_id.hex()}: the commit folds an overlay (disk IO)")
            if p.remove:
                new = None
            else:
                new = State(p.chain_ver if chain_ver is None else chain_ver, update_ver, p.length, p.crc, p.pos, p.ov,
                            p.last_request, None)
            self._set(chunk_id, st, new)
        if new is not None and new.ov is not None:
            new = self._fold(chunk_id, new)
        return None if new is None else make_meta(chunk_id, new)

    def _fold(self, chunk_id: bytes, st: State) -> State:
        """Write a committed overlay into its base block; the overlay is freed with the next transaction."""
        ov_off, ov_len, ov_pos = st.ov
        buffer = memoryview(bytearray(ov_len))
        try:
            self._pread(ov_pos, 0, buffer)
            # A read that looked the chunk up before the commit may be reading the old version's bytes of this
            # block (under the old version's length and checksum): it sees the count change and reads again,
            # else it could return a mix of both versions that no checksum catches (the storage service
            # crc32cs what it read). Reads of the new version take this range from the overlay until the
            # folded state is recorded, so they are not affected.
            with self._lock:
                self.folds += 1
            self._pwrite(st.pos, ov_off, [buffer])
            self._sync(st.pos)
        except ThreeFSError as exc:
            log.warning("target %s: chunk %s: cannot fold its overlay yet (reads use it): %s", self.path,
                        chunk_id.hex(), exc)
            return st
        folded = msgspec.structs.replace(st, ov=None)
        with self._lock:
            if self._get(chunk_id) == st:
                try:
                    self._set(chunk_id, st, folded)
                except ThreeFSError as exc:
                    log.warning("target %s: chunk %s: fold not recorded (reads keep its overlay): %s", self.path,
                                chunk_id.hex(), exc)
                    return st
        return folded

    def _commit_mismatch(self, chunk_id: bytes, update_ver: int, st: State | None) -> ChunkMeta | None:
        if st is None:
            return None
        if update_ver <= st.commit_ver:
            return make_meta(chunk_id, st)
        p = st.p
        code = StatusCode.STALE_UPDATE if p is not None and p.update_ver > update_ver else StatusCode.MISSING_UPDATE
        raise status_error(code, f"chunk {chunk_id.hex()} on {self.path}: cannot commit version {update_ver}: "
                           f"committed {st.commit_ver}, pending {p.update_ver if p is not None else None}")

    @_chunk_op
    def set_versions(self, chunk_id: bytes, *, update_ver: int, commit_ver: int, chain_ver: int) -> ChunkMeta:
        """As ChunkEngine.set_versions."""
        _check_chunk_id(chunk_id)
        if not 0 < commit_ver <= update_ver or chain_ver < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"bad versions: update {update_ver}, commit {commit_ver}, chain {chain_ver}")
        meta = self.get_meta(chunk_id)
        if meta is None or meta.commit_ver == 0:
            raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {chunk_id.hex()} has no committed version")
        st = self._drop_pending(chunk_id)
        with self._lock:
            self._check_open()
            new = msgspec.structs.replace(st, commit_ver=commit_ver, chain_ver=chain_ver)
            if update_ver > commit_ver:
                new = msgspec.structs.replace(new, p=Pending(update_ver, chain_ver, st.length, st.crc, st.pos, st.ov,
                                                             False, st.last_request))
            self._set(chunk_id, self._get(chunk_id), new)
            return make_meta(chunk_id, new)

    # -- maintenance -----------------------------------------------------------------------------
    def compact(self, *, move_bytes_max: int = 256 * MiB, sparse_fraction: float = 0.25) -> dict:
        """Return space after deletes: (1) move the committed blocks of chunks in sparse groups (at most
        `sparse_fraction` used) into lower groups, at most `move_bytes_max` bytes of data per call (the IO
        bound); (2) punch the holes of empty groups and cut empty file ends (metadata only). A chunk with
        a pending version or an update running is not moved. Returns what it did."""
        moved, moved_bytes = self._move_sparse(move_bytes_max, sparse_fraction)
        done = self._punch_empty()
        return {"chunks_moved": moved, "bytes_moved": moved_bytes, **done}

    def _move_sparse(self, budget: int, sparse_fraction: float) -> tuple[int, int]:
        with self._flush_mutex, self._lock:
            self._check_open()
            limit = int(GROUP_BLOCKS * sparse_fraction)
            sources = {gid for gid, bits in self._mem_bits.items() if 0 < bits.bit_count() <= limit}
            if not sources:
                return 0, 0
            self._flush()
            rows = self._db.execute("SELECT id, pos, length FROM chunks WHERE p_update_ver IS NULL AND "
                                    "ov_pos IS NULL AND pos IS NOT NULL").fetchall()
        todo = sorted(((pos, cid, length) for cid, pos, length in rows if pos >> 8 in sources), reverse=True)
        moved = moved_bytes = 0
        stopped: set[int] = set()  # classes where no lower free block is left
        for pos, chunk_id, length in todo:
            cls = pos_class(pos)
            if moved_bytes >= budget or cls in stopped:
                continue
            with self._lock:
                st = self._get(chunk_id)
                if (chunk_id in self._busy or st is None or st.p is not None or st.ov is not None
                        or st.pos != pos):
                    continue
                self._moving.add(chunk_id)
            try:
                try:
                    new = self._alloc(length)
                except ThreeFSError as exc:
                    if exc.code != StatusCode.NO_SPACE:
                        raise
                    stopped.add(cls)
                    continue
                if new >> 8 >= pos >> 8:  # no free block below: moving would not empty anything
                    self._unalloc([new])
                    stopped.add(cls)
                    continue
                try:
                    crc = self._copy_into(new, st, 0, length, 0)
                    if crc != st.crc:
                        log.error("target %s: chunk %s fails its checksum; compaction leaves it in place",
                                  self.path, chunk_id.hex())
                        self._unalloc([new])
                        continue
                    self._sync(new)
                    with self._lock:
                        self._set(chunk_id, st, msgspec.structs.replace(st, pos=new))
                except BaseException:
                    self._unalloc([new])
                    raise
                moved += 1
                moved_bytes += length
            finally:
                with self._lock:
                    self._moving.discard(chunk_id)
                    if self._waiters:
                        self._moved.notify_all()
        self._durable()
        self._flush_owed()
        return moved, moved_bytes

    def _punch_empty(self) -> dict:
        punched = 0
        with self._flush_mutex, self._lock:
            self._check_open()
            self._flush()
            self._release_limbo()
            before = sum(os.fstat(fd).st_blocks for fd in self._fds.values()) * 512
            for (cls, file), n in list(self._groups_per_file.items()):
                bs, fd = block_size(cls), self._fds[(cls, file)]
                top = n
                while top > 0 and self._mem_bits.get((cls << 48) | (file << 32) | (top - 1), 0) == 0:
                    top -= 1
                for g in range(top):
                    gid = (cls << 48) | (file << 32) | g
                    spare = self._ready_blocks.get(gid, 0) & ~self._mem_bits.get(gid, 0)
                    if spare:  # classes fallocated per block: give back each free block
                        for i in range(GROUP_BLOCKS):
                            if spare >> i & 1:
                                fallocate_punch(fd, (g * GROUP_BLOCKS + i) * bs, bs)
                        self._ready_blocks[gid] &= ~spare
                        punched += 1
                    if gid in self._ready and self._mem_bits.get(gid, 0) == 0:
                        fallocate_punch(fd, g * GROUP_BLOCKS * bs, GROUP_BLOCKS * bs)
                        self._ready.discard(gid)  # the next allocation in it fallocates again
                        punched += 1
                if top < n or os.fstat(fd).st_size > top * GROUP_BLOCKS * bs:
                    self._wdb.execute("DELETE FROM groups WHERE gid >= ? AND gid < ?",
                                     ((cls << 48) | (file << 32) | top, (cls << 48) | ((file + 1) << 32)))
                    os.ftruncate(fd, top * GROUP_BLOCKS * bs)
                    for g in range(top, n):
                        gid = (cls << 48) | (file << 32) | g
                        self._mem_bits.pop(gid, None)
                        self._db_bits.pop(gid, None)
                        self._ready.discard(gid)
                        self._ready_blocks.pop(gid, None)
                    self._groups_per_file[(cls, file)] = top
                    self._free_heap[cls] = [g for g in self._free_heap[cls] if g in self._mem_bits]
                    heapq.heapify(self._free_heap[cls])
            after = sum(os.fstat(fd).st_blocks for fd in self._fds.values()) * 512
        return {"groups_punched": punched, "bytes_returned": max(0, before - after)}


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def fallocate_punch(fd: int, offset: int, length: int) -> None:
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _lock_target(path: str) -> int:
    fd = os.open(os.path.join(path, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise status_error(StatusCode.BUSY, f"target {path} is already open by another chunk engine") from None
    return fd
