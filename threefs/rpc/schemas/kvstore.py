"""Wire schema of the key-value operations the meta service serves for threefs.kvstore (additive RPCs:
`meta.kv_get`, `meta.kv_write`, `meta.kv_scan`).

A store is a directory of the namespace (`path`); its keys live in meta's KV under the directory's inode,
and the directory's permissions apply (read: r on the directory, write: w). Values up to INLINE_BYTES_MAX
are kept in the record itself; larger ones in a file of the store's `.blobs/` directory that the record
names (the client writes the file before the record, and removes the old file after replacing it).
Every record carries a digest of its value (blake2b-128, computed by the client), so compare-and-set
compares values of any size in the transaction.
"""

from __future__ import annotations

import msgspec

from threefs.rpc.schemas.meta import UserCred

KEY_BYTES_MAX = 4096
INLINE_BYTES_MAX = 64 << 10
OPS_MAX = 1000  # operations in one atomic write batch (and keys in one get)
# Inline bytes in one request or reply: values travel in the msgpack header of a frame, whose limit is
# limits.FRAME_HEADER_BYTES_MAX (1 MiB). The client spills a batch's further values to blobs past it; gets
# and scans return fewer records (the client asks again for the rest).
BATCH_INLINE_BYTES_MAX = 768 << 10
REPLY_INLINE_BYTES_MAX = 768 << 10
SCAN_LIMIT_MAX = 1000

PUT, DELETE, CHECK, CLEAR = 1, 2, 3, 4  # CLEAR: every key of the store (alone in its batch)
ANY_VERSION = -1  # KvOp.expect_version: no condition; 0: the key must not exist; n: its version is n


class KvRecord(msgspec.Struct, array_like=True):
    version: int  # increases with every write of the key (it is the writing transaction's read version + 1)
    value: bytes  # inline value; b"" when `blob` names the file holding it
    blob: str  # "" or the file name in the store's .blobs directory
    length: int  # bytes of the value
    digest: bytes  # blake2b(value, digest_size=16)
    mtime_ns: int


class KvOp(msgspec.Struct, array_like=True):
    kind: int  # PUT / DELETE / CHECK (a condition only)
    key: bytes
    value: bytes = b""
    blob: str = ""
    length: int = 0
    digest: bytes = b""
    expect_version: int = ANY_VERSION
    expect_digest: bytes | None = None  # condition: the current value's digest (b"" = must not exist)


class KvGetReq(msgspec.Struct):
    path: str
    keys: list[bytes]
    user: UserCred | None = None


class KvGetRsp(msgspec.Struct):
    records: list[KvRecord | None]  # for the first len(records) keys (>= 1): ask again for the rest


class KvWriteReq(msgspec.Struct):
    path: str
    ops: list[KvOp]
    user: UserCred | None = None
    request_id: int = 0


class KvWriteRsp(msgspec.Struct):
    ok: bool  # False: a condition failed (`failed` is its index) and nothing was written
    failed: int
    versions: list[int]  # per op: the new version (PUT), 0 (DELETE), the current one (CHECK / failed)
    existed: list[bool]  # per op: whether the key existed before
    replaced_blobs: list[str]  # per op: the blob file the record named before ("" if none), so the client
    # can remove it. No values: the reply is kept as an idempotency record, and must stay small.


class KvScanReq(msgspec.Struct):
    path: str
    prefix: bytes = b""
    start_after: bytes | None = None
    limit: int = SCAN_LIMIT_MAX
    user: UserCred | None = None


class KvScanRsp(msgspec.Struct):
    keys: list[bytes]
    records: list[KvRecord]
    more: bool
