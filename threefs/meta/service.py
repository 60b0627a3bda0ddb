"""The meta service: stateless RPC front of MetaStore, plus its work on storage (truncate, length, GC).

Any meta server serves any request: all state is in the KV, so clients spread their calls and fail over
freely. Each handler works out who the call acts for (`users.acting_user`: the token's principal, or the
`user` a privileged principal passes), notes the client as alive, and runs the operation as one KV
transaction — with the request id, so a retry after a lost reply gets the first reply back.

Operations that remove data on storage do it *before* their metadata transaction, for the file the
transaction then checks it still is (truncate_ver): a lazy length can then never cover data a truncate
removed. See docs/meta.md.
"""

from __future__ import annotations

import logging
import os
import socket

from threefs.cluster.heartbeat import heartbeat_loop
from threefs.cluster.mgmtd_client import MgmtdClient
from threefs.cluster.storage_client import StorageClient
from threefs.common.config import ServiceConfig
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.meta.background import ClientSessions, GcWorker
from threefs.meta.data import DataOps, meta_owner
from threefs.meta.ops_attr import Changes, LengthUpdate
from threefs.meta.ops_create import Replan
from threefs.meta.service_kvstore import KvstoreRpcs
from threefs.meta.store import DEFAULT_TABLE_ID, Caller, MetaStore, check_client_id
from threefs.meta.users import acting_user
from threefs.rpc.schemas import meta as m
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.server import CallContext, rpc

log = logging.getLogger(__name__)

TRUNCATE_ROUNDS_MAX = 8  # remove-then-commit attempts while other truncates keep changing the file
NO_FILE = (-1, -1)  # an O_TRUNC plan for a path that named no file


