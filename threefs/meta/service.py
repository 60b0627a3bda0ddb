"""The meta service: stateless RPC front of MetaStore, plus the storage side of truncate and GC.

Any meta server serves any request: all state is in the KV. Chunk removal (O_TRUNC, truncate, GC of
unlinked files) is done here with the storage client, over every chain of the file's stripe.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from threefs.client.mgmtd_client import MgmtdClient
from threefs.client.storage_client import StorageClient
from threefs.common.config import ServiceConfig
from threefs.common.ids import chunk_id, inode_chunk_range
from threefs.common.layout import Layout, chain_of_chunk
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.meta.store import MetaStore
from threefs.rpc.schemas import meta as m
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.server import CallContext, rpc

log = logging.getLogger(__name__)

DEFAULT_TABLE_ID = 1


class MetaService:
    def __init__(self, config: ServiceConfig, kv, mgmtd: MgmtdClient, storage: StorageClient):
        self.config = config
        self.mgmtd = mgmtd
        self.storage = storage
        self.store = MetaStore(kv, table_info=self._table_info)
        self.hb_version = 0

    def _table_info(self) -> tuple[int, int, int]:
        routing = self.mgmtd.routing
        if routing is None or DEFAULT_TABLE_ID not in routing.info.tables:
            raise status_error(StatusCode.CHAIN_TABLE_NOT_FOUND,
                               f"chain table {DEFAULT_TABLE_ID} does not exist yet: the cluster has no "
                               "storage chains (wait for `threefs up` to finish, see `threefs status`)")
        table = routing.info.tables[DEFAULT_TABLE_ID]
        return table.table_id, table.version, len(table.chains)

    async def start(self) -> None:
        await self.register()
        await self.store.init()

    async def register(self) -> None:
        req = ms.RegisterReq(self.config.node_id, ms.META, self.config.addr, socket.gethostname(),
                             self.config.failure_domain)
        await self.mgmtd.call("register", req, ms.RegisterRsp)
        await self.mgmtd.refresh(force=True)

    async def heartbeat_loop(self) -> None:
        """Runs for the service's lifetime."""
        while True:
            try:
                self.hb_version += 1
                rsp = await self.mgmtd.call("heartbeat", ms.HeartbeatReq(self.config.node_id,
                                                                         self.hb_version), ms.HeartbeatRsp)
                if self.mgmtd.routing is None or rsp.routing_version != self.mgmtd.routing.version:
                    await self.mgmtd.refresh()
            except ThreeFSError as e:
                if e.code == StatusCode.NODE_NOT_FOUND:
                    await self.register()
                else:
                    log.warning("heartbeat failed: %s", e)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    # -- RPC ------------------------------------------------------------------------------------
    @rpc(m.StatReq)
    async def stat(self, ctx: CallContext, req: m.StatReq) -> m.StatRsp:
        return m.StatRsp(await self.store.stat(req.path, req.follow))

    @rpc(m.MkdirReq)
    async def mkdir(self, ctx: CallContext, req: m.MkdirReq) -> m.AttrRsp:
        return m.AttrRsp(await self.store.mkdir(req.path, req.mode, req.parents, req.chunk_size, req.stripe))

    @rpc(m.OpenReq)
    async def open(self, ctx: CallContext, req: m.OpenReq) -> m.OpenRsp:
        rsp, job = await self.store.open(req.path, req.flags, req.mode, req.chunk_size, req.stripe,
                                         ctx.client_id)
        if job is not None:
            await self.remove_chunks(job.inode, job.layout, job.new_length)
        return rsp

    @rpc(m.CloseReq)
    async def close(self, ctx: CallContext, req: m.CloseReq) -> m.AttrRsp:
        return m.AttrRsp(await self.store.close(req.inode, req.session, req.length_hint, ctx.client_id))

    @rpc(m.TruncateReq)
    async def truncate(self, ctx: CallContext, req: m.TruncateReq) -> m.AttrRsp:
        if req.length < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"negative length {req.length}")
        attr, job = await self.store.truncate(req.path, req.length)
        if job is not None:
            await self.remove_chunks(job.inode, job.layout, job.new_length)
        return m.AttrRsp(attr)

    @rpc(m.ReaddirReq)
    async def readdir(self, ctx: CallContext, req: m.ReaddirReq) -> m.ReaddirRsp:
        entries, more = await self.store.readdir(req.path, req.start_after, req.limit)
        return m.ReaddirRsp(entries, more)

    @rpc(m.PathReq)
    async def unlink(self, ctx: CallContext, req: m.PathReq) -> m.OkRsp:
        await self.store.unlink(req.path)
        return m.OkRsp()

    @rpc(m.PathReq)
    async def rmdir(self, ctx: CallContext, req: m.PathReq) -> m.OkRsp:
        await self.store.rmdir(req.path)
        return m.OkRsp()

    @rpc(m.RenameReq)
    async def rename(self, ctx: CallContext, req: m.RenameReq) -> m.OkRsp:
        await self.store.rename(req.src, req.dst, req.noreplace)
        return m.OkRsp()

    # -- chunk removal ---------------------------------------------------------------------------
    async def remove_chunks(self, inode: int, layout: Layout, new_length: int) -> None:
        """Drop file data past new_length on every chain of the file's stripe."""
        routing = await self.mgmtd.get()
        table = routing.table(layout.table_id).chains
        cs = layout.chunk_size
        first_removed = -(-new_length // cs)  # chunks wholly past the new end
        chains = sorted({chain_of_chunk(layout, i, table) for i in range(layout.stripe)})
        _, end = inode_chunk_range(inode)
        begin = chunk_id(inode, first_removed)
        await asyncio.gather(*(self.storage.remove_range(c, begin, end, cs) for c in chains))
        if new_length % cs:
            index = new_length // cs
            await self.storage.truncate_chunk(chain_of_chunk(layout, index, table), chunk_id(inode, index),
                                              new_length % cs, cs)

    async def gc_loop(self) -> None:
        """Remove the chunks of unlinked files, then forget them. Runs for the service's lifetime."""
        while True:
            try:
                for entry in await self.store.gc_pending(32):
                    if entry.layout is not None:
                        await self.remove_chunks(entry.inode, entry.layout, 0)
                    await self.store.gc_done(entry.inode)
            except ThreeFSError as e:
                log.warning("GC pass failed (will retry): %s", e)
            except Exception:
                log.exception("GC pass failed (will retry)")
            await asyncio.sleep(self.config.gc_interval_s)
