"""Meta service KV schema: key encoding and the records stored under each key (msgspec, msgpack).

Keys, as in 3FS (`src/common/kv/KeyPrefix-def.h`); a 4-byte prefix names the table:

    INOD + inode (8 B little-endian)                 -> Inode
    DENT + parent inode (8 B little-endian) + name   -> Dentry      (a listing is a range scan of the prefix)
    SESS + inode (8 B little-endian) + session id    -> WriteSession
    GCQU + inode (8 B big-endian)                    -> GcEntry     (big-endian: scans go oldest inode first)
    IALC                                             -> next free inode id (8 B big-endian)
    CALC + table id (4 B BE) + stripe (4 B BE)        -> next chain-allocation slot (8 B big-endian)

Inode ids are little-endian in INOD/DENT/SESS so that consecutive ids land far apart in the key space: with a
range-partitioned KV (FoundationDB, TiKV) that spreads the inodes created by one burst over many shards.

Concurrency rule for directory records. Adding or removing an entry rewrites the directory's INOD record to
move its mtime/ctime, from a *snapshot* read, so that concurrent creates in one directory do not conflict with
each other. That blind write would undo a concurrent change to any other field of the directory, so every
operation that changes a directory's other fields (rename: parent and name; later setattr, set-layout) must
also write that directory's dentry (`dentry_key(dir.parent, dir.name)`), which every entry-changing operation
reads with conflict tracking; the root has no dentry and nothing changes its other fields.
"""

from __future__ import annotations

import struct

import msgspec

from threefs.common.layout import Layout
from threefs.meta.paths import encode_name
from threefs.rpc.schemas.meta import DIRECTORY, FILE, SYMLINK, InodeAttr

__all__ = ["DIRECTORY", "FILE", "SYMLINK"]  # re-exported: the inode types stored here are the wire's

INODE_PREFIX = b"INOD"
DENTRY_PREFIX = b"DENT"
SESSION_PREFIX = b"SESS"
GC_PREFIX = b"GCQU"
INODE_COUNTER_KEY = b"IALC"
CHAIN_COUNTER_PREFIX = b"CALC"

_LE64 = struct.Struct("<Q")
_BE64 = struct.Struct(">Q")
_CHAIN_COUNTER = struct.Struct(">II")


class Inode(msgspec.Struct, omit_defaults=True):
    """One file, directory or symlink. The id is the key, not a field."""

    type: int  # FILE / DIRECTORY / SYMLINK
    mode: int  # permission bits only (no S_IF* type bits)
    uid: int
    gid: int
    nlink: int  # files: number of dentries; directories: always 1 ("unknown", as btrfs; find must not prune)
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    length: int = 0  # files: lazily maintained (grows on close), see research §4 "File length"
    layout: Layout | None = None  # files: their layout; directories: the default for new children
    parent: int = 0  # directories: the parent directory, for '..' and rename's subtree check
    name: bytes = b""  # directories: the name in the parent (raw bytes, may be non-UTF-8), to find the dentry
    symlink_target: str = ""


class Dentry(msgspec.Struct, omit_defaults=True):
    """A name in a directory: the inode it names, and that inode's type (so walks need not load the inode)."""

    inode: int
    type: int


class WriteSession(msgspec.Struct):
    """A file open for writing. It holds back GC of the file after an unlink until it is closed."""

    client_id: str
    opened_ns: int


class GcEntry(msgspec.Struct):
    """A file with no names left whose chunks the service must remove before `gc_done` drops the inode."""

    inode: int
    layout: Layout | None
    length: int
    queued_ns: int


class TruncateJob(msgspec.Struct):
    """Chunks past `new_length` that the service must remove (or cut) on storage after a truncate."""

    inode: int
    layout: Layout
    old_length: int
    new_length: int


# -- keys --------------------------------------------------------------------------------------------------


def strinc(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (FoundationDB's strinc)."""
    stripped = prefix.rstrip(b"\xff")
    assert stripped, "a prefix of only 0xff bytes has no successor"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def inode_key(inode: int) -> bytes:
    return INODE_PREFIX + _LE64.pack(inode)


def dentry_prefix(parent: int) -> bytes:
    return DENTRY_PREFIX + _LE64.pack(parent)


def dentry_key(parent: int, name: str | bytes) -> bytes:
    raw = name if isinstance(name, bytes) else encode_name(name)
    return DENTRY_PREFIX + _LE64.pack(parent) + raw


def dentry_range(parent: int) -> tuple[bytes, bytes]:
    prefix = dentry_prefix(parent)
    return prefix, strinc(prefix)


def session_prefix(inode: int) -> bytes:
    return SESSION_PREFIX + _LE64.pack(inode)


def session_key(inode: int, session: str) -> bytes:
    return session_prefix(inode) + session.encode()


def session_range(inode: int) -> tuple[bytes, bytes]:
    prefix = session_prefix(inode)
    return prefix, strinc(prefix)


def gc_key(inode: int) -> bytes:
    return GC_PREFIX + _BE64.pack(inode)


def gc_range() -> tuple[bytes, bytes]:
    return GC_PREFIX, strinc(GC_PREFIX)


def chain_counter_key(table_id: int, stripe: int) -> bytes:
    return CHAIN_COUNTER_PREFIX + _CHAIN_COUNTER.pack(table_id, stripe)


def inode_of_gc_key(key: bytes) -> int:
    assert key.startswith(GC_PREFIX) and len(key) == len(GC_PREFIX) + 8, key
    return _BE64.unpack_from(key, len(GC_PREFIX))[0]


# -- values ------------------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_inode_decoder = msgspec.msgpack.Decoder(Inode)
_dentry_decoder = msgspec.msgpack.Decoder(Dentry)
_session_decoder = msgspec.msgpack.Decoder(WriteSession)
_gc_decoder = msgspec.msgpack.Decoder(GcEntry)

encode = _encoder.encode


def decode_inode(raw: bytes) -> Inode:
    return _inode_decoder.decode(raw)


def decode_dentry(raw: bytes) -> Dentry:
    return _dentry_decoder.decode(raw)


def decode_session(raw: bytes) -> WriteSession:
    return _session_decoder.decode(raw)


def decode_gc(raw: bytes) -> GcEntry:
    return _gc_decoder.decode(raw)


def encode_counter(value: int) -> bytes:
    return _BE64.pack(value)


def decode_counter(raw: bytes) -> int:
    return _BE64.unpack(raw)[0]


def to_attr(inode_id: int, inode: Inode) -> InodeAttr:
    """The wire view of a stored inode."""
    return InodeAttr(
        inode=inode_id,
        type=inode.type,
        mode=inode.mode,
        uid=inode.uid,
        gid=inode.gid,
        nlink=inode.nlink,
        length=inode.length,
        atime_ns=inode.atime_ns,
        mtime_ns=inode.mtime_ns,
        ctime_ns=inode.ctime_ns,
        layout=inode.layout,
        symlink_target=inode.symlink_target,
    )
