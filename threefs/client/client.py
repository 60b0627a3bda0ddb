"""The synchronous client: `threefs.connect()` -> Client.

    import threefs
    fs = threefs.connect()                      # ./.threefs/client.toml, $THREEFS_CONFIG or a path
    with fs.open("/data/x.bin", "wb") as f:
        f.write(b"...")
    fs.batch_read([("/data/x.bin", 0, buf1), ("/data/x.bin", 4096, buf2)])
"""

from __future__ import annotations

import atexit
import io
import os
import threading
import weakref
from pathlib import Path

import msgspec

from threefs.client import batch
from threefs.client.aio import AsyncClient, open_flags
from threefs.client.file import READ_AHEAD_BYTES_DEFAULT, WRITE_BEHIND_BYTES_DEFAULT, File, RawFile
from threefs.client.loop import LoopThread
from threefs.common.config import ClientConfig, find_client_config, load_toml
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.schemas import meta as m


class Client:
    """Fork-safe: a forked child (a DataLoader worker, a multiprocessing pool) that uses a Client
    made before the fork gets its own event loop and connections on first use; the parent's are
    left alone. Files opened before the fork must be reopened in the child (they say so)."""

    def __init__(self, config: ClientConfig):
        self.config = config
        self._generation = 0  # bumped when a forked child reconnects
        self._forked = False
        self._reconnect_lock = threading.Lock()
        self._start()
        _clients.add(self)

    def _start(self) -> None:
        self._loop = LoopThread()
        self._aio = AsyncClient(self.config)
        try:
            self._loop.run(self._aio.start())
        except BaseException:
            self._loop.stop()
            self._loop = None
            raise

    @property
    def aio(self) -> AsyncClient:
        if self._forked:
            self._reconnect_after_fork()
        return self._aio

    def _after_fork_in_child(self) -> None:
        # The loop thread does not exist in the child and the sockets are shared with the parent:
        # never touch them (closing a shared TCP connection's transport could shut it down for the
        # parent). Drop them and reconnect lazily.
        self._reconnect_lock = threading.Lock()
        if self._loop is not None:
            self._forked = True

    def _reconnect_after_fork(self) -> None:
        with self._reconnect_lock:
            if not self._forked:
                return
            self._forked = False
            self._loop = None
            self._aio = None
            self._generation += 1
            self._start()

    @classmethod
    def connect(cls, config: str | os.PathLike | ClientConfig | None = None, **overrides) -> "Client":
        """A client of the cluster that `config` names (a client.toml path, a ClientConfig, or None:
        ./.threefs/client.toml or $THREEFS_CONFIG). Keywords override fields of the config
        (`timeout_s=60`); an unknown one is refused naming the fields there are."""
        if not isinstance(config, ClientConfig):
            config = load_toml(find_client_config(str(config) if config else None), ClientConfig)
        if overrides:
            unknown = sorted(set(overrides) - set(ClientConfig.__struct_fields__))
            if unknown:
                raise status_error(StatusCode.INVALID_ARGUMENT,
                                   f"unknown client option(s) {', '.join(unknown)}; the options are "
                                   f"{', '.join(ClientConfig.__struct_fields__)}")
            config = msgspec.structs.replace(config, **overrides)
        return cls(config)

    def run(self, coro):
        """Run a coroutine of `self.aio` (the async client) on the client's event loop and return its
        result: the way to reach the async API from synchronous code (a sync method is exactly this)."""
        if self._forked:
            coro.close()
            raise RuntimeError("a coroutine of the parent's connection was run after fork; "
                               "use client.aio again in this process")
        if self._loop is None:
            coro.close()
            raise status_error(StatusCode.INVALID_ARGUMENT, "client is closed")
        return self._loop.run(coro)

    def close(self, timeout: float | None = None) -> None:
        if self._forked:  # a child that never used the inherited client: nothing of ours to close
            self._forked = False
            self._loop = None
            return
        if self._loop is not None:
            try:
                self._loop.run(self.aio.close(), timeout)
            finally:
                self._loop.stop()
                self._loop = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- namespace -------------------------------------------------------------------------------
    def stat(self, path: str) -> m.InodeAttr:
        return self.run(self.aio.stat(path))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except FileNotFoundError:
            return False

    def listdir(self, path: str = "/") -> list[str]:
        return [e.name for e in self.run(self.aio.listdir(path))]

    def scandir(self, path: str = "/") -> list[m.DirEntry]:
        return self.run(self.aio.listdir(path))

    def mkdir(self, path: str, mode: int = 0o755, parents: bool = False, exist_ok: bool = False,
              chunk_size: int = 0, stripe: int = 0) -> m.InodeAttr:
        try:
            return self.run(self.aio.mkdir(path, mode, parents, chunk_size, stripe))
        except FileExistsError:
            if exist_ok and self.stat(path).type == m.DIRECTORY:
                return self.stat(path)
            raise

    def remove(self, path: str) -> None:
        self.run(self.aio.remove(path))

    unlink = remove

    def rmdir(self, path: str) -> None:
        self.run(self.aio.rmdir(path))

    def rename(self, src: str, dst: str, noreplace: bool = False) -> None:
        self.run(self.aio.rename(src, dst, noreplace))

    def truncate(self, path: str, length: int) -> m.InodeAttr:
        return self.run(self.aio.truncate(path, length))

    # -- [meta] more of POSIX --------------------------------------------------------------------
    def lstat(self, path: str) -> m.InodeAttr:
        """Attributes of `path` itself (a final symlink is not followed)."""
        return self.run(self.aio.lstat(path))

    def batch_stat(self, paths: list[str], follow: bool = True) -> list:
        """stat (lstat with follow=False) of many paths, one meta call per limits.BATCH_STAT_MAX of them;
        each item is an InodeAttr or the error for that path."""
        return self.run(self.aio.batch_stat(list(paths), follow)) if paths else []

    def disk_usage(self, path: str) -> tuple[int, int, int]:
        """(bytes, files, directories) under `path` (`du`), counting apparent file lengths."""
        attr = self.stat(path)
        if attr.type != m.DIRECTORY:
            return attr.length, 1, 0
        total, files, dirs = 0, 0, 1
        stack = [path]
        while stack:
            d = stack.pop()
            entries = self.scandir(d)
            children = [f"{d.rstrip('/')}/{e.name}" for e in entries]
            for child, e, a in zip(children, entries, self.batch_stat(children, follow=False)):
                if e.type == m.DIRECTORY:
                    stack.append(child)
                    dirs += 1
                elif not isinstance(a, ThreeFSError):
                    total += a.length
                    files += 1
        return total, files, dirs

    def remove_tree(self, path: str) -> None:
        """`rm -r`: the tree leaves the namespace at once (one transaction); GC removes its files."""
        self.run(self.aio.remove(path, recursive=True))

    def symlink(self, target: str, path: str) -> m.InodeAttr:
        """Create `path` as a symlink to `target` (os.symlink's argument order)."""
        return self.run(self.aio.symlink(target, path))

    def readlink(self, path: str) -> str:
        return self.run(self.aio.readlink(path))

    def link(self, src: str, dst: str) -> m.InodeAttr:
        """A hard link: `dst` becomes another name of the file `src`."""
        return self.run(self.aio.link(src, dst))

    def chmod(self, path: str, mode: int) -> m.InodeAttr:
        return self.run(self.aio.setattr(path, mode=mode))

    def chown(self, path: str, uid: int | None = None, gid: int | None = None) -> m.InodeAttr:
        return self.run(self.aio.setattr(path, uid=uid, gid=gid))

    def utime(self, path: str, ns: tuple[int, int] | None = None) -> m.InodeAttr:
        """Set (atime_ns, mtime_ns), or both to now (os.utime's convention, in nanoseconds)."""
        atime, mtime = ns if ns is not None else (m.UTIME_NOW, m.UTIME_NOW)
        return self.run(self.aio.setattr(path, atime_ns=atime, mtime_ns=mtime))

    def statfs(self) -> m.StatfsRsp:
        """Capacity, used and free bytes (of file data: one replica's worth)."""
        return self.run(self.aio.statfs())

    # -- files -----------------------------------------------------------------------------------
    def open(self, path: str, mode: str = "rb", buffering: int = -1, *, chunk_size: int = 0,
             stripe: int = 0, perm: int = 0o644, encoding: str | None = None, errors: str | None = None,
             newline: str | None = None, read_ahead_bytes: int = READ_AHEAD_BYTES_DEFAULT,
             write_behind_bytes: int = WRITE_BEHIND_BYTES_DEFAULT):
        """Open a file. Binary modes give a File (read-ahead, write-behind); buffering=0 the RawFile
        (every call straight to storage); text modes ("r", "w", "rt", ...) a TextIOWrapper over a File."""
        text = "b" not in mode
        if text and buffering == 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, "text mode needs buffering (buffering=0 is "
                               "binary only)")
        flags, readable, writable = open_flags(mode.replace("t", "") + ("b" if text else ""))
        rsp = self.run(self.aio.open(path, flags, perm, chunk_size, stripe))
        if rsp.attr.type == m.DIRECTORY:
            if rsp.session:
                self.run(self.aio.close_file(rsp.attr.inode, rsp.session, -1))
            raise status_error(StatusCode.IS_DIRECTORY, f"{path} is a directory")
        if buffering == 0:
            return RawFile(self, path, rsp, flags, readable, writable)
        f = File(self, path, rsp, flags, readable, writable, read_ahead_bytes=read_ahead_bytes,
                 write_behind_bytes=write_behind_bytes)
        if text:
            return io.TextIOWrapper(f, encoding or "utf-8", errors, newline)
        return f

    def read_bytes(self, path: str) -> bytes:
        with self.open(path, "rb") as f:
            return f.read()

    def write_bytes(self, path: str, data) -> int:
        with self.open(path, "wb", buffering=0) as f:
            return f.write(data)

    def put(self, local: str | os.PathLike, remote: str, piece_bytes: int = 8 << 20,
            progress=None) -> int:
        """Copy a local file in; the write-behind keeps storage busy while the next piece is read.
        progress(nbytes) is called after each piece."""
        total = 0
        with open(local, "rb") as src, self.open(remote, "wb") as dst:
            while piece := src.read(piece_bytes):  # bytes: sent to storage without another copy
                total += dst.write(piece)
                if progress is not None:
                    progress(len(piece))
        return total

    def get(self, remote: str, local: str | os.PathLike, piece_bytes: int = 8 << 20,
            progress=None) -> int:
        """Copy a file out; read-ahead fetches the next pieces while this one is written locally."""
        total = 0
        buf = bytearray(piece_bytes)
        view = memoryview(buf)
        with self.open(remote, "rb") as src, open(local, "wb") as dst:
            while n := src.readinto(buf):
                dst.write(view[:n])
                total += n
                if progress is not None:
                    progress(n)
        return total

    def batch_read(self, items, *, raise_on_error: bool = True) -> list:
        """Read many (file, offset, buffer) or (file, offset, length, buffer) items with all their
        IOs in flight together (see threefs.client.batch).

        `file` is a path, an InodeAttr or an open file; `buffer` any writable contiguous buffer
        (bytearray, memoryview, numpy array). Returns bytes read per item (short at end of file); with
        raise_on_error=False failed items hold their exception instead.
        """
        items = list(items)
        batch.check_batch_size(len(items))
        resolved = batch.resolve_read_items(self, items)
        return _check_results(batch.run_partial(self, resolved, self.aio.batch_read), raise_on_error)

    def batch_write(self, items, *, create: bool = False, raise_on_error: bool = True) -> list:
        """Write many (file, offset, buffer) or (file, offset, length, buffer) items, all in flight
        together; then publish the new lengths. Items must not overlap. `file` is a path (create=True
        creates missing files), an InodeAttr or a file object open for writing. Returns bytes written
        per item, or (raise_on_error=False) the item's exception."""
        items = list(items)
        batch.check_batch_size(len(items))
        requests, targets = batch.open_write_targets(self, items, create)
        try:
            results = batch.run_partial(self, requests, lambda reqs: batch.write_batch(self.aio, reqs))
            for req, r in zip(requests, results):
                if not isinstance(r, BaseException) and not isinstance(req, BaseException):
                    attr, offset, view = req
                    t = targets[attr.inode]
                    t.end = max(t.end, offset + len(view))
        finally:
            batch.close_write_targets(self, targets)
        return _check_results(results, raise_on_error)

    def walk_files(self, path: str):
        """Yield (path, attr) of every file under path, depth first."""
        for entry in self.scandir(path):
            child = str(Path(path) / entry.name)
            if entry.type == m.DIRECTORY:
                yield from self.walk_files(child)
            else:
                yield child, self.stat(child)


_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for c in list(_clients):
        c._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_at_exit() -> None:
    """Stop every client still open when the interpreter exits: a daemon loop thread still inside
    uvloop while the interpreter finalises crashed ~1 in 4 exits of processes with torch imported."""
    for c in list(_clients):
        try:
            c.close(timeout=5)  # never hang the exit on a peer that does not answer
        except Exception:  # exiting anyway: a peer that is gone must not turn exit into an error
            pass


def _check_results(results: list, raise_on_error: bool) -> list:
    if raise_on_error:
        for r in results:
            if isinstance(r, BaseException):
                raise r
    return results