class MetaService(KvstoreRpcs):
    def __init__(self, config: ServiceConfig, kv, mgmtd: MgmtdClient, storage: StorageClient):
        self.config = config
        self.mgmtd = mgmtd
        self.store = MetaStore(kv, table_info=self._table_info)
        self.data = DataOps(self.store, mgmtd, storage)
        self.gc = GcWorker(self.store, self.data, config.meta_gc_delay_s, self._owns)
        self.clients = ClientSessions(self.store, self.data, config.client_session_timeout_s)
        self.known_users: dict[str, m.UserCred] = {}  # principal -> uid/gid, from mgmtd's token list
        self.hb_version = 0
        # The RPC server listens (and this service is added to it) before start() has registered with
        # mgmtd and fetched routing; until then every call is answered UNAVAILABLE, which clients take
        # to another meta server. (Serving them found no chain table: creates failed for good with
        # CHAIN_TABLE_NOT_FOUND right after a meta restart, 5 failed ops in a 30-minute soak.)
        self.started = False

    def _table_info(self, table_id: int) -> tuple[int, int, int]:
        routing = self.mgmtd.routing
        if routing is None or table_id not in routing.info.tables:
            hint = ("the cluster has no storage chains yet (wait for `threefs up` to finish, see `threefs "
                    "status`)" if table_id == DEFAULT_TABLE_ID else "create it with `threefs admin "
                    "create-chain-table`, or give the directory another table")
            raise status_error(StatusCode.CHAIN_TABLE_NOT_FOUND, f"chain table {table_id} does not exist: "
                               f"{hint}")
        table = routing.info.tables[table_id]
        return table.table_id, table.version, len(table.chains)

    def _owns(self):
        return meta_owner(self.mgmtd.routing, self.config.node_id, ms.META)

    def _is_leader(self) -> bool:
        """The lowest live meta node id prunes sessions and idempotency records."""
        return self._owns()(0)

    def set_users(self, entries) -> None:
        """Install mgmtd's token list (TokenEntry: name, uid, gid) as principal -> user."""
        from threefs.rpc.auth import principal_of

        self.known_users = {principal_of(e): m.UserCred(e.uid, e.gid) for e in entries}

    async def start(self) -> None:
        await self.register()
        await self.store.init()
        self.started = True

    async def register(self) -> None:
        req = ms.RegisterReq(self.config.node_id, ms.META, self.config.addr, socket.gethostname(),
                             self.config.failure_domain)
        await self.mgmtd.call("register", req, ms.RegisterRsp)
        await self.mgmtd.refresh(force=True)

    def background(self) -> list:
        """The service's loops, each running for its lifetime."""
        return [self.heartbeat_loop(), self.gc.run(self.config.gc_interval_s),
                self.clients.run(self._is_leader)]

    async def heartbeat_loop(self) -> None:
        """Runs for the service's lifetime."""
        await heartbeat_loop(self.config.name, self.config.heartbeat_interval_s, self.heartbeat_once,
                             self.register)

    async def heartbeat_once(self) -> None:
        self.hb_version += 1
        rsp = await self.mgmtd.call("heartbeat", ms.HeartbeatReq(self.config.node_id, self.hb_version,
                                                                 problems=self.store.problems.current()),
                                    ms.HeartbeatRsp)
        if self.mgmtd.routing is None or rsp.routing_version != self.mgmtd.routing.version:
            await self.mgmtd.refresh()

    def _caller(self, ctx: CallContext, req) -> Caller:
        if not self.started:
            raise status_error(StatusCode.UNAVAILABLE, f"meta server {self.config.name} is starting (not yet "
                               "registered with mgmtd); another meta server serves the call")
        check_client_id(ctx.client_id)
        self.clients.seen(ctx.client_id)
        user = acting_user(ctx.principal, getattr(req, "user", None), self.known_users)
        return Caller(user, ctx.client_id, getattr(req, "request_id", 0))

    # -- lookups ---------------------------------------------------------------------------------
    @rpc(m.StatReq)
    async def stat(self, ctx: CallContext, req: m.StatReq) -> m.StatRsp | m.LookupRsp:
        caller = self._caller(ctx, req)
        attr = await self.store.stat(req.path, req.follow, parent=req.parent, user=caller.user,
                                     missing_ok=req.missing_ok)
        return m.LookupRsp(attr) if req.missing_ok else m.StatRsp(attr)

    @rpc(m.BatchStatReq)
    async def batch_stat(self, ctx: CallContext, req: m.BatchStatReq) -> m.BatchStatRsp:
        caller = self._caller(ctx, req)
        items = [(i.parent, i.path) for i in req.items]
        results = await self.store.batch_stat(items, req.follow, caller.user)
        ok = [r if isinstance(r, m.InodeAttr) else None for r in results]
        codes = [0 if isinstance(r, m.InodeAttr) else int(r.code) for r in results]
        return m.BatchStatRsp(ok, codes, ["" if isinstance(r, m.InodeAttr) else r.message for r in results])

    @rpc(m.ReaddirReq)
    async def readdir(self, ctx: CallContext, req: m.ReaddirReq) -> m.ReaddirRsp:
        caller = self._caller(ctx, req)
        entries, more = await self.store.readdir(req.path, req.start_after, req.limit, parent=req.parent,
                                                 user=caller.user)
        return m.ReaddirRsp(entries, more)

    @rpc(m.StatReq)
    async def readlink(self, ctx: CallContext, req: m.StatReq) -> m.ReadlinkRsp:
        caller = self._caller(ctx, req)
        return m.ReadlinkRsp(await self.store.readlink(req.path, parent=req.parent, user=caller.user))

    @rpc(m.StatfsReq)
    async def statfs(self, ctx: CallContext, req: m.StatfsReq) -> m.StatfsRsp:
        self._caller(ctx, req)
        return await self.data.statfs()

    @rpc(m.KeepaliveReq)
    async def keepalive(self, ctx: CallContext, req: m.KeepaliveReq) -> m.OkRsp:
        self._caller(ctx, req)
        return m.OkRsp()

    # -- creating ----------------------------------------------------------------------------------
    @rpc(m.MkdirReq)
    async def mkdir(self, ctx: CallContext, req: m.MkdirReq) -> m.AttrRsp:
        caller, dirs = self._caller(ctx, req), []
        attr = await self.store.mkdir(req.path, req.mode, req.parents, req.chunk_size, req.stripe,
                                      parent=req.parent, caller=caller, dirs=dirs)
        return m.AttrRsp(attr, dirs)

    @rpc(m.OpenReq)
    async def open(self, ctx: CallContext, req: m.OpenReq) -> m.OpenRsp:
        caller = self._caller(ctx, req)
        writing = req.flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        stamp = writing and self.clients.needs_stamp(ctx.client_id)
        dirs = [] if req.flags & os.O_CREAT else None
        if req.flags & os.O_TRUNC:
            rsp = await self._open_truncating(req, caller, stamp, dirs)
        else:
            rsp = await self.store.open(req.path, req.flags, req.mode, req.chunk_size, req.stripe,
                                        parent=req.parent, caller=caller, stamp_client=stamp, dirs=dirs)
        if dirs:
            rsp.parents = dirs
        if req.flags & os.O_APPEND and rsp.attr.type == m.FILE:  # appends start at the true end
            rsp.attr = await self.data.sync_exact(rsp.attr.inode, "", LengthUpdate(), "", end_session=False)
        return rsp

    async def _open_truncating(self, req: m.OpenReq, caller: Caller, stamp: bool,
                               dirs: list | None) -> m.OpenRsp:
        """O_TRUNC: remove the file's chunks first, then truncate in the open's transaction, for the same
        file and truncate version (else again). With O_CREAT the name is most often new (`open(p, "w")`),
        so the open is tried first as for no file (NO_FILE): it creates the file, or raises Replan when
        one is there, and the plan follows (a create costs one transaction, not a failed plan too)."""
        if req.flags & os.O_CREAT:
            try:
                return await self.store.open(req.path, req.flags, req.mode, req.chunk_size, req.stripe,
                                             parent=req.parent, caller=caller, trunc_plan=NO_FILE,
                                             stamp_client=stamp, dirs=dirs)
            except Replan:
                pass
        for _ in range(TRUNCATE_ROUNDS_MAX):
            try:
                plan = await self.store.truncate_plan(req.path, 0, parent=req.parent, user=caller.user)
            except ThreeFSError:
                plan = None  # no file to truncate (or none we may): the open itself says what is wrong
            if plan is not None and plan.needs_job(0):
                await self.data.remove_from(plan.inode, plan.layout, 0)
            try:
                return await self.store.open(req.path, req.flags, req.mode, req.chunk_size, req.stripe,
                                             parent=req.parent, caller=caller,
                                             trunc_plan=plan.key if plan is not None else NO_FILE,
                                             stamp_client=stamp, dirs=dirs)
            except Replan:
                continue
        raise status_error(StatusCode.BUSY, f"{req.path} kept changing while it was opened with O_TRUNC; "
                           "try again")

    @rpc(m.SymlinkReq)
    async def symlink(self, ctx: CallContext, req: m.SymlinkReq) -> m.AttrRsp:
        caller, dirs = self._caller(ctx, req), []
        attr = await self.store.symlink(req.path, req.target, parent=req.parent, caller=caller, dirs=dirs)
        return m.AttrRsp(attr, dirs)

    @rpc(m.MknodReq)
    async def mknod(self, ctx: CallContext, req: m.MknodReq) -> m.AttrRsp:
        caller, dirs = self._caller(ctx, req), []
        attr = await self.store.mknod(req.path, req.type, req.mode, req.rdev, parent=req.parent,
                                      caller=caller, dirs=dirs)
        return m.AttrRsp(attr, dirs)

    @rpc(m.XattrReq)
    async def xattr(self, ctx: CallContext, req: m.XattrReq) -> m.XattrRsp:
        return await self.store.xattr(req, self._caller(ctx, req))

    @rpc(m.LinkReq)
    async def link(self, ctx: CallContext, req: m.LinkReq) -> m.AttrRsp:
        caller, dirs = self._caller(ctx, req), []
        attr = await self.store.link(req.src, req.dst, src_parent=req.src_parent, dst_parent=req.dst_parent,
                                     caller=caller, dirs=dirs)
        return m.AttrRsp(attr, dirs)

    # -- removing and moving -------------------------------------------------------------------------
    @rpc(m.PathReq)
    async def unlink(self, ctx: CallContext, req: m.PathReq) -> m.ChangedRsp:
        dirs = []
        await self.store.unlink(req.path, parent=req.parent, caller=self._caller(ctx, req), dirs=dirs)
        return m.ChangedRsp(dirs)

    @rpc(m.PathReq)
    async def rmdir(self, ctx: CallContext, req: m.PathReq) -> m.ChangedRsp:
        dirs = []
        await self.store.rmdir(req.path, parent=req.parent, caller=self._caller(ctx, req), dirs=dirs)
        return m.ChangedRsp(dirs)

    @rpc(m.RemoveReq)
    async def remove(self, ctx: CallContext, req: m.RemoveReq) -> m.ChangedRsp:
        dirs = []
        await self.store.remove(req.path, req.recursive, parent=req.parent, caller=self._caller(ctx, req),
                                dirs=dirs)
        return m.ChangedRsp(dirs)

    @rpc(m.RenameReq)
    async def rename(self, ctx: CallContext, req: m.RenameReq) -> m.ChangedRsp:
        dirs = []
        await self.store.rename(req.src, req.dst, req.noreplace, src_parent=req.src_parent,
                                dst_parent=req.dst_parent, caller=self._caller(ctx, req), dirs=dirs)
        return m.ChangedRsp(dirs)

    # -- attributes and length -------------------------------------------------------------------------
    @rpc(m.SetattrReq)
    async def setattr(self, ctx: CallContext, req: m.SetattrReq) -> m.AttrRsp:
        caller = self._caller(ctx, req)
        changes = Changes(req.mode, req.uid, req.gid, req.atime_ns, req.mtime_ns, req.chunk_size, req.stripe,
                          req.table_id)
        attr = None
        publish = req.publish
        if publish is not None and (publish.exact or req.length is not None):
            raise status_error(StatusCode.INVALID_ARGUMENT, "setattr publishes a writer's length hint "
                               "(exact=False) only, and not with a truncate: send sync / truncate for those")
        if req.length is not None:
            attr = await self._truncate(req.path, req.parent, req.length, caller)
        if any(v is not None for v in changes) or attr is None:
            update = None if publish is None else (publish.inode, publish.session,
                                                   LengthUpdate(publish.length_hint, publish.truncate_ver))
            attr = await self.store.setattr(req.path, changes, req.follow, parent=req.parent, caller=caller,
                                            publish=update)
        return m.AttrRsp(attr, published=publish is not None)

    @rpc(m.TruncateReq)
    async def truncate(self, ctx: CallContext, req: m.TruncateReq) -> m.AttrRsp:
        return m.AttrRsp(await self._truncate(req.path, req.parent, req.length, self._caller(ctx, req)))

    async def _truncate(self, path: str, parent: int, length: int, caller: Caller) -> m.InodeAttr:
        """Remove the chunks past `length` (when the file shrinks or has writers), then set the length,
        for the same file and truncate version as the removal (else again)."""
        for _ in range(TRUNCATE_ROUNDS_MAX):
            plan = await self.store.truncate_plan(path, length, parent=parent, user=caller.user)
            if plan.needs_job(length):
                await self.data.remove_from(plan.inode, plan.layout, length)
            try:
                return await self.store.truncate(path, length, parent=parent, user=caller.user, plan=plan.key)
            except Replan:
                continue
        raise status_error(StatusCode.BUSY, f"{path} kept changing while it was truncated; try again")

    @rpc(m.CloseReq)
    async def close(self, ctx: CallContext, req: m.CloseReq) -> m.AttrRsp:
        """End a write session; if the writer wrote, the length is measured on storage."""
        self._caller(ctx, req)
        update = LengthUpdate(req.length_hint)
        if req.length_hint < 0 or not req.exact:
            return m.AttrRsp(await self.store.sync(req.inode, req.session, update, ctx.client_id, True))
        return m.AttrRsp(await self.data.sync_exact(req.inode, req.session, update, ctx.client_id, True))

    @rpc(m.CloseManyReq)
    async def close_many(self, ctx: CallContext, req: m.CloseManyReq) -> m.OkRsp:
        """[meta] The closes of files nothing was written to, batched by the client (one transaction)."""
        self._caller(ctx, req)
        await self.store.end_sessions([(i.inode, i.session) for i in req.items], ctx.client_id)
        return m.OkRsp()

    @rpc(m.SyncReq)
    async def sync(self, ctx: CallContext, req: m.SyncReq) -> m.AttrRsp:
        """A writer's periodic length hint (lazy), or fsync (exact, from storage)."""
        self._caller(ctx, req)
        update = LengthUpdate(req.length_hint, req.truncate_ver)
        if not req.exact:
            return m.AttrRsp(await self.store.sync(req.inode, req.session, update, ctx.client_id))
        return m.AttrRsp(await self.data.sync_exact(req.inode, req.session, update, ctx.client_id, False))
