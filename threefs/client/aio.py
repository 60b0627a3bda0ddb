"""The asyncio client: namespace calls to meta (with failover) and file data straight to storage."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
import zlib

import numpy as np

from threefs.cluster.mgmtd_client import MgmtdClient
from threefs.cluster.storage_client import IO_DTYPE, ReadBatch, ReadItem, StorageClient
from threefs.common import limits
from threefs.common.config import ClientConfig
from threefs.common.ids import CHUNK_INDEX_MAX, chunk_id
from threefs.common.layout import chain_of_chunk, split_range
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.client import RpcClient, as_bytes_view
from threefs.rpc.schemas import meta as m
from threefs.rpc.schemas.mgmtd import META

log = logging.getLogger(__name__)

META_KEEPALIVE_S = 10.0  # [meta] well under meta's client_session_timeout_s (120 s by default)


class AsyncClient:
    def __init__(self, config: ClientConfig):
        self.config = config
        self.rpc = RpcClient(config.token, senders_max=config.request_to_send)
        self.mgmtd = MgmtdClient(self.rpc, config.mgmtd)
        self.storage = StorageClient(self.rpc, self.mgmtd, timeout=config.timeout_s)
        # [meta] Calls keep to the meta server that answered last; the first is picked by a seed of host and
        # process id, so that processes spread over the servers (the thread path, meta_sync.py, does the
        # same). The meta servers of a host share one SQLite file: a server that sees only its own commits
        # keeps its caches (SQLite's pages, the KV read cache); calls alternating between two servers made
        # each call find the other server's commit and start over.
        self._meta_seed = zlib.crc32(socket.gethostname().encode()) + os.getpid()
        self.meta_keep_to: int | None = None  # node id of the meta server that answered last
        self._refresher: asyncio.Task | None = None
        # [meta] request ids make retried mutations idempotent; acting_user is sent on every meta call
        # that takes a user (only privileged tokens may set it: the FUSE daemon sets it per call instead)
        self._meta_request_ids = itertools.count(1)
        self.acting_user: m.UserCred | None = None
        self._keepalive: asyncio.Task | None = None
        self.meta_calls = collections.Counter()  # per method (the FUSE daemon logs them)
        self._chain_cache: dict = {}  # (routing version, layout) -> chain per stripe position

    async def start(self) -> "AsyncClient":
        await self.mgmtd.refresh(force=True)
        self._refresher = asyncio.ensure_future(self.mgmtd.refresh_loop(1.0))
        self._keepalive = asyncio.ensure_future(self._meta_keepalive_loop())  # [meta]
        return self

    async def close(self) -> None:
        """Stop the background tasks (awaiting them, so none is left pending) and the connections."""
        tasks = [t for t in (self._refresher, self._keepalive, self.mgmtd._refreshing) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.rpc.close()

    # -- meta ------------------------------------------------------------------------------------
    async def meta_call(self, method: str, req, rsp_type):
        """Call any live meta server (they are stateless); fail over when one does not answer."""
        self.meta_calls[method] += 1
        routing = await self.mgmtd.get()
        servers = routing.nodes_of_type(META)
        if not servers:
            routing = await self.mgmtd.refresh(force=True)
            servers = routing.nodes_of_type(META)
        if not servers:
            raise status_error(StatusCode.UNAVAILABLE, "no meta server is alive; see `threefs status`")
        if getattr(req, "request_id", None) == 0:  # [meta] one id per call: failover retries reuse it
            req.request_id = next(self._meta_request_ids)
        if self.acting_user is not None and getattr(req, "user", 0) is None:
            req.user = self.acting_user
        n = len(servers)
        start = self._meta_seed % n
        keep_to = self.meta_keep_to
        if keep_to is not None:
            for i, node in enumerate(servers):
                if node.node_id == keep_to:
                    start = i
                    break
        errors = []
        for i in range(n):
            node = servers[(start + i) % n]
            try:
                rsp, _ = await self.rpc.call(node.addr, f"meta.{method}", req, rsp_type,
                                             timeout=self.config.timeout_s)
                self.meta_keep_to = node.node_id
                return rsp
            except ThreeFSError as e:
                if e.code not in (StatusCode.UNAVAILABLE, StatusCode.TIMEOUT):
                    self.meta_keep_to = node.node_id  # it answered
                    raise
                errors.append(f"meta {node.node_id} at {node.addr}: {e.message}")
        raise status_error(StatusCode.UNAVAILABLE, "; ".join(errors))

    async def stat(self, path: str) -> m.InodeAttr:
        return (await self.meta_call("stat", m.StatReq(path), m.StatRsp)).attr

    async def mkdir(self, path: str, mode: int = 0o755, parents: bool = False, chunk_size: int = 0,
                    stripe: int = 0) -> m.InodeAttr:
        return (await self.meta_call("mkdir", m.MkdirReq(path, mode, parents, chunk_size, stripe),
                                     m.AttrRsp)).attr

    async def listdir(self, path: str) -> list[m.DirEntry]:
        entries, after = [], ""
        while True:  # paginated: never asks for more than one page at a time
            rsp = await self.meta_call("readdir", m.ReaddirReq(path, after, limits.READDIR_PAGE_MAX),
                                       m.ReaddirRsp)
            entries.extend(rsp.entries)
            if not rsp.more or not rsp.entries:
                return entries
            after = rsp.entries[-1].name

    async def open(self, path: str, flags: int, mode: int = 0o644, chunk_size: int = 0,
                   stripe: int = 0) -> m.OpenRsp:
        return await self.meta_call("open", m.OpenReq(path, flags, mode, chunk_size, stripe), m.OpenRsp)

    async def close_file(self, inode: int, session: str, length_hint: int, exact: bool = True) -> m.InodeAttr:
        """End a write session; the length becomes at least `length_hint`, measured on storage unless
        exact=False (the caller was the file's only writer and every write was acknowledged)."""
        return (await self.meta_call("close", m.CloseReq(inode, session, length_hint, exact), m.AttrRsp)).attr

    async def remove(self, path: str, recursive: bool = False) -> None:
        """unlink; with recursive=True any entry, a directory tree handed to GC in one transaction."""
        if recursive:  # [meta]
            await self.meta_call("remove", m.RemoveReq(path, recursive=True), m.OkRsp)
            return
        await self.meta_call("unlink", m.PathReq(path), m.OkRsp)

    async def rmdir(self, path: str) -> None:
        await self.meta_call("rmdir", m.PathReq(path), m.OkRsp)

    async def rename(self, src: str, dst: str, noreplace: bool = False) -> None:
        await self.meta_call("rename", m.RenameReq(src, dst, noreplace), m.OkRsp)

    async def truncate(self, path: str, length: int) -> m.InodeAttr:
        return (await self.meta_call("truncate", m.TruncateReq(path, length), m.AttrRsp)).attr

    # -- [meta] the rest of POSIX, and the same operations on (parent inode, name) for FUSE -----------------
    # Inode-based calls take meta inode ids (the root is 0). `user` (UserCred) acts for that user; only a
    # privileged token (the cluster token) may pass one. Each is one meta RPC, retried on another meta
    # server when one dies (mutations carry request ids, so a retry never acts twice).
    async def _meta_keepalive_loop(self) -> None:
        """Tell meta this client is alive, so its write sessions are not pruned (runs until close)."""
        while True:
            await asyncio.sleep(META_KEEPALIVE_S)
            try:
                await self.meta_call("keepalive", m.KeepaliveReq(), m.OkRsp)
            except ThreeFSError as e:
                log.debug("meta keepalive failed: %s", e)

    async def lstat(self, path: str, user: m.UserCred | None = None) -> m.InodeAttr:
        return (await self.meta_call("stat", m.StatReq(path, False, user=user), m.StatRsp)).attr

    async def lookup(self, parent: int, name: str, user: m.UserCred | None = None,
                     missing_ok: bool = False) -> m.InodeAttr | None:
        """The entry `name` in directory inode `parent` (not following a final symlink). `missing_ok`: None
        when it does not exist (a server older than that raises FileNotFoundError as without it)."""
        if missing_ok:
            req = m.StatReq(name, False, parent=parent, user=user, missing_ok=True)
            return (await self.meta_call("stat", req, m.LookupRsp)).attr
        req = m.StatReq(name, False, parent=parent, user=user)
        return (await self.meta_call("stat", req, m.StatRsp)).attr

    async def getattr(self, inode: int, user: m.UserCred | None = None) -> m.InodeAttr:
        return (await self.meta_call("stat", m.StatReq("", False, parent=inode, user=user), m.StatRsp)).attr

    async def batch_stat(self, items: list, follow: bool = True,
                         user: m.UserCred | None = None) -> list[m.InodeAttr | ThreeFSError]:
        """stat of many paths or (parent inode, path) pairs; each item gets its attributes or its error.
        Up to limits.BATCH_STAT_MAX items are one meta call (one snapshot); more go as several calls at
        once."""
        pairs = [m.PathAt(*i) if isinstance(i, tuple) else m.PathAt(m.NO_PARENT, i) for i in items]
        step = limits.BATCH_STAT_MAX
        rsps = await asyncio.gather(*(
            self.meta_call("batch_stat", m.BatchStatReq(pairs[i:i + step], follow, user), m.BatchStatRsp)
            for i in range(0, len(pairs), step)))
        return [a if a is not None else status_error(code, msg)
                for rsp in rsps for a, code, msg in zip(rsp.attrs, rsp.errors, rsp.messages)]

    async def readdir(self, path: str = "", start_after: str = "", limit: int = limits.READDIR_PAGE_MAX, *,
                      parent: int = m.NO_PARENT, user: m.UserCred | None = None) -> m.ReaddirRsp:
        """One page of a directory (a path, or parent=inode with path ""); `more` says whether to go on
        from the last name."""
        return await self.meta_call("readdir", m.ReaddirReq(path, start_after, limit, parent, user),
                                    m.ReaddirRsp)

    async def create_at(self, parent: int, name: str, flags: int, mode: int = 0o644,
                        user: m.UserCred | None = None, chunk_size: int = 0, stripe: int = 0) -> m.OpenRsp:
        """open(name, flags | O_CREAT, mode) in directory inode `parent`."""
        req = m.OpenReq(name, flags | os.O_CREAT, mode, chunk_size, stripe, parent, user)
        return await self.meta_call("open", req, m.OpenRsp)

    async def open_inode(self, inode: int, flags: int, user: m.UserCred | None = None) -> m.OpenRsp:
        return await self.meta_call("open", m.OpenReq("", flags, parent=inode, user=user), m.OpenRsp)

    # The *_at calls (directory inode + name, as FUSE names things) answer with meta's whole reply: with
    # the attributes of the directories they changed (`parents`, as committed), which the FUSE daemon keeps.
    async def mkdir_at(self, parent: int, name: str, mode: int = 0o755,
                       user: m.UserCred | None = None) -> m.AttrRsp:
        req = m.MkdirReq(name, mode, parent=parent, user=user)
        return await self.meta_call("mkdir", req, m.AttrRsp)

    async def unlink_at(self, parent: int, name: str, user: m.UserCred | None = None) -> m.ChangedRsp:
        return await self.meta_call("unlink", m.PathReq(name, parent, user), m.ChangedRsp)

    async def rmdir_at(self, parent: int, name: str, user: m.UserCred | None = None) -> m.ChangedRsp:
        return await self.meta_call("rmdir", m.PathReq(name, parent, user), m.ChangedRsp)

    async def rename_at(self, parent: int, name: str, new_parent: int, new_name: str,
                        noreplace: bool = False, user: m.UserCred | None = None) -> m.ChangedRsp:
        req = m.RenameReq(name, new_name, noreplace, parent, new_parent, user)
        return await self.meta_call("rename", req, m.ChangedRsp)

    async def link(self, src: str, dst: str, user: m.UserCred | None = None) -> m.InodeAttr:
        return (await self.meta_call("link", m.LinkReq(src, dst, user=user), m.AttrRsp)).attr

    async def link_at(self, inode: int, new_parent: int, new_name: str,
                      user: m.UserCred | None = None) -> m.AttrRsp:
        req = m.LinkReq("", new_name, inode, new_parent, user)
        return await self.meta_call("link", req, m.AttrRsp)

    async def symlink(self, target: str, path: str, user: m.UserCred | None = None) -> m.InodeAttr:
        """A symlink at `path` pointing to `target` (os.symlink's order)."""
        return (await self.meta_call("symlink", m.SymlinkReq(path, target, user=user), m.AttrRsp)).attr

    async def symlink_at(self, parent: int, name: str, target: str,
                         user: m.UserCred | None = None) -> m.AttrRsp:
        req = m.SymlinkReq(name, target, parent, user)
        return await self.meta_call("symlink", req, m.AttrRsp)

    async def readlink(self, path: str = "", *, parent: int = m.NO_PARENT,
                       user: m.UserCred | None = None) -> str:
        """The target of a symlink: a path, or parent=inode with path ""."""
        req = m.StatReq(path, False, parent=parent, user=user)
        return (await self.meta_call("readlink", req, m.ReadlinkRsp)).target

    async def setattr(self, path: str = "", *, parent: int = m.NO_PARENT, follow: bool = True,
                      mode: int | None = None, uid: int | None = None, gid: int | None = None,
                      atime_ns: int | None = None, mtime_ns: int | None = None, length: int | None = None,
                      user: m.UserCred | None = None, chunk_size: int | None = None,
                      stripe: int | None = None, table_id: int | None = None) -> m.InodeAttr:
        """chmod / chown / utimens (m.UTIME_NOW = now) / truncate / a directory's default layout; None
        leaves a field alone. A path, or parent=inode with path ""."""
        return (await self.setattr_rsp(path, parent=parent, follow=follow, mode=mode, uid=uid, gid=gid,
                                       atime_ns=atime_ns, mtime_ns=mtime_ns, length=length, user=user,
                                       chunk_size=chunk_size, stripe=stripe, table_id=table_id)).attr

    async def setattr_rsp(self, path: str = "", *, parent: int = m.NO_PARENT, follow: bool = True,
                          mode: int | None = None, uid: int | None = None, gid: int | None = None,
                          atime_ns: int | None = None, mtime_ns: int | None = None, length: int | None = None,
                          user: m.UserCred | None = None, chunk_size: int | None = None,
                          stripe: int | None = None, table_id: int | None = None,
                          publish: m.SyncReq | None = None) -> m.AttrRsp:
        """setattr's whole answer; `publish`: a writer's length hint published first in the same
        transaction (AttrRsp.published False: the server predates it and did not)."""
        req = m.SetattrReq(path, parent, follow, mode, uid, gid, atime_ns, mtime_ns, length, user,
                           chunk_size=chunk_size, stripe=stripe, table_id=table_id, publish=publish)
        return await self.meta_call("setattr", req, m.AttrRsp)

    async def sync_file(self, inode: int, session: str, length_hint: int = -1, truncate_ver: int = -1,
                        exact: bool = False) -> m.InodeAttr:
        """While writing: raise the file's length to `length_hint` (cheap), or with exact=True (fsync)
        set it from storage. `truncate_ver` is the InodeAttr.truncate_ver the writer knows."""
        req = m.SyncReq(inode, session, length_hint, truncate_ver, exact)
        return (await self.meta_call("sync", req, m.AttrRsp)).attr

    async def statfs(self) -> m.StatfsRsp:
        return await self.meta_call("statfs", m.StatfsReq(), m.StatfsRsp)

    # -- data ------------------------------------------------------------------------------------
    async def _table(self, attr: m.InodeAttr) -> list[int]:
        routing = await self.mgmtd.get()
        return routing.table(attr.layout.table_id).chains

    async def read_into(self, attr: m.InodeAttr, offset: int, buf) -> int:
        """Read up to len(buf) bytes at offset (clamped to the file length); returns bytes read."""
        dest = as_bytes_view(buf)
        n = max(0, min(len(dest), attr.length - offset))
        if n == 0:
            return 0
        items = await self._read_items(attr, offset, dest[:n])
        await self.storage.read(items)
        for it in items:
            if it.error is not None:
                raise it.error
        return n

    async def _read_items(self, attr: m.InodeAttr, offset: int, dest: memoryview) -> list[ReadItem]:
        layout = attr.layout
        table = await self._table(attr)
        return [ReadItem(chain_of_chunk(layout, span.chunk_index, table),
                         chunk_id(attr.inode, span.chunk_index), span.chunk_offset, span.length,
                         dest[span.buffer_offset:span.buffer_offset + span.length])
                for span in split_range(layout.chunk_size, offset, len(dest))]

    async def write_at(self, attr: m.InodeAttr, offset: int, buf) -> int:
        """Write buf at offset: one update per chunk piece, all in flight together."""
        data = as_bytes_view(buf)
        layout = attr.layout
        table = await self._table(attr)
        await asyncio.gather(*(
            self.storage.write_chunk(chain_of_chunk(layout, span.chunk_index, table),
                                     chunk_id(attr.inode, span.chunk_index), span.chunk_offset,
                                     data[span.buffer_offset:span.buffer_offset + span.length],
                                     layout.chunk_size)
            for span in split_range(layout.chunk_size, offset, len(data))))
        return len(data)

    async def batch_read(self, requests: list[tuple[m.InodeAttr, int, memoryview]], *,
                         check_arrival: bool = True) -> list[int | ThreeFSError]:
        """Many (file attr, offset, destination) reads in one go; a result (bytes or error) per item.

        The file ranges are cut into chunk IOs in bulk (numpy, per file not per IO in Python) into one
        ReadBatch, which the storage client sends as packed requests (see StorageClient.read_batch)."""
        if len(requests) > limits.BATCH_IOS_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"batch of {len(requests)} IOs exceeds {limits.BATCH_IOS_MAX}")
        if not requests:
            return []
        built = self.build_read_batch(await self.mgmtd.get(), requests)
        built[0].check_arrival = check_arrival  # see Client.batch_read
        await self.storage.read_batch(built[0])
        return read_results(*built)

    def build_read_batch(self, routing, requests: list[tuple[m.InodeAttr, int, memoryview]]):
        """(ReadBatch of the requests' chunk IOs, request of each IO, bytes asked per request (clamped to
        the file length), {request: error} for requests that cannot be read at all). Plain CPU work."""
        files: dict[int, int] = {}  # id(attr) -> file number
        attrs: list[m.InodeAttr] = []
        file_of, offsets, sizes, dests = [], [], [], []
        for attr, offset, dest in requests:
            f = files.get(id(attr))
            if f is None:
                if attr.type != m.FILE:
                    raise status_error(StatusCode.IS_DIRECTORY, f"inode {attr.inode} is not a file")
                f = files[id(attr)] = len(attrs)
                attrs.append(attr)
            file_of.append(f)
            offsets.append(offset)
            sizes.append(max(0, min(len(dest), attr.length - offset)))
            dests.append(dest)
        off = np.array(offsets, dtype=np.int64)
        ios, rep, begin, req_errors = self._chunk_ios(routing, attrs, np.array(file_of, dtype=np.int64), off,
                                                      np.array(sizes, dtype=np.int64))
        return ReadBatch(ios, dests, rep.tolist(), (begin - off[rep]).tolist()), rep, sizes, req_errors

    def build_read_columns(self, routing, attrs: list[m.InodeAttr], file_of: np.ndarray, offsets: np.ndarray,
                           lengths: np.ndarray, dest: memoryview, dest_offsets: np.ndarray):
        """build_read_batch for reads given as columns (no Python object per read): read r is `lengths[r]`
        bytes of file `attrs[file_of[r]]` at `offsets[r]` into `dest[dest_offsets[r]:...]` (clamped to the
        file length like build_read_batch). The arrays are int64 and checked by the caller
        (Client.read_columns). Same result shape as build_read_batch, sizes as an int array."""
        for a in attrs:
            if a.type != m.FILE or a.layout is None:
                raise status_error(StatusCode.IS_DIRECTORY if a.type == m.DIRECTORY else StatusCode.INVALID_ARGUMENT,
                                   f"inode {a.inode} is not a regular file")
        file_len = np.array([a.length for a in attrs], dtype=np.int64)
        sizes = np.clip(np.minimum(lengths, file_len[file_of] - offsets), 0, None)
        ios, rep, begin, req_errors = self._chunk_ios(routing, attrs, file_of, offsets, sizes)
        dest_off = (dest_offsets[rep] + begin - offsets[rep]).tolist()
        return ReadBatch(ios, [dest], [0] * len(rep), dest_off), rep, sizes, req_errors

    def _chunk_ios(self, routing, attrs: list[m.InodeAttr], file_of: np.ndarray, off: np.ndarray, n: np.ndarray):
        """One IO per (read, chunk touched): (IO_DTYPE records, read of each IO, each IO's first byte in its
        file, {read: error} for reads that cannot be done at all). Vectorised over the reads."""
        if len(attrs) == 1:
            fast = self._one_chunk_ios(routing, attrs[0], off, n)
            if fast is not None:
                return fast
        # per file: chunk size, inode, and the chain of chunk index i = lookup[base + i % stripe]
        cs_f = np.array([a.layout.chunk_size for a in attrs], dtype=np.int64)
        inode_f = np.array([a.inode for a in attrs], dtype=np.uint64)
        base_f = np.zeros(len(attrs), dtype=np.int64)
        stripe_f = np.zeros(len(attrs), dtype=np.int64)
        lookups, file_errors, at = [], {}, 0
        for f, a in enumerate(attrs):
            try:
                chains = self._chains_of(routing, a.layout)
            except ThreeFSError as e:
                file_errors[f] = e
                chains = np.zeros(1, dtype=np.uint32)
            base_f[f], stripe_f[f] = at, len(chains)
            lookups.append(chains)
            at += len(chains)
        lookup = np.concatenate(lookups)
        cs = cs_f[file_of]
        first = off // cs
        count = np.where(n > 0, (off + n - 1) // cs - first + 1, 0)
        req_errors: dict[int, ThreeFSError] = {}
        too_far = np.flatnonzero((first + count - 1 > CHUNK_INDEX_MAX) & (n > 0))
        for r in too_far.tolist():
            req_errors[r] = status_error(StatusCode.FILE_TOO_LARGE, f"read at offset {int(off[r])} of inode "
                                         f"{attrs[file_of[r]].inode}: chunk index exceeds {CHUNK_INDEX_MAX}")
        for f, e in file_errors.items():
            for r in np.flatnonzero(file_of == f).tolist():
                req_errors.setdefault(r, e)
        if req_errors:
            count[list(req_errors)] = 0
        # one IO per (request, chunk touched)
        rep = np.repeat(np.arange(len(n), dtype=np.int64), count)
        within = np.arange(len(rep), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        index = first[rep] + within
        cs_io = cs[rep]
        chunk_start = index * cs_io
        begin = np.maximum(off[rep], chunk_start)
        end = np.minimum(off[rep] + n[rep], chunk_start + cs_io)
        f_io = file_of[rep]
        ios = np.zeros(len(rep), dtype=IO_DTYPE)
        ios["chain"] = lookup[base_f[f_io] + index % stripe_f[f_io]]
        ios["chunk"]["inode"] = inode_f[f_io]
        ios["chunk"]["index"] = index
        ios["offset"] = begin - chunk_start
        ios["length"] = end - begin
        return ios, rep, begin, req_errors

    def _one_chunk_ios(self, routing, attr: m.InodeAttr, off: np.ndarray, n: np.ndarray):
        """_chunk_ios of reads of one file that each lie in one chunk and are not empty (small random reads:
        FFRecord samples), in a third of the numpy calls; None for anything else."""
        cs = attr.layout.chunk_size
        first = off // cs
        if not len(n) or int(n.min()) <= 0 or ((off + n - 1) // cs != first).any():
            return None
        if int(first.max()) > CHUNK_INDEX_MAX:
            return None  # (the general path says which read)
        try:
            chains = self._chains_of(routing, attr.layout)
        except ThreeFSError:
            return None
        ios = np.zeros(len(n), dtype=IO_DTYPE)
        ios["chain"] = chains[first % len(chains)]
        ios["chunk"]["inode"] = attr.inode
        ios["chunk"]["index"] = first
        ios["offset"] = off - first * cs
        ios["length"] = n
        return ios, np.arange(len(n), dtype=np.int64), off, {}

    def _chains_of(self, routing, layout) -> np.ndarray:
        """The chain of each stripe position of a layout (chunk i is on entry i % stripe), cached per routing."""
        key = (routing.version, layout)
        chains = self._chain_cache.get(key)
        if chains is None:
            table = routing.table(layout.table_id).chains
            chains = np.array([chain_of_chunk(layout, i, table) for i in range(layout.stripe)], dtype=np.uint32)
            if len(self._chain_cache) >= 4096:
                self._chain_cache.clear()
            self._chain_cache[key] = chains
        return chains


def read_results(batch, rep, sizes, req_errors) -> list[int | ThreeFSError]:
    """The result of each request of a read batch built by `build_read_batch`, once it was read: bytes
    read, or the first error of its IOs."""
    for k in sorted(batch.errors):  # the first failed IO of a request is its error
        req_errors.setdefault(int(rep[k]), batch.errors[k])
    return [req_errors.get(r, size) for r, size in enumerate(sizes)]


def open_flags(mode: str) -> tuple[int, bool, bool]:
    """Python binary mode -> (os flags, readable, writable)."""
    base = mode.replace("b", "")
    table = {
        "r": (os.O_RDONLY, True, False),
        "r+": (os.O_RDWR, True, True),
        "w": (os.O_WRONLY | os.O_CREAT | os.O_TRUNC, False, True),
        "w+": (os.O_RDWR | os.O_CREAT | os.O_TRUNC, True, True),
        "a": (os.O_WRONLY | os.O_CREAT | os.O_APPEND, False, True),
        "a+": (os.O_RDWR | os.O_CREAT | os.O_APPEND, True, True),
        "x": (os.O_WRONLY | os.O_CREAT | os.O_EXCL, False, True),
        "x+": (os.O_RDWR | os.O_CREAT | os.O_EXCL, True, True),
    }
    if base not in table or "b" not in mode or "t" in mode:
        raise status_error(StatusCode.INVALID_ARGUMENT,
                           f"mode {mode!r} not supported: use a binary mode (rb, wb, ab, xb, r+b, ...)")
    return table[base]
