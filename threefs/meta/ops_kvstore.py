"""Key-value operations of threefs.kvstore as functions over one KV transaction (like the other ops_*).

Keys: KVSTORE_PREFIX + the store directory's inode id (8 bytes, big-endian) + the user's key, so a store's
keys are one ordered range (prefix scans are range reads) and stores never see each other's keys. The
store directory is resolved in the same transaction, with the caller's permissions: r on it to read, w to
write. Writes resolve it with conflict-tracked reads, so a write racing a rename or rmdir of the directory
retries instead of landing in a store that went away.

Versions: a write gives the key version read_version + 1 of its transaction. Two writes of one key
conflict unless one saw the other, so the later one has a higher read version: versions of a key only
grow, also across delete and re-create (no ABA for compare-and-set by version).
"""

from __future__ import annotations

import struct

import msgspec

from threefs.common.status import StatusCode, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.ops_attr import resolve_existing
from threefs.meta.ops_resolve import Walker
from threefs.meta.paths import display, parse_path
from threefs.meta.schema import DIRECTORY
from threefs.meta.users import R, W, require
from threefs.rpc.schemas import kvstore as k
from threefs.rpc.schemas.meta import UserCred

_BE64 = struct.Struct(">Q")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(k.KvRecord).decode
DIGEST_BYTES = 16
BLOB_NAME_MAX = 255


def _prefix(store: int) -> bytes:
    return schema.KVSTORE_PREFIX + _BE64.pack(store)


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or not 0 < len(key) <= k.KEY_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"a key is 1 to {k.KEY_BYTES_MAX} bytes "
                           f"(got {len(key) if isinstance(key, bytes) else type(key).__name__})")


async def store_dir(tr: Transaction, path: str, user: UserCred, want: int, snapshot: bool) -> int:
    """The inode id of the store directory `path`, if `user` may `want` (R or W) on it."""
    parsed = parse_path(path)
    walker = Walker(tr, display(parsed), snapshot=snapshot, user=user)
    entry, inode = await resolve_existing(walker, parsed, True)
    if inode.type != DIRECTORY:
        raise status_error(StatusCode.NOT_DIRECTORY, f"{display(parsed)} is not a directory (a key-value "
                           "store is a directory: create it with KVStore.create or mkdir)")
    require(user, schema.acl_of(inode), want, display(parsed))
    return entry.dentry.inode


async def get(tr: Transaction, req: k.KvGetReq, user: UserCred) -> list[k.KvRecord | None]:
    if not 0 < len(req.keys) <= k.OPS_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"get takes 1 to {k.OPS_MAX} keys, not {len(req.keys)}")
    for key in req.keys:
        check_key(key)
    prefix = _prefix(await store_dir(tr, req.path, user, R, snapshot=True))
    out = []
    inline = 0
    for key in req.keys:
        raw = await tr.get(prefix + key, snapshot=True)
        rec = None if raw is None else _decode(raw)
        inline += len(rec.value) if rec is not None else 0
        if out and inline > k.REPLY_INLINE_BYTES_MAX:
            break  # the reply must fit one frame header: the client asks for the rest
        out.append(rec)
    return out


def _check_op(op: k.KvOp) -> int:
    if op.kind == k.CLEAR:
        return 0
    check_key(op.key)
    if op.kind not in (k.PUT, k.DELETE, k.CHECK):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"unknown operation kind {op.kind}")
    if op.kind == k.PUT:
        if op.blob:
            if op.value or len(op.blob) > BLOB_NAME_MAX or "/" in op.blob:
                raise status_error(StatusCode.INVALID_ARGUMENT, "a blob record names one file and holds no bytes")
        elif len(op.value) > k.INLINE_BYTES_MAX or op.length != len(op.value):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"an inline value is at most {k.INLINE_BYTES_MAX} "
                               "bytes and its length must match")
        if len(op.digest) != DIGEST_BYTES or op.length < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, "a put needs the value's 16-byte digest")
    if op.expect_version < k.ANY_VERSION:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"expect_version {op.expect_version} is invalid")
    return len(op.value)


