"""Where FFRecord bytes live: plain OS files (local disk, a FUSE mount) or threefs through a Client.

Both backends offer the same small surface to the reader and the writer:
- `open_read(path)` -> a handle (an fd or an InodeAttr, resolved once) and the file size;
- `read(ios)` -> per IO the bytes read or the exception (every IO of a call in flight together on
  threefs: one `batch_read`);
- `create(path)` -> a file object for a temporary name, `publish(tmp, path)` renames it into place,
  `discard(tmp)` removes it;
- `list_ffr(path)` -> the sorted `*.ffr` files of a directory, or None if `path` is not a directory.
"""

from __future__ import annotations

import atexit
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from threefs.client import DIRECTORY
from threefs.common import limits
from threefs.common.status import StatusCode, ThreeFSError, status_error


@dataclass(frozen=True)
class Opened:
    path: str
    handle: object  # an fd (local) or an InodeAttr (threefs)
    size: int


def temp_name(path: str) -> str:
    """A hidden sibling of `path` that does not end in .ffr (directory readers must not pick it up)."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


IO_THREADS_FUSE = 16  # reads in flight on a FUSE file: each one is a round trip through the daemon


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in mount points as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def fs_type(path: str) -> str:
    """The file system type of the mount holding `path` ("ext4", "fuse.threefs", ...; "" if unknown)."""
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mnt = _unescape(fields[4])
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, kind = mnt, right.split()[0]
    return kind


class LocalFiles:
    """Plain OS files read with os.preadv straight into the caller's buffers (releases the GIL).

    `io_threads` > 0 keeps that many reads of a batch in flight from a thread pool (FUSE mounts, slow
    disks); 0 reads in the calling thread (page cache: a thread hand-off costs more than the read)."""

    client = None

    def __init__(self, io_threads: int = 0):
        self.io_threads = io_threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0

    def open_read(self, path: str) -> Opened:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # Samples are read at random: read-ahead would make the kernel fetch up to read_ahead_kb
            # around each one (4 MiB on our FUSE mount), bytes nobody asked for.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            return Opened(path, fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise

    def close(self, opened: Opened) -> None:
        os.close(opened.handle)

    def read(self, ios: list[tuple[Opened, int, memoryview]]) -> list[int | BaseException]:
        if self.io_threads <= 0 or len(ios) < 2:
            return [self._read_full(f.handle, off, view) for f, off, view in ios]
        if self._pool is None or self._pool_pid != os.getpid():  # a forked child has no pool threads
            self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="ffr-io")
            self._pool_pid = os.getpid()
        return list(self._pool.map(lambda io: self._read_full(io[0].handle, io[1], io[2]), ios))

    def read_runs(self, opened: list[Opened], file_of: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                  dest: np.ndarray, dest_offsets: np.ndarray) -> list[int | BaseException]:
        """Run r: lengths[r] bytes of opened[file_of[r]] at offsets[r] into dest[dest_offsets[r]:...]."""
        view = memoryview(dest)
        return self.read([(opened[f], off, view[p:p + n]) for f, off, p, n in
                          zip(file_of.tolist(), offsets.tolist(), dest_offsets.tolist(), lengths.tolist())])

    def shutdown(self) -> None:
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=False)
        self._pool = None

    @staticmethod
    def _read_full(fd: int, offset: int, view: memoryview) -> int | BaseException:
        try:
            done = os.preadv(fd, [view], offset)
            while 0 < done < len(view):  # a regular file reads fully unless it ends early
                n = os.preadv(fd, [view[done:]], offset + done)
                if n == 0:
                    break
                done += n
        except OSError as e:
            return e
        return done

    def list_ffr(self, path: str) -> list[str] | None:
        if not os.path.isdir(path):
            return None
        return [os.path.join(path, name) for name in sorted(os.listdir(path)) if name.endswith(".ffr")]

    def create(self, tmp: str):
        return open(tmp, "wb")

    def publish(self, f, tmp: str, path: str) -> None:
        f.flush()
        os.fsync(f.fileno())  # the header must be on disk before the name points at it
        f.close()
        os.rename(tmp, path)
        dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def discard(self, f, tmp: str) -> None:
        try:
            f.close()
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)


class ThreeFSFiles:
    """threefs paths through a Client: files resolved to InodeAttrs once, reads as one batch_read."""

    def __init__(self, client):
        self.client = client

    def shutdown(self) -> None:
        pass

    def open_read(self, path: str) -> Opened:
        attr = self.client.stat(path)
        if attr.type == DIRECTORY:
            raise status_error(StatusCode.IS_DIRECTORY, f"{path} is a directory, not an FFRecord file")
        return Opened(path, attr, attr.length)

    def close(self, opened: Opened) -> None:
        pass

    def read(self, ios: list[tuple[Opened, int, memoryview]]) -> list[int | BaseException]:
        out: list[int | BaseException] = []
        for base in range(0, len(ios), limits.BATCH_IOS_MAX):
            part = ios[base:base + limits.BATCH_IOS_MAX]
            out += self.client.batch_read([(f.handle, off, view) for f, off, view in part],
                                          raise_on_error=False)
        return out

    def read_runs(self, opened: list[Opened], file_of: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                  dest: np.ndarray, dest_offsets: np.ndarray) -> list[int | BaseException]:
        """Run r: lengths[r] bytes of opened[file_of[r]] at offsets[r] into dest[dest_offsets[r]:...], as one
        Client.read_columns per BATCH_IOS_MAX runs (only the files the runs name are passed)."""
        out: list[int | BaseException] = []
        for base in range(0, len(file_of), limits.BATCH_IOS_MAX):
            part = slice(base, base + limits.BATCH_IOS_MAX)
            f = file_of[part]
            if len(opened) == 1:
                attrs = [opened[0].handle]
            else:  # (file_of is sorted: the reader sorts the runs by file)
                used, f = np.unique(f, return_inverse=True)
                attrs = [opened[i].handle for i in used.tolist()]
            out += self.client.read_columns(attrs, f, offsets[part], lengths[part], dest, dest_offsets[part])
        return out

    def list_ffr(self, path: str) -> list[str] | None:
        if self.client.stat(path).type != DIRECTORY:
            return None
        names = sorted(e.name for e in self.client.scandir(path) if e.name.endswith(".ffr"))
        return [path.rstrip("/") + "/" + name for name in names]

    def create(self, tmp: str):
        return self.client.open(tmp, "wb")

    def publish(self, f, tmp: str, path: str) -> None:
        f.close()  # publishes the exact length; the rename then makes the whole file visible at once
        self.client.rename(tmp, path)

    def discard(self, f, tmp: str) -> None:
        try:
            f.close()
        finally:
            try:
                self.client.remove(tmp)
            except FileNotFoundError:
                pass

    def makedirs(self, path: str) -> None:
        self.client.mkdir(path, parents=True, exist_ok=True)

    def exists(self, path: str) -> bool:
        return self.client.exists(path)


def backend_for(client, io_threads: int = 0) -> LocalFiles | ThreeFSFiles:
    return LocalFiles(io_threads) if client is None else ThreeFSFiles(client)


_shared_clients: dict[bytes, object] = {}
_shared_lock = threading.Lock()


def shared_client(config):
    """One Client per cluster config per process, for readers rebuilt from a pickle (spawned
    DataLoader workers): many datasets of one worker share its connections."""
    import msgspec

    from threefs.client.client import Client

    key = msgspec.msgpack.encode(config)
    with _shared_lock:
        client = _shared_clients.get(key)
        if client is None:  # readers rebuilt from pickles share it for the process's life
            if not _shared_clients:
                atexit.register(_close_shared_clients)
            client = _shared_clients[key] = Client(config)
        return client


def _close_shared_clients() -> None:
    """At exit, stop the shared clients' loop threads: a daemon thread still inside uvloop while the
    interpreter finalizes can crash the process (seen as a segfault of spawned DataLoader workers)."""
    with _shared_lock:
        clients = list(_shared_clients.values())
        _shared_clients.clear()
    for client in clients:
        try:
            client.close()
        except Exception:  # exiting anyway: a peer that is gone must not turn exit into an error
            pass


def result_error(result: int | BaseException, expected: int, what: str) -> ThreeFSError | None:
    """None if an IO read `expected` bytes, else an error naming `what` was being read."""
    if isinstance(result, BaseException):
        code = getattr(result, "code", StatusCode.IO_ERROR)
        return status_error(code, f"{what}: {result}")
    if result != expected:
        return status_error(StatusCode.IO_ERROR, f"{what}: read {result} of {expected} bytes (the file "
                            "is shorter than its tables say: truncated or changed while open)")
    return None
