"""The chunk engine: the local disk layer of one storage target (one directory).

It stores chunks (at most CHUNK_SIZE_BYTES_MAX bytes, keyed by an opaque, sortable 16-byte chunk id) with
their metadata, one committed and at most one pending version per chunk. Which version to write, version
checks and per-chunk locking belong to the caller (the replica logic); the engine makes what it is told
durable and atomic.

This module holds the version state and the metadata log; the data files are `version_files.py`'s, and what
every engine shares (ChunkMeta, the checks) is `chunk_state.py`'s.

Layout of a target directory::

    LOCK                    flock()ed while open: one engine per target
    meta.log                committed metadata, append-only with compaction (`chunk_store_meta`)
    data/<xx>/<id>.<gen>    one file per chunk version: <id> is the hex chunk id, <gen> a hex generation
                            number unique within the target, <xx> = crc32c(id) & 0xff (256-way fan-out)

Versions and copy-on-write. A pending version never touches the committed bytes:
  * new chunk or a write covering all committed bytes: a new file, no copy;
  * write or truncate at or beyond the committed length (append, extend): in place, past the committed
    length of the committed file (the committed bytes [0, length) are not touched);
  * any other write, or a truncate to a shorter length: a new file = committed prefix + data + committed
    suffix (read from the page cache and written with pwritev; the CRC is computed over the pieces).
`commit` appends the new `StoredChunk` record to the metadata log (the atomic switch), then unlinks the
previous version's file if it is no longer used. A reader that lost the race to such an unlink retries once.

Crash safety. A `kill -9` at any instant leaves each chunk at its last committed version, or at the new one if
the log append of its commit happened: the log record names the data file, and the file was complete before
the record was written. At start-up every file that no committed record names is deleted and a committed
file longer than its length (an unfinished in-place append) is cut back. Pending versions DO survive a
restart and `close()`: `write`/`truncate`/`remove` log a pending record after the data is complete, so a
replica that restarts still holds a version that may already be committed (and read) further down its chain
— the CRAQ layer then completes it (threefs/storage/craq.py; the simulator found the lost-version case).
A crash before that record leaves an unnamed file (reclaimed): that version was never forwarded.

fsync policy.
  * fsync=False (default): data files and the log are written to the page cache only. Everything survives a
    process crash; a power loss or kernel crash may lose recent commits or, since the kernel writes back
    in any order, leave a committed record whose data did not reach the disk (verify() reports it).
  * fsync=True: a pending version's file is fdatasync()ed (and its directory fsync()ed when the file is
    new) before `write` returns, so before any commit; every log append is fdatasync()ed before `commit`
    returns. The log flush happens under the engine lock, which serialises commits of a target at the
    device's flush latency (group commit would lift that).

Numbers (this VM: 2 shared cores, ext4, page cache, fsync=False; ranges over 3 runs):
  * metadata commit: ~3 us for a log append versus ~42 us for an SQLite WAL upsert (synchronous=NORMAL),
    which is why the metadata is a log (`chunk_store_meta`); reopening replays ~10 us per chunk (20k: ~0.2 s).
  * 1 MiB full-chunk write+commit: 0.44-0.8 ms (1.3-2.4 GB/s); the bare create+pwrite is ~0.35 ms.
  * 64 KiB write into the middle of a 1 MiB chunk (copy-on-write: 1 MiB read + 1 MiB write + CRC):
    0.6-0.9 ms, i.e. as much as a full-chunk write; a 64 KiB append in place: 0.06-0.15 ms.
  * 1 MiB read: 0.11-0.14 ms (7-9.7 GB/s); verify() of 1 MiB: ~0.2 ms.

Thread safety. Calls on different chunks may run concurrently; calls on one chunk must be serialised by the
caller. One lock guards the in-memory state and the metadata log; data-file IO runs outside it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading

import msgspec

from threefs.common.status import StatusCode, status_error
from threefs.storage.chunk_state import (  # noqa: F401 (ChunkMeta, CHUNK_ID_BYTES: this module's API too)
    CHUNK_ID_BYTES,
    ChunkMeta,
    as_byte_view,
    check_chunk_id,
    check_extent,
    check_update,
)
from threefs.storage.chunk_store_meta import (
    COMPACT_BYTES_MIN_DEFAULT,
    MetaLog,
    PendingChunk,
    SortedKeys,
    StoredChunk,
)
from threefs.storage.version_files import VersionFiles, unlink_quietly

log = logging.getLogger(__name__)



class _Pending(msgspec.Struct, frozen=True, gc=False):
    update_ver: int
    chain_ver: int
    length: int
    crc: int
    gen: int  # data file; == the committed gen when it was written in place (0 for a removal)
    remove: bool
    last_request: bytes


def _make_meta(chunk_id: bytes, stored: StoredChunk | None, pending: _Pending | None) -> ChunkMeta:
    if stored is None:
        chain_ver = commit_ver = length = crc = 0
        last_request = b""
    else:
        chain_ver, commit_ver, length, crc = stored.chain_ver, stored.commit_ver, stored.length, stored.crc
        last_request = stored.last_request
    if pending is None:
        return ChunkMeta(chunk_id, chain_ver, commit_ver, commit_ver, length, crc, length, crc, False, last_request)
    plen, pcrc = (0, 0) if pending.remove else (pending.length, pending.crc)
    return ChunkMeta(
        chunk_id, chain_ver, pending.update_ver, commit_ver, length, crc, plen, pcrc, pending.remove,
        pending.last_request,
    )


def _disk_bytes(stored: StoredChunk | None, pending: _Pending | None) -> int:
    """Logical bytes in data files for one chunk (an in-place pending counts its tail only)."""
    total = stored.length if stored is not None else 0
    if pending is None or pending.remove:
        return total
    if stored is not None and pending.gen == stored.gen:
        return total + max(0, pending.length - stored.length)
    return total + pending.length


class ChunkEngine:
    """The chunks of one storage target, stored under `path` (see the module docstring)."""

    def __init__(self, path: str, *, fsync: bool = False, meta_log_bytes_min: int = COMPACT_BYTES_MIN_DEFAULT):
        """Open or create the target directory, replay the metadata log and reclaim leftovers of
        writes that a crash interrupted. `meta_log_bytes_min` tunes log compaction (tests)."""
        self.path = os.path.abspath(path)
        if os.path.exists(os.path.join(self.path, "meta.sqlite")):
            raise status_error(StatusCode.INVALID_ARGUMENT, (
                f"target {self.path} holds a v2 chunk engine (meta.sqlite); open it with chunk_engine = \"v2\" "
                "(there is no migration back to v1)"))
        self._fsync = fsync
        self._lock = threading.Lock()
        self._files = VersionFiles(self.path, fsync)
        self._lock_fd = self._lock_target()
        self._log = MetaLog(os.path.join(self.path, "meta.log"), fsync=fsync, compact_bytes_min=meta_log_bytes_min)
        try:
            self._stored, records = self._log.load()
            self._pending: dict[bytes, _Pending] = {
                cid: _Pending(p.update_ver, p.chain_ver, p.length, p.crc, p.gen, p.remove, p.last_request)
                for cid, p in records.items()}
            max_gen = self._reclaim()
        except BaseException:
            self._log.close()
            os.close(self._lock_fd)
            raise
        live = self._stored.keys() | self._pending.keys()
        self._index = SortedKeys(live)
        self._used_bytes = sum(_disk_bytes(self._stored.get(c), self._pending.get(c)) for c in live)
        self._next_gen = max_gen + 1
        self._closed = False

    def _lock_target(self) -> int:
        fd = os.open(os.path.join(self.path, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise status_error(StatusCode.BUSY, f"target {self.path} is already open by another chunk engine")
        return fd

    def _reclaim(self) -> int:
        """Delete files no committed or pending record names, cut committed files back to their length
        (or the pending in-place length); return the highest generation seen (new files get higher
        ones, so no name is ever reused)."""
        max_gen, removed, missing = 0, 0, dict(self._stored)
        for file_path, chunk_id, gen in self._files.scan():
            max_gen = max(max_gen, gen)
            stored, pending = self._stored.get(chunk_id), self._pending.get(chunk_id)
            if pending is not None and not pending.remove and pending.gen == gen and (
                    stored is None or stored.gen != gen):
                continue  # a pending version's own file
            if stored is None or stored.gen != gen:
                os.unlink(file_path)
                removed += 1
                continue
            missing.pop(chunk_id, None)
            self._reclaim_tail(file_path, stored, pending)
        max_gen = max([max_gen, *(s.gen for s in self._stored.values()),
                       *(p.gen for p in self._pending.values())])
        if removed:
            log.info("target %s: reclaimed %d files of uncommitted versions", self.path, removed)
        for stored in missing.values():
            log.error("target %s: data file of chunk %s is missing", self.path, stored.chunk_id.hex())
        return max_gen

    def _reclaim_tail(self, file_path: str, stored: StoredChunk, pending: _Pending | None) -> None:
        size = os.stat(file_path).st_size
        keep = stored.length
        if pending is not None and not pending.remove and pending.gen == stored.gen:
            keep = max(keep, pending.length)  # a logged in-place pending version lives in this tail
        if size > keep:  # an in-place append that was never logged
            os.truncate(file_path, keep)
        elif size < stored.length:
            log.error("target %s: data file %s is %d bytes, committed length %d", self.path, file_path, size,
                      stored.length)

    def close(self) -> None:
        """Close the metadata log and unlock the target (pending versions stay logged). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._log.close()
        self._files.close()  # cached read descriptors (storage/version_files.py)
        os.close(self._lock_fd)

    def __enter__(self) -> ChunkEngine:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- queries ---------------------------------------------------------------------------------

    def get_meta(self, chunk_id: bytes) -> ChunkMeta | None:
        """The chunk's metadata, or None if it has neither a committed nor a pending version."""
        check_chunk_id(chunk_id)
        with self._lock:
            return self._meta_locked(chunk_id)

    def iter_metas(
        self, begin: bytes = b"", end: bytes | None = None, *, reverse: bool = False, limit: int = 0
    ) -> list[ChunkMeta]:
        """Metadata of the chunks with id in [begin, end) (end None: unbounded), ordered by id
        (descending if reverse), at most `limit` of them (0: all). Includes never-committed chunks."""
        if limit < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"limit must be >= 0: {limit}")
        metas = []
        with self._lock:
            self._check_open()
            for chunk_id in self._index.irange(begin, end, reverse):
                metas.append(self._meta_locked(chunk_id))
                if len(metas) == limit:
                    break
        return metas

    def used_bytes(self) -> int:
        """Logical bytes of chunk data in data files (committed plus pending versions)."""
        with self._lock:
            return self._used_bytes

    def chunk_count(self) -> int:
        """Number of chunks (with a committed or a pending version)."""
        with self._lock:
            return len(self._index)

    def _meta_locked(self, chunk_id: bytes) -> ChunkMeta | None:
        stored, pending = self._stored.get(chunk_id), self._pending.get(chunk_id)
        if stored is None and pending is None:
            return None
        return _make_meta(chunk_id, stored, pending)

    def _gens(self, chunk_id: bytes) -> set[int]:
        """Data file generations the chunk uses (committed and pending; tests check for leftovers)."""
        with self._lock:
            stored, pending = self._stored.get(chunk_id), self._pending.get(chunk_id)
        gens = {stored.gen} if stored is not None else set()
        if pending is not None and not pending.remove:
            gens.add(pending.gen)
        return gens

    def _check_open(self) -> None:
        if self._closed:
            raise status_error(StatusCode.TARGET_OFFLINE, f"chunk engine of target {self.path} is closed")

    def _file(self, chunk_id: bytes, gen: int) -> str:
        return self._files.file(chunk_id, gen)

    # -- reads -----------------------------------------------------------------------------------

    def read(
        self, chunk_id: bytes, offset: int, length: int, out: memoryview | None = None, *, pending: bool = False,
        nowait: bool = False,
    ) -> tuple[memoryview | bytes, ChunkMeta]:
        """Read [offset, offset+length) of the committed version (the pending one if `pending`), clamped
        to its length. With `out` (writable, at least `length` bytes) the data lands in out[:n] and that
        view is returned; otherwise new bytes. A chunk that was never committed reads as empty.
        Missing chunk (or pending=True on a pending removal): CHUNK_NOT_FOUND.
        nowait=True (with `out`): raise BlockingIOError instead of waiting for the disk, so an event
        loop can serve page-cache hits inline and send misses to a thread (preadv2 RWF_NOWAIT)."""
        check_chunk_id(chunk_id)
        view = None if out is None else as_byte_view(out)
        if offset < 0 or length < 0 or (view is not None and (view.readonly or len(view) < length)):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"bad read: offset {offset}, length {length}")
        for attempt in range(2):
            meta, gen, size = self._readable(chunk_id, pending)
            count = max(0, min(length, size - offset))
            if count == 0:
                return (b"" if view is None else view[:0]), meta
            try:
                flags = os.RWF_NOWAIT if nowait and view is not None else 0
                return self._files.read(self._file(chunk_id, gen), offset, count, view, flags), meta
            except FileNotFoundError:
                # a commit replaced the version and unlinked its file after we looked it up
                if attempt == 0 and self.get_meta(chunk_id) != meta:
                    continue
                raise status_error(StatusCode.IO_ERROR, f"data file of chunk {chunk_id.hex()} is missing")
        raise AssertionError("unreachable")

    def _readable(self, chunk_id: bytes, pending: bool) -> tuple[ChunkMeta, int, int]:
        with self._lock:
            self._check_open()
            stored, pend = self._stored.get(chunk_id), self._pending.get(chunk_id)
            if stored is None and pend is None:
                raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {chunk_id.hex()} not found on {self.path}")
            meta = _make_meta(chunk_id, stored, pend)
        if pending and pend is not None:
            if pend.remove:
                raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {chunk_id.hex()} has a pending removal")
            return meta, pend.gen, pend.length
        if stored is None:
            return meta, 0, 0
        return meta, stored.gen, stored.length

    def open_data(self, chunk_id: bytes, *, pending: bool = False) -> tuple[int, ChunkMeta]:
        """An O_RDONLY fd of the committed (or pending) version's data file, for os.sendfile; the caller
        closes it. Bytes [0, meta.length) (pending_length) stay valid while it is open, even if a commit
        replaces the version meanwhile. CHUNK_NOT_FOUND if that version does not exist."""
        check_chunk_id(chunk_id)
        for attempt in range(2):
            meta, gen, _ = self._readable(chunk_id, pending)
            if gen == 0:
                raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {chunk_id.hex()} was never committed")
            try:
                return os.open(self._file(chunk_id, gen), os.O_RDONLY), meta
            except FileNotFoundError:
                if attempt == 0 and self.get_meta(chunk_id) != meta:
                    continue
                raise status_error(StatusCode.IO_ERROR, f"data file of chunk {chunk_id.hex()} is missing")
        raise AssertionError("unreachable")

    def verify(self, chunk_id: bytes) -> bool:
        """Re-read the committed bytes and check them against the stored CRC32C (for the scrubber).
        False if they differ or the file is short or missing. CHUNK_NOT_FOUND for an unknown chunk."""
        check_chunk_id(chunk_id)
        with self._lock:
            self._check_open()
            stored = self._stored.get(chunk_id)
            if stored is None and chunk_id not in self._pending:
                raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {chunk_id.hex()} not found on {self.path}")
        if stored is None:
            return True  # nothing committed yet
        try:
            crc = self._files.crc_of(self._file(chunk_id, stored.gen), stored.length)
        except (OSError, ValueError) as exc:
            log.error("target %s: chunk %s unreadable: %s", self.path, chunk_id.hex(), exc)
            return False
        if crc != stored.crc:
            log.error("target %s: chunk %s checksum mismatch: %08x != %08x", self.path, chunk_id.hex(), crc,
                      stored.crc)
        return crc == stored.crc

    # -- pending versions ------------------------------------------------------------------------

    def write(
        self, chunk_id: bytes, *, update_ver: int, chain_ver: int, offset: int, data, chunk_size: int,
        full_replace: bool = False, last_request: bytes = b"", data_crc: int | None = None,
    ) -> ChunkMeta:
        """Write pending version `update_ver` = the committed contents (zeros if none) with `data` placed at
        `offset`; its length is max(committed length, offset+len(data)), or len(data) with full_replace
        (which requires offset 0). Replaces any pending version; the committed one stays intact.
        A full disk discards the pending version and raises NO_SPACE. `data_crc`, the crc32c of `data` when
        the caller has it, is used by the v2 engine; this one computes the crc as it writes."""
        check_chunk_id(chunk_id)
        check_update(update_ver, chain_ver, last_request)
        view = as_byte_view(data)
        if offset < 0 or (full_replace and offset != 0):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"bad write offset {offset} (full_replace={full_replace})")
        check_extent(offset + len(view), chunk_size)
        stored = self._drop_pending(chunk_id)
        if stored is None or full_replace or (offset == 0 and len(view) >= stored.length):
            length, crc, gen = self._write_new(chunk_id, offset, view)
        elif offset >= stored.length:
            length, crc, gen = self._write_in_place(stored, offset, view)
        else:
            length, crc, gen = self._write_copy(stored, offset, view, max(stored.length, offset + len(view)))
        assert length == (len(view) if full_replace else max(stored.length if stored else 0, offset + len(view)))
        pending = _Pending(update_ver, chain_ver, length, crc, gen, False, bytes(last_request))
        return self._install_pending(chunk_id, pending)

    def truncate(
        self, chunk_id: bytes, *, update_ver: int, chain_ver: int, length: int, chunk_size: int,
        last_request: bytes = b"",
    ) -> ChunkMeta:
        """Write pending version `update_ver` = the committed contents cut or zero-extended to `length`."""
        check_chunk_id(chunk_id)
        check_update(update_ver, chain_ver, last_request)
        if length < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"bad truncate length {length}")
        check_extent(length, chunk_size)
        stored = self._drop_pending(chunk_id)
        if stored is None:
            result = self._write_new(chunk_id, length, memoryview(b""))
        elif length >= stored.length:
            result = self._write_in_place(stored, length, memoryview(b""))
        else:
            result = self._write_copy(stored, length, memoryview(b""), length)
        assert result[0] == length
        pending = _Pending(update_ver, chain_ver, result[0], result[1], result[2], False, bytes(last_request))
        return self._install_pending(chunk_id, pending)

    def remove(
        self, chunk_id: bytes, *, update_ver: int, chain_ver: int, last_request: bytes = b""
    ) -> ChunkMeta | None:
        """Write a pending removal (version `update_ver`); None if the chunk does not exist."""
        check_chunk_id(chunk_id)
        check_update(update_ver, chain_ver, last_request)
        if self.get_meta(chunk_id) is None:
            return None
        self._drop_pending(chunk_id)
        return self._install_pending(chunk_id, _Pending(update_ver, chain_ver, 0, 0, 0, True, bytes(last_request)))

    def abort(self, chunk_id: bytes) -> None:
        """Drop the pending version, if any; the committed version is unchanged."""
        check_chunk_id(chunk_id)
        self._drop_pending(chunk_id)

    def _alloc_gen(self) -> int:
        with self._lock:
            self._check_open()
            gen = self._next_gen
            self._next_gen += 1
            return gen

    def _write_new(self, chunk_id: bytes, offset: int, view: memoryview) -> tuple[int, int, int]:
        """A version in a new file: zeros up to `offset`, then `view`."""
        gen = self._alloc_gen()
        return (*self._files.write_new(chunk_id, gen, offset, view), gen)

    def _write_in_place(self, stored: StoredChunk, offset: int, view: memoryview) -> tuple[int, int, int]:
        """A version that only adds bytes at or past the committed length, in the committed file."""
        return (*self._files.write_in_place(stored, offset, view), stored.gen)

    def _write_copy(self, stored: StoredChunk, offset: int, view: memoryview, length: int) -> tuple[int, int, int]:
        """A new file = committed[0:offset] + view + committed[offset+len(view):length] (copy-on-write)."""
        gen = self._alloc_gen()
        return (*self._files.write_copy(stored, gen, offset, view, length), gen)

    def _drop_pending(self, chunk_id: bytes) -> StoredChunk | None:
        """Forget the pending version and free its data; return the committed record."""
        with self._lock:
            stored, pending = self._stored.get(chunk_id), self._pending.get(chunk_id)
            if pending is not None:
                self._check_open()
                self._log.clear_pending(chunk_id)  # before its data goes: replay must not name it
                self._set_state(chunk_id, stored, None)
        if pending is None or pending.remove:
            return stored
        if stored is not None and pending.gen == stored.gen:
            if pending.length > stored.length:
                try:
                    os.truncate(self._file(chunk_id, stored.gen), stored.length)
                except OSError as exc:  # harmless: in-place writes cut the tail first, start-up too
                    log.warning("target %s: cannot cut dropped tail of %s: %s", self.path, chunk_id.hex(), exc)
        else:
            unlink_quietly(self._file(chunk_id, pending.gen))
        return stored

    def _install_pending(self, chunk_id: bytes, pending: _Pending) -> ChunkMeta:
        with self._lock:
            self._check_open()
            self._log.put_pending(_pending_record(chunk_id, pending))
            self._set_state(chunk_id, self._stored.get(chunk_id), pending)
            self._log.maybe_compact(self._live_records)
            return self._meta_locked(chunk_id)

    def _live_records(self) -> list:
        """Everything a compacted log must hold: committed records, then pending ones."""
        return [*self._stored.values(), *(_pending_record(c, p) for c, p in self._pending.items())]

    def _set_state(self, chunk_id: bytes, stored: StoredChunk | None, pending: _Pending | None) -> None:
        """The one place that changes a chunk's in-memory state (caller holds the lock)."""
        before = _disk_bytes(self._stored.get(chunk_id), self._pending.get(chunk_id))
        if stored is None:
            self._stored.pop(chunk_id, None)
        else:
            self._stored[chunk_id] = stored
        if pending is None:
            self._pending.pop(chunk_id, None)
        else:
            self._pending[chunk_id] = pending
        if stored is None and pending is None:
            self._index.discard(chunk_id)
        else:
            self._index.add(chunk_id)
        self._used_bytes += _disk_bytes(stored, pending) - before
        assert self._used_bytes >= 0

    # -- commit ----------------------------------------------------------------------------------

    def commit(self, chunk_id: bytes, update_ver: int, *, chain_ver: int | None = None) -> ChunkMeta | None:
        """Make pending version `update_ver` the committed one (atomic, durable per the fsync policy),
        stamping `chain_ver` (default: the one given to the write). A pending removal deletes the chunk and
        returns None. If `update_ver` is not pending: no-op when it is already committed (also None for a
        chunk that no longer exists), STALE_UPDATE if a newer version is pending, else MISSING_UPDATE.
        A full metadata log raises NO_SPACE and keeps the pending version."""
        check_chunk_id(chunk_id)
        with self._lock:
            self._check_open()
            stored, pending = self._stored.get(chunk_id), self._pending.get(chunk_id)
            if pending is None or pending.update_ver != update_ver:
                return self._commit_mismatch(chunk_id, update_ver, stored, pending)
            if pending.remove:
                new = None
                self._log.delete(chunk_id)  # also when nothing was committed: replay drops the pending record
            else:
                new = StoredChunk(
                    chunk_id, pending.chain_ver if chain_ver is None else chain_ver, update_ver, pending.length,
                    pending.crc, pending.gen, pending.last_request,
                )
                self._log.put(new)
            self._set_state(chunk_id, new, None)
            self._log.maybe_compact(self._live_records)
            meta = self._meta_locked(chunk_id)
        if stored is not None and (new is None or new.gen != stored.gen):
            unlink_quietly(self._file(chunk_id, stored.gen))  # if this fails, start-up reclaims it
        return meta

    def _commit_mismatch(
        self, chunk_id: bytes, update_ver: int, stored: StoredChunk | None, pending: _Pending | None
    ) -> ChunkMeta | None:
        if stored is None and pending is None:
            return None  # e.g. a repeated commit of a removal
        commit_ver = stored.commit_ver if stored is not None else 0
        if update_ver <= commit_ver:
            return _make_meta(chunk_id, stored, pending)
        newer_pending = pending is not None and pending.update_ver > update_ver
        code = StatusCode.STALE_UPDATE if newer_pending else StatusCode.MISSING_UPDATE
        pending_ver = pending.update_ver if pending is not None else None
        raise status_error(
            code,
            f"chunk {chunk_id.hex()} on {self.path}: cannot commit version {update_ver}: committed {commit_ver}, "
            f"pending {pending_ver}",
        )

    def set_versions(self, chunk_id: bytes, *, update_ver: int, commit_ver: int, chain_ver: int) -> ChunkMeta:
        """Rewrite the version numbers of the committed data (no data change; recovery and resync).
        Drops a pending version's data. With update_ver > commit_ver the chunk shows a pending version
        `update_ver` with the committed contents (committing it changes only versions); like every
        pending version it is logged and survives a restart. CHUNK_NOT_FOUND if nothing is committed."""
        check_chunk_id(chunk_id)
        if not 0 < commit_ver <= update_ver or chain_ver < 0:
            raise status_error(
                StatusCode.INVALID_ARGUMENT,
                f"bad versions: update {update_ver}, commit {commit_ver}, chain {chain_ver}",
            )
        meta = self.get_meta(chunk_id)
        if meta is None or meta.commit_ver == 0:
            raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {chunk_id.hex()} has no committed version")
        stored = self._drop_pending(chunk_id)
        assert stored is not None
        new = msgspec.structs.replace(stored, commit_ver=commit_ver, chain_ver=chain_ver)
        pending = None
        if update_ver > commit_ver:
            pending = _Pending(update_ver, chain_ver, new.length, new.crc, new.gen, False, new.last_request)
        with self._lock:
            self._check_open()
            self._log.put(new)
            if pending is not None:
                self._log.put_pending(_pending_record(chunk_id, pending))
            self._set_state(chunk_id, new, pending)
            self._log.maybe_compact(self._live_records)
            return self._meta_locked(chunk_id)


def _pending_record(chunk_id: bytes, p: _Pending) -> PendingChunk:
    return PendingChunk(chunk_id, p.update_ver, p.chain_ver, p.length, p.crc, p.gen, p.remove, p.last_request)
