"""The synchronous client: `threefs.connect()` -> Client.

    import threefs
    fs = threefs.connect()                      # ./.threefs/client.toml, $THREEFS_CONFIG or a path
    with fs.open("/data/x.bin", "wb") as f:
        f.write(b"...")
    fs.batch_read([("/data/x.bin", 0, buf1), ("/data/x.bin", 4096, buf2)])
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import io
import logging
import os
import threading
import weakref
from pathlib import Path

import msgspec
import numpy as np

from threefs.client import batch
from threefs.client.aio import AsyncClient, open_flags, read_results
from threefs.client.file import READ_AHEAD_BYTES_DEFAULT, WRITE_BEHIND_BYTES_DEFAULT, File, RawFile
from threefs.client.loop import LoopThread
from threefs.client.meta_sync import NOT_TAKEN, SyncMetaCalls
from threefs.client.storage_sync import SyncStorageReads
from threefs.common import limits
from threefs.common.config import ClientConfig, find_client_config, load_toml
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.client import as_bytes_view
from threefs.rpc.schemas import meta as m

log = logging.getLogger(__name__)

# [meta] Closing a file opened for writing to which nothing was written changes nothing but its write session
# (length, times and data are as they were), so that close costs no round trip of its own: the session ends
# in a batch, with others, at most DEFERRED_CLOSE_S later (or once DEFERRED_CLOSES_MAX are waiting, or before
# this client's next removal, rename or truncate, or when the client closes). See docs/meta.md.
DEFERRED_CLOSE_S = 0.2
DEFERRED_CLOSES_MAX = 128


class Client:
    """Fork-safe: a forked child (a DataLoader worker, a multiprocessing pool) that uses a Client
    made before the fork gets its own event loop and connections on first use; the parent's are
    left alone. Files opened before the fork must be reopened in the child (they say so)."""

    def __init__(self, config: ClientConfig):
        self.config = config
        self._generation = 0  # bumped when a forked child reconnects
        self._forked = False
        self._reconnect_lock = threading.Lock()
        self._deferred_lock = threading.Lock()
        self._deferred: list[m.SessionRef] = []  # [meta] write sessions to end in the next batch
        self._deferred_armed = False  # a flush is scheduled on the loop
        self._sync: SyncMetaCalls | None = None
        self._storage_sync: SyncStorageReads | None = None
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
        self._sync = SyncMetaCalls(self._aio, self.config.timeout_s)  # [meta] calls from the caller's thread
        self._storage_sync = SyncStorageReads(self._aio, self.config.timeout_s)  # small batch reads too

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
        self._deferred_lock = threading.Lock()
        self._deferred, self._deferred_armed = [], False  # the parent's sessions: the parent ends them
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
                with self._deferred_lock:
                    refs, self._deferred = self._deferred, []
                if refs:  # bounded like the rest of close: a cluster that is gone must not hold up exit
                    try:
                        self._loop.run(self._end_sessions_now(refs), timeout if timeout is not None else 10)
                    except (ThreeFSError, TimeoutError, concurrent.futures.TimeoutError) as e:
                        # they end when meta prunes the sessions of this client (docs/meta.md)
                        log.warning("could not end %d write sessions: %s", len(refs), e)
                if self._sync is not None:
                    self._sync.close()
                if self._storage_sync is not None:
                    self._storage_sync.close()
                self._loop.run(self.aio.close(), timeout)
            finally:
                self._loop.stop()
                self._loop = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- [meta] the path of a metadata call -----------------------------------------------------
    def _meta(self, method: str, req, rsp_type):
        """One meta call from the caller's thread (client/meta_sync.py): no trip through the event loop.
        Falls back to the loop's connection when the call cannot be made here."""
        aio = self.aio  # a forked child reconnects here
        sync, lt = self._sync, self._loop
        if sync is not None and lt is not None and threading.get_ident() != lt._thread.ident:
            rsp = sync.call(method, req, rsp_type)
            if rsp is not NOT_TAKEN:
                return rsp
        return self.run(aio.meta_call(method, req, rsp_type))

    def _close_file(self, inode: int, session: str, length_hint: int) -> m.InodeAttr:
        """End a write session now; length_hint >= 0 has meta measure the length (see aio.close_file)."""
        return self._meta("close", m.CloseReq(inode, session, length_hint), m.AttrRsp).attr

    def _sync_file(self, inode: int, session: str, length_hint: int, truncate_ver: int) -> m.InodeAttr:
        return self._meta("sync", m.SyncReq(inode, session, length_hint, truncate_ver), m.AttrRsp).attr

    def _end_session_later(self, inode: int, session: str) -> None:
        """The close of a file nothing was written to: its session ends in the next batch (module top)."""
        with self._deferred_lock:
            self._deferred.append(m.SessionRef(inode, session))
            n, arm = len(self._deferred), not self._deferred_armed
            self._deferred_armed = True
        if n >= DEFERRED_CLOSES_MAX:
            self._flush_closes()
        elif arm and self._loop is not None:
            self._loop.loop.call_soon_threadsafe(self._arm_flush)

    def _arm_flush(self) -> None:  # on the loop
        asyncio.get_running_loop().call_later(DEFERRED_CLOSE_S, self._flush_on_loop)

    def _flush_on_loop(self) -> None:  # on the loop
        with self._deferred_lock:
            self._deferred_armed = False
            refs, self._deferred = self._deferred, []
        if refs:
            task = asyncio.ensure_future(self._end_sessions(refs))
            task.add_done_callback(_quiet)

    def _flush_closes(self) -> None:
        """End every deferred session now (from the caller's thread)."""
        with self._deferred_lock:
            refs, self._deferred = self._deferred, []
        if refs and not self._forked:
            self._end_sessions_sync(refs)

    def _end_sessions_sync(self, refs: list[m.SessionRef]) -> None:
        try:
            self._meta("close_many", m.CloseManyReq(refs), m.OkRsp)
        except ThreeFSError as e:
            if e.code != StatusCode.UNKNOWN_METHOD:
                raise
            for r in refs:  # a meta server older than close_many
                self._close_file(r.inode, r.session, -1)

    async def _end_sessions_now(self, refs: list[m.SessionRef]) -> None:
        aio = self._aio
        try:
            await aio.meta_call("close_many", m.CloseManyReq(refs), m.OkRsp)
        except ThreeFSError as e:
            if e.code != StatusCode.UNKNOWN_METHOD:
                raise
            for r in refs:  # a meta server older than close_many
                await aio.close_file(r.inode, r.session, -1)

    async def _end_sessions(self, refs: list[m.SessionRef]) -> None:
        try:
            await self._end_sessions_now(refs)
        except ThreeFSError as e:
            if e.code in (StatusCode.UNAVAILABLE, StatusCode.TIMEOUT):  # try again with the next batch
                with self._deferred_lock:
                    self._deferred[:0] = refs
                    arm = not self._deferred_armed
                    self._deferred_armed = True
                if arm:
                    self._arm_flush()
            else:
                log.warning("could not end %d write sessions: %s", len(refs), e)

    # -- namespace -------------------------------------------------------------------------------
    def stat(self, path: str) -> m.InodeAttr:
        return self._meta("stat", m.StatReq(path), m.StatRsp).attr

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except FileNotFoundError:
            return False

    def listdir(self, path: str = "/") -> list[str]:
        return [e.name for e in self.scandir(path)]

    def scandir(self, path: str = "/") -> list[m.DirEntry]:
        entries, after = [], ""
        while True:  # paginated: never asks for more than one page at a time
            rsp = self._meta("readdir", m.ReaddirReq(path, after, limits.READDIR_PAGE_MAX), m.ReaddirRsp)
            entries.extend(rsp.entries)
            if not rsp.more or not rsp.entries:
                return entries
            after = rsp.entries[-1].name

    def mkdir(self, path: str, mode: int = 0o755, parents: bool = False, exist_ok: bool = False,
              chunk_size: int = 0, stripe: int = 0) -> m.InodeAttr:
        try:
            return self._meta("mkdir", m.MkdirReq(path, mode, parents, chunk_size, stripe), m.AttrRsp).attr
        except FileExistsError:
            if exist_ok and self.stat(path).type == m.DIRECTORY:
                return self.stat(path)
            raise

    def remove(self, path: str) -> None:
        self._flush_closes()  # an unlinked file's GC waits for its sessions: end ours first
        self._meta("unlink", m.PathReq(path), m.OkRsp)

    unlink = remove

    def rmdir(self, path: str) -> None:
        self._flush_closes()
        self._meta("rmdir", m.PathReq(path), m.OkRsp)

    def rename(self, src: str, dst: str, noreplace: bool = False) -> None:
        self._flush_closes()
        self._meta("rename", m.RenameReq(src, dst, noreplace), m.OkRsp)

    def truncate(self, path: str, length: int) -> m.InodeAttr:
        self._flush_closes()  # a file without writers needs no removal on storage when it grows
        return self._meta("truncate", m.TruncateReq(path, length), m.AttrRsp).attr

    # -- [meta] more of POSIX --------------------------------------------------------------------
    def lstat(self, path: str) -> m.InodeAttr:
        """Attributes of `path` itself (a final symlink is not followed)."""
        return self._meta("stat", m.StatReq(path, False), m.StatRsp).attr

    def batch_stat(self, paths: list[str], follow: bool = True) -> list:
        """stat (lstat with follow=False) of many paths, one meta call per limits.BATCH_STAT_MAX of them;
        each item is an InodeAttr or the error for that path."""
        paths = list(paths)
        if not paths:
            return []
        if len(paths) > limits.BATCH_STAT_MAX:  # several calls at once, through the loop
            return self.run(self.aio.batch_stat(paths, follow))
        req = m.BatchStatReq([m.PathAt(m.NO_PARENT, p) for p in paths], follow)
        rsp = self._meta("batch_stat", req, m.BatchStatRsp)
        return [a if a is not None else status_error(code, msg)
                for a, code, msg in zip(rsp.attrs, rsp.errors, rsp.messages)]

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
        self._flush_closes()
        self._meta("remove", m.RemoveReq(path, recursive=True), m.OkRsp)

    def symlink(self, target: str, path: str) -> m.InodeAttr:
        """Create `path` as a symlink to `target` (os.symlink's argument order)."""
        return self._meta("symlink", m.SymlinkReq(path, target), m.AttrRsp).attr

    def readlink(self, path: str) -> str:
        return self._meta("readlink", m.StatReq(path, False), m.ReadlinkRsp).target

    def link(self, src: str, dst: str) -> m.InodeAttr:
        """A hard link: `dst` becomes another name of the file `src`."""
        return self._meta("link", m.LinkReq(src, dst), m.AttrRsp).attr

    def chmod(self, path: str, mode: int) -> m.InodeAttr:
        return self._meta("setattr", m.SetattrReq(path, mode=mode), m.AttrRsp).attr

    def chown(self, path: str, uid: int | None = None, gid: int | None = None) -> m.InodeAttr:
        return self._meta("setattr", m.SetattrReq(path, uid=uid, gid=gid), m.AttrRsp).attr

    def utime(self, path: str, ns: tuple[int, int] | None = None) -> m.InodeAttr:
        """Set (atime_ns, mtime_ns), or both to now (os.utime's convention, in nanoseconds)."""
        atime, mtime = ns if ns is not None else (m.UTIME_NOW, m.UTIME_NOW)
        return self._meta("setattr", m.SetattrReq(path, atime_ns=atime, mtime_ns=mtime), m.AttrRsp).attr

    def statfs(self) -> m.StatfsRsp:
        """Capacity, used and free bytes (of file data: one replica's worth)."""
        return self._meta("statfs", m.StatfsReq(), m.StatfsRsp)

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
        if flags & os.O_TRUNC:
            self._flush_closes()  # truncating a file that has no writers needs no removal past its end
        rsp = self._meta("open", m.OpenReq(path, flags, perm, chunk_size, stripe), m.OpenRsp)
        if rsp.attr.type == m.DIRECTORY:
            if rsp.session:
                self._close_file(rsp.attr.inode, rsp.session, -1)
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

    def batch_read(self, items, *, raise_on_error: bool = True, check_arrival: bool = True) -> list:
        """Read many (file, offset, buffer) or (file, offset, length, buffer) items with all their
        IOs in flight together (see threefs.client.batch).

        `file` is a path, an InodeAttr or an open file; `buffer` any writable contiguous buffer
        (bytearray, memoryview, numpy array). Returns bytes read per item (short at end of file); with
        raise_on_error=False failed items hold their exception instead.

        check_arrival=False skips the per-IO crc32c of the bytes against the one storage computed as
        it read them (damage between storage and this process), for callers that check their own
        end-to-end checksum of the bytes afterwards and read again with the check on if it fails (the
        checkpoint loader). Whole chunks that storage sends zero-copy (unchecked there; see
        docs/storage.md, Reads) are checked on arrival all the same.
        """
        items = list(items)
        batch.check_batch_size(len(items))
        resolved = batch.resolve_read_items(self, items)
        return _check_results(batch.run_partial(resolved, lambda reqs: self._read_requests(reqs, check_arrival)),
                              raise_on_error)

    def read_columns(self, attrs, file_of, offsets, lengths, dest, dest_offsets, *,
                     check_arrival: bool = True) -> list:
        """batch_read for reads given as columns, for callers that hold them as arrays (the FFRecord
        reader): read r is `lengths[r]` bytes of `attrs[file_of[r]]` (InodeAttrs) at `offsets[r]` into
        `dest[dest_offsets[r]:...]`, one writable buffer for the whole batch. No Python object per read on
        the way in. Returns a result per read as batch_read(raise_on_error=False) does: bytes read (short at
        end of file) or the read's exception."""
        view = as_bytes_view(dest)
        if view.readonly:
            raise status_error(StatusCode.INVALID_ARGUMENT, "read_columns: the destination is read-only")
        cols = [np.asarray(c) for c in (file_of, offsets, lengths, dest_offsets)]
        n = len(cols[0])
        if any(c.ndim != 1 or len(c) != n or (n and c.dtype.kind not in "iu") for c in cols):
            raise status_error(StatusCode.INVALID_ARGUMENT, "read_columns: file_of, offsets, lengths and "
                               "dest_offsets must be flat integer arrays of one length")
        batch.check_batch_size(n)
        if not n:
            return []
        file_of, offsets, lengths, dest_offsets = (c.astype(np.int64, copy=False) for c in cols)
        if int(file_of.min()) < 0 or int(file_of.max()) >= len(attrs):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"read_columns: file_of outside [0, {len(attrs)})")
        if int(offsets.min()) < 0 or int(lengths.min()) < 0 or int(dest_offsets.min()) < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, "read_columns: negative offset or length")
        if int((dest_offsets + lengths).max()) > len(view):
            raise status_error(StatusCode.INVALID_ARGUMENT, "read_columns: a read ends past the destination's "
                               f"{len(view)} bytes")
        aio = self.aio  # a forked child reconnects here
        routing = aio.mgmtd.routing
        if routing is None:
            routing = self.run(aio.mgmtd.get())
        built = aio.build_read_columns(routing, list(attrs), file_of, offsets, lengths, view, dest_offsets)
        rb, rep, sizes, req_errors = built
        return self._read_built(rb, check_arrival, lambda: read_results(rb, rep, sizes.tolist(), req_errors))

    def _read_requests(self, requests: list, check_arrival: bool = True) -> list:
        """Read resolved (attr, offset, view) requests: from the caller's thread where it can
        (client/storage_sync.py), the rest on the event loop's path."""
        aio = self.aio  # a forked child reconnects here
        routing = aio.mgmtd.routing
        if routing is None or self._loop is None or len(requests) > limits.BATCH_IOS_MAX:
            return self.run(aio.batch_read(requests, check_arrival=check_arrival))
        sync, failed = self._storage_sync, None
        if len(requests) == 1 and sync is not None and threading.get_ident() != self._loop._thread.ident:
            got = sync.read_one(*requests[0])  # one small read: scalar, no batch arrays (None: not taken)
            if got is not None:
                return [got]
            failed = sync.take_failed()
        built = aio.build_read_batch(routing, requests)
        if failed is not None:  # the replica read_one just failed on is tried last
            built[0].avoid.update((k, {failed}) for k in range(len(built[0].ios)))
        return self._read_built(built[0], check_arrival, lambda: read_results(*built))

    def _read_at(self, attr: m.InodeAttr, offset: int, view: memoryview) -> int:
        """Read up to len(view) bytes of the file at offset (clamped to attr's length) into view, from the
        caller's thread where it can (as batch_read does); returns the bytes read, or raises the read's
        error. For file objects' reads that the streaming engine would not prefetch for (a jump)."""
        r = self._read_requests([(attr, offset, view)])[0]
        if isinstance(r, BaseException):
            raise r
        return r

    def _read_built(self, rb, check_arrival: bool, results):
        """Read a built ReadBatch: from the caller's thread where it can (client/storage_sync.py), the rest
        (retries, big IOs, all connections busy) on the event loop's path; then results()."""
        aio = self.aio
        sync, lt = self._storage_sync, self._loop
        rb.check_arrival = check_arrival
        if sync is None or lt is None or threading.get_ident() == lt._thread.ident:
            self.run(aio.storage.read_batch(rb))
            return results()
        retry = sync.read(rb)
        if retry is None:
            self.run(aio.storage.read_batch(rb))
        elif len(retry):
            self.run(aio.storage.read_batch(rb, pending=retry))
        return results()

    def batch_write(self, items, *, create: bool = False, raise_on_error: bool = True) -> list:
        """Write many (file, offset, buffer) or (file, offset, length, buffer) items, all in flight
        together; then publish the new lengths. Items must not overlap. `file` is a path (create=True
        creates missing files), an InodeAttr or a file object open for writing. Returns bytes written
        per item, or (raise_on_error=False) the item's exception."""
        items = list(items)
        batch.check_batch_size(len(items))
        requests, targets = batch.open_write_targets(self, items, create)
        try:
            results = batch.run_partial(requests, lambda reqs: self.run(batch.write_batch(self.aio, reqs)))
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


def _quiet(task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved (logged where it happened)


def _check_results(results: list, raise_on_error: bool) -> list:
    if raise_on_error:
        for r in results:
            if isinstance(r, BaseException):
                raise r
    return results
