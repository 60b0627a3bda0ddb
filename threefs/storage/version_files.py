"""The data files of a v1 chunk target: one file per chunk version, `data/<xx>/<id>.<gen>` (<id> the hex
chunk id, <gen> a hex generation number unique within the target, <xx> = crc32c(id) & 0xff, a 256-way
fan-out). Writing a version's bytes (new file, in place past the committed length, or copy-on-write),
reading them, checksumming them and removing them; which version lives in which file, and when a file may
go, is the engine's (chunk_engine.py), which owns the version state and the metadata log.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import weakref

from threefs.common import crc32c
from threefs.common.limits import MiB
from threefs.common.status import StatusCode, status_error
from threefs.storage.chunk_state import crc_zeros, preadv_exact, pwritev_all
from threefs.storage.chunk_store_meta import StoredChunk, io_status_error

log = logging.getLogger("threefs.storage.chunk_engine")

FANOUT_DIRS = 256
VERIFY_READ_BYTES = 4 * MiB  # bounds the memory of a checksum pass over 64 MiB chunks
PATHS_CACHED_MAX = 1 << 16
FD_CACHE_MAX = 1024  # read-only descriptors kept open per target (LRU; at most 1/8 of RLIMIT_NOFILE)


class _Fd:
    __slots__ = ("fd", "users", "dropped")

    def __init__(self, fd: int):
        self.fd, self.users, self.dropped = fd, 1, False


class FdCache:
    """Read-only descriptors of version files, so a read costs no open/close. Bounded LRU, thread-safe.

    Correct because a version file's name is never reused within a target (generations only grow), so a
    cached descriptor always reads the version its name says; when the engine unlinks a file
    (`unlink_quietly`) its entry is dropped. A descriptor is closed only once no read holds it (a
    descriptor number closed under a reader could be reused by an unrelated open)."""

    def __init__(self, entries_max: int | None = None):
        if entries_max is None:  # leave most of the process's descriptors to sockets and writes
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            entries_max = FD_CACHE_MAX if soft == resource.RLIM_INFINITY else max(16, min(FD_CACHE_MAX, soft // 8))
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, _Fd] = collections.OrderedDict()
        self._max = entries_max
        self._forgets = 0  # bumped by forget(): an open that raced one is not cached
        _caches.add(self)

    def acquire(self, path: str) -> _Fd:
        """The entry of `path` with one more user (FileNotFoundError if it is gone); release() it."""
        with self._lock:
            entry = self._entries.get(path)
            if entry is not None:
                self._entries.move_to_end(path)
                entry.users += 1
                return entry
            forgets = self._forgets
        entry = _Fd(os.open(path, os.O_RDONLY))
        with self._lock:
            other = self._entries.get(path)
            if other is not None:
                os.close(entry.fd)
                other.users += 1
                return other
            if forgets != self._forgets:  # maybe unlinked after our open: use it once, do not keep it
                entry.dropped = True
                return entry
            self._entries[path] = entry
            while len(self._entries) > self._max:
                self._drop(self._entries.popitem(last=False)[1])
        return entry

    def release(self, entry: _Fd) -> None:
        with self._lock:
            entry.users -= 1
            if entry.dropped and entry.users == 0:
                os.close(entry.fd)

    def forget(self, path: str) -> None:
        with self._lock:
            self._forgets += 1
            entry = self._entries.pop(path, None)
            if entry is not None:
                self._drop(entry)

    def close(self) -> None:
        with self._lock:
            self._forgets += 1
            entries, self._entries = list(self._entries.values()), collections.OrderedDict()
            for entry in entries:
                self._drop(entry)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _drop(entry: _Fd) -> None:  # caller holds the lock
        entry.dropped = True
        if entry.users == 0:
            os.close(entry.fd)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_caches: "weakref.WeakSet[FdCache]" = weakref.WeakSet()


class VersionFiles:
    """The files under `path`/data (see the module docstring)."""

    def __init__(self, path: str, fsync: bool):
        self.path = path
        self.fsync = fsync
        self.data_dir = os.path.join(path, "data")
        self.fds = FdCache()
        self._paths: dict[tuple[bytes, int], str] = {}
        for i in range(FANOUT_DIRS):
            os.makedirs(os.path.join(self.data_dir, f"{i:02x}"), exist_ok=True)

    def file(self, chunk_id: bytes, gen: int) -> str:
        key = (chunk_id, gen)
        path = self._paths.get(key)
        if path is None:  # names are built once per version (a read costs a dict lookup)
            if len(self._paths) >= PATHS_CACHED_MAX:
                self._paths.clear()
            sub = f"{crc32c.crc32c(chunk_id) & 0xFF:02x}"
            path = self._paths[key] = f"{self.data_dir}/{sub}/{chunk_id.hex()}.{gen:x}"
        return path

    def scan(self):
        """(file path, chunk id, generation) of every version file; unknown names are logged and skipped."""
        for sub in sorted(os.listdir(self.data_dir)):
            directory = os.path.join(self.data_dir, sub)
            for name in os.listdir(directory):
                file_path = os.path.join(directory, name)
                try:
                    hex_id, hex_gen = name.split(".")
                    chunk_id, gen = bytes.fromhex(hex_id), int(hex_gen, 16)
                except ValueError:
                    log.warning("target %s: ignoring unknown file %s", self.path, file_path)
                    continue
                yield file_path, chunk_id, gen

    # -- reads -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the cached descriptors (those in use close when their reads end)."""
        self.fds.close()

    def read(self, path: str, offset: int, count: int, view: memoryview | None, flags: int = 0) -> memoryview | bytes:
        entry = self.fds.acquire(path)
        fd = entry.fd
        try:
            if view is None:
                data = os.pread(fd, count, offset)
                if len(data) != count:
                    raise status_error(StatusCode.IO_ERROR, f"data file {path} is shorter than its metadata")
                return data
            view = view[:count]
            if os.preadv(fd, [view], offset, flags) != count:  # short (a signal, a cut file): go on
                preadv_exact(fd, view, offset, path, flags)
            return view
        finally:
            self.fds.release(entry)

    @staticmethod
    def crc_of(path: str, length: int) -> int:
        buffer = memoryview(bytearray(min(length, VERIFY_READ_BYTES)))
        crc, offset = 0, 0
        fd = os.open(path, os.O_RDONLY)
        try:
            while offset < length:
                got = os.preadv(fd, [buffer[: min(len(buffer), length - offset)]], offset)
                if got == 0:
                    raise ValueError(f"file ends at {offset}, committed length {length}")
                crc = crc32c.crc32c(buffer[:got], value=crc)
                offset += got
        finally:
            os.close(fd)
        return crc

    # -- writes: (end, crc) of the version written -------------------------------------------------
    def write_new(self, chunk_id: bytes, gen: int, offset: int, view: memoryview) -> tuple[int, int]:
        """A version in a new file: zeros up to `offset`, then `view`."""
        path = self.file(chunk_id, gen)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise self.write_error(exc, path) from exc
        try:
            if len(view):
                pwritev_all(fd, [view], offset)
            else:
                os.ftruncate(fd, offset)
            self.sync_new(fd, path)
        except OSError as exc:
            os.close(fd)
            unlink_quietly(path)
            raise self.write_error(exc, path) from exc
        os.close(fd)
        return offset + len(view), crc32c.crc32c(view, value=crc_zeros(offset))

    def write_in_place(self, stored: StoredChunk, offset: int, view: memoryview) -> tuple[int, int]:
        """A version that only adds bytes at or past the committed length, in the committed file."""
        assert offset >= stored.length
        path = self.file(stored.chunk_id, stored.gen)
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError as exc:
            raise self.write_error(exc, path) from exc
        try:
            if offset > stored.length or not len(view):
                os.ftruncate(fd, stored.length)  # bytes past the committed end may be a dropped version's
                os.ftruncate(fd, offset)
            if len(view):
                pwritev_all(fd, [view], offset)
            if self.fsync:
                os.fdatasync(fd)
        except OSError as exc:
            truncate_quietly(fd, stored.length)
            os.close(fd)
            raise self.write_error(exc, path) from exc
        os.close(fd)
        return offset + len(view), crc32c.crc32c(view, value=crc_zeros(offset - stored.length, stored.crc))

    def write_copy(self, stored: StoredChunk, gen: int, offset: int, view: memoryview,
                   length: int) -> tuple[int, int]:
        """A new file = committed[0:offset] + view + committed[offset+len(view):length] (copy-on-write)."""
        assert offset <= stored.length and offset + len(view) <= length
        suffix_start = min(offset + len(view), stored.length)
        suffix_end = min(length, stored.length)
        old = memoryview(bytearray(offset + suffix_end - suffix_start))
        prefix, suffix = old[:offset], old[offset:]
        src_path = self.file(stored.chunk_id, stored.gen)
        try:
            fd = os.open(src_path, os.O_RDONLY)
            try:
                preadv_exact(fd, prefix, 0, src_path)
                preadv_exact(fd, suffix, suffix_start, src_path)
            finally:
                os.close(fd)
        except OSError as exc:
            raise io_status_error(exc, f"target {self.path}: reading committed {src_path}") from exc
        path = self.file(stored.chunk_id, gen)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise self.write_error(exc, path) from exc
        try:
            pwritev_all(fd, [prefix, view, suffix], 0)
            if length > offset + len(view) + len(suffix):
                os.ftruncate(fd, length)  # zero-extend
            self.sync_new(fd, path)
        except OSError as exc:
            os.close(fd)
            unlink_quietly(path)
            raise self.write_error(exc, path) from exc
        os.close(fd)
        crc = crc32c.crc32c(suffix, value=crc32c.crc32c(view, value=crc32c.crc32c(prefix)))
        return length, crc_zeros(length - offset - len(view) - len(suffix), crc)

    def sync_new(self, fd: int, path: str) -> None:
        if self.fsync:
            os.fdatasync(fd)
            dir_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)  # the new name must be durable before a commit points at it
            finally:
                os.close(dir_fd)

    def write_error(self, exc: OSError, path: str):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return status_error(StatusCode.NO_SPACE, f"target {self.path} is full: writing {path}: {exc.strerror}")
        return io_status_error(exc, f"target {self.path}: writing {path}")


def unlink_quietly(path: str) -> None:
    # Unlink first, then drop cached descriptors (a cached one must not keep a removed version alive).
    # The other order leaked: a read that started its open after forget() but before the unlink cached
    # a descriptor of the file about to go (test_fd_cache.py's race failed 8 runs of 8 on a quiet machine). In this order an open
    # either fails (after the unlink) or is seen by forget() (entry dropped, or its insertion refused).
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot unlink %s (start-up reclaims it): %s", path, exc)
    for cache in list(_caches):
        cache.forget(path)


def truncate_quietly(fd: int, length: int) -> None:
    try:
        os.ftruncate(fd, length)
    except OSError as exc:
        log.warning("cannot cut a failed in-place write back to %d bytes: %s", length, exc)
