"""The meta service's key-value RPCs for threefs.kvstore (`meta.kv_get`, `meta.kv_write`, `meta.kv_scan`).

A mixin of MetaService, so the same server, authentication and acting-user rules serve them: each handler
works out the caller like every other handler (`_caller`), runs one KV transaction (ops_kvstore), and
writes go through the store's idempotency records, so a write retried after a lost reply (same request
id) returns its first reply instead of applying twice — a compare-and-set that succeeded is never
reported as failed because its retry saw its own write.
"""

from __future__ import annotations

import time

from threefs.meta import ops_kvstore
from threefs.rpc.schemas import kvstore as k
from threefs.rpc.server import CallContext, rpc


class KvstoreRpcs:
    @rpc(k.KvGetReq)
    async def kv_get(self, ctx: CallContext, req: k.KvGetReq) -> k.KvGetRsp:
        caller = self._caller(ctx, req)
        records = await self.store._run(lambda tr: ops_kvstore.get(tr, req, caller.user))
        return k.KvGetRsp(records)

    @rpc(k.KvWriteReq)
    async def kv_write(self, ctx: CallContext, req: k.KvWriteReq) -> k.KvWriteRsp:
        caller = self._caller(ctx, req)
        now_ns = time.time_ns()
        return await self.store._mutate(caller, k.KvWriteRsp,
                                        lambda tr: ops_kvstore.write(tr, req, caller.user, now_ns))

    @rpc(k.KvScanReq)
    async def kv_scan(self, ctx: CallContext, req: k.KvScanReq) -> k.KvScanRsp:
        caller = self._caller(ctx, req)
        return await self.store._run(lambda tr: ops_kvstore.scan(tr, req, caller.user))
