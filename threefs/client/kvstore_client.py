"""The client side of meta's key-value RPCs (threefs.kvstore builds its API on these)."""

from __future__ import annotations

from threefs.rpc.schemas import kvstore as k

# Re-exported for threefs.kvstore, which must not import rpc.schemas itself (layering).
KvOp, KvRecord = k.KvOp, k.KvRecord
PUT, DELETE, CHECK, CLEAR, ANY_VERSION = k.PUT, k.DELETE, k.CHECK, k.CLEAR, k.ANY_VERSION
KEY_BYTES_MAX, INLINE_BYTES_MAX, OPS_MAX = k.KEY_BYTES_MAX, k.INLINE_BYTES_MAX, k.OPS_MAX
BATCH_INLINE_BYTES_MAX, SCAN_LIMIT_MAX = k.BATCH_INLINE_BYTES_MAX, k.SCAN_LIMIT_MAX
KEY_BYTES_PER_CALL_MAX = 256 << 10  # keys in one request (with the values, under the 1 MiB frame header)


async def kv_get(aio, path: str, keys: list[bytes]) -> list[k.KvRecord | None]:
    """Records of `keys`; several calls when their inline values do not fit one reply."""
    out: list[k.KvRecord | None] = []
    while len(out) < len(keys):
        ask, nbytes = [], 0
        for key in keys[len(out):]:  # the request must fit one frame header too
            nbytes += len(key) + 8
            if ask and nbytes > KEY_BYTES_PER_CALL_MAX:
                break
            ask.append(key)
        got = (await aio.meta_call("kv_get", k.KvGetReq(path, ask), k.KvGetRsp)).records
        if not got:
            raise RuntimeError("meta returned no record for a get")  # the server always returns >= 1
        out.extend(got)
    return out


async def kv_write(aio, path: str, ops: list[k.KvOp]) -> k.KvWriteRsp:
    return await aio.meta_call("kv_write", k.KvWriteReq(path, ops), k.KvWriteRsp)


async def kv_scan(aio, path: str, prefix: bytes, start_after: bytes | None, limit: int) -> k.KvScanRsp:
    return await aio.meta_call("kv_scan", k.KvScanReq(path, prefix, start_after, limit), k.KvScanRsp)