async def write(tr: Transaction, req: k.KvWriteReq, user: UserCred, now_ns: int) -> k.KvWriteRsp:
    """Apply every op, or none if a condition fails (one atomic batch)."""
    if not 0 < len(req.ops) <= k.OPS_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"a write batch has 1 to {k.OPS_MAX} operations")
    if sum(_check_op(op) for op in req.ops) > k.BATCH_INLINE_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"a write batch carries at most "
                           f"{k.BATCH_INLINE_BYTES_MAX} inline bytes; split it")
    if len({op.key for op in req.ops if op.kind != k.CHECK}) != sum(op.kind != k.CHECK for op in req.ops):
        raise status_error(StatusCode.INVALID_ARGUMENT, "a write batch changes each key at most once")
    prefix = _prefix(await store_dir(tr, req.path, user, W, snapshot=False))
    if any(op.kind == k.CLEAR for op in req.ops):
        if len(req.ops) != 1:
            raise status_error(StatusCode.INVALID_ARGUMENT, "a clear is alone in its batch")
        tr.clear_range(prefix, schema.strinc(prefix))
        return k.KvWriteRsp(True, -1, [0], [False], [""])
    current: dict[bytes, k.KvRecord | None] = {}
    for op in req.ops:
        if op.key not in current:
            raw = await tr.get(prefix + op.key)  # conflict-tracked: the conditions hold at commit
            current[op.key] = None if raw is None else _decode(raw)
    previous = [current[op.key] for op in req.ops]
    versions = [rec.version if rec is not None else 0 for rec in previous]
    existed = [rec is not None for rec in previous]
    blobs = [rec.blob if rec is not None else "" for rec in previous]
    for i, (op, rec) in enumerate(zip(req.ops, previous)):
        if not _holds(op, rec):
            return k.KvWriteRsp(False, i, versions, existed, [""] * len(blobs))
    version = tr.read_version + 1
    for i, op in enumerate(req.ops):
        if op.kind == k.PUT:
            tr.set(prefix + op.key, _encode(k.KvRecord(version, op.value, op.blob, op.length, op.digest, now_ns)))
            versions[i] = version
        elif op.kind == k.DELETE:
            tr.clear(prefix + op.key)
            versions[i] = 0
    return k.KvWriteRsp(True, -1, versions, existed,
                        [b if op.kind != k.CHECK else "" for op, b in zip(req.ops, blobs)])


def _holds(op: k.KvOp, rec: k.KvRecord | None) -> bool:
    if op.expect_version != k.ANY_VERSION and op.expect_version != (rec.version if rec else 0):
        return False
    if op.expect_digest is not None and op.expect_digest != (rec.digest if rec else b""):
        return False
    return True


async def scan(tr: Transaction, req: k.KvScanReq, user: UserCred) -> k.KvScanRsp:
    if not 1 <= req.limit <= k.SCAN_LIMIT_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"scan limit must be 1..{k.SCAN_LIMIT_MAX}")
    if len(req.prefix) > k.KEY_BYTES_MAX or len(req.start_after or b"") > k.KEY_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"a prefix or start_after is at most "
                           f"{k.KEY_BYTES_MAX} bytes")
    base = _prefix(await store_dir(tr, req.path, user, R, snapshot=True))
    begin = base + req.prefix
    end = schema.strinc(begin) if req.prefix else schema.strinc(base)
    if req.start_after is not None:
        begin = max(begin, base + req.start_after + b"\x00")
    rows = await tr.get_range(begin, end, limit=req.limit + 1, snapshot=True) if begin < end else []
    more = len(rows) > req.limit
    keys, records, inline = [], [], 0
    for key, raw in rows[:req.limit]:
        rec = _decode(raw)
        inline += len(rec.value)
        if records and inline > k.REPLY_INLINE_BYTES_MAX:  # the reply must fit one frame header
            more = True
            break
        keys.append(key[len(base):])
        records.append(rec)
    return k.KvScanRsp(keys, records, more)
