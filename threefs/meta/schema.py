"""Meta service KV schema: key encoding and the records stored under each key (msgspec, msgpack).

Keys, as in 3FS (`src/common/kv/KeyPrefix-def.h`); a 4-byte prefix names the table:

    INOD + inode (8 B little-endian)                 -> Inode
    DENT + parent inode (8 B little-endian) + name   -> Dentry      (a listing is a range scan of the prefix)
    SESS + inode (8 B little-endian) + session id    -> WriteSession
    CLNT + client key                                -> ClientRecord (last seen; see service_sessions.py)
    IDEM + client key + request id (8 B big-endian)  -> IdemRecord  (the reply of a removal, for retries)
    GCQU + queued time (8 B BE) + inode (8 B BE)     -> GcEntry     (oldest first; directories at time 0)
    IALC                                             -> next free inode id (8 B big-endian)
    CALC + table id (4 B BE) + stripe (4 B BE)        -> next chain-allocation slot (8 B big-endian)
    XATR + inode (8 B little-endian) + name          -> the value of one extended attribute (raw bytes)

A client key is the client id's length (1 byte) and its bytes, so one client's keys form one range.

Inode ids are little-endian in INOD/DENT/SESS so that consecutive ids land far apart in the key space: with a
range-partitioned KV (FoundationDB, TiKV) that spreads the inodes created by one burst over many shards.

Concurrency rule for directory records. Adding or removing an entry rewrites the directory's INOD record to
move its mtime/ctime, from a *snapshot* read, so that concurrent creates in one directory do not conflict with
each other. That blind write would undo a concurrent change to any other field of the directory, so every
operation that changes a directory's other fields (rename: parent and name; later setattr, set-layout) must
also write that directory's dentry (`dentry_key(dir.parent, dir.name)`), which every entry-changing operation
reads with conflict tracking; the root has no dentry and nothing changes its other fields. Operations that
start from a directory *inode* (FUSE: create(parent inode, name)) read that directory's record from a
snapshot too and add its dentry to their read-conflict set, which makes them retry after a concurrent
rename, rmdir or chmod of the directory, and never after a create beside them.

A directory's dentry also carries its permission bits and owner (3FS's dirAcl): path walks check search
permission from the dentries they read anyway. chmod/chown of a directory rewrite both records.
"""

from __future__ import annotations

import hashlib
import struct

import msgspec

from threefs.common.layout import Layout
from threefs.meta.paths import encode_name
from threefs.meta.users import Acl
from threefs.rpc.schemas.meta import (BLOCKDEV, CHARDEV, DIRECTORY, FIFO, FILE, SOCKET, SPECIAL_TYPES,
                                      SYMLINK, InodeAttr)

# re-exported: the inode types stored here are the wire's
__all__ = ["BLOCKDEV", "CHARDEV", "DIRECTORY", "FIFO", "FILE", "SOCKET", "SPECIAL_TYPES", "SYMLINK"]

INODE_PREFIX = b"INOD"
DENTRY_PREFIX = b"DENT"
SESSION_PREFIX = b"SESS"
CLIENT_PREFIX = b"CLNT"
IDEM_PREFIX = b"IDEM"
GC_PREFIX = b"GCQU"
INODE_COUNTER_KEY = b"IALC"
CHAIN_COUNTER_PREFIX = b"CALC"
KVSTORE_PREFIX = b"KVST"  # threefs.kvstore records: + store dir inode (8 B BE) + key (ops_kvstore)
XATTR_PREFIX = b"XATR"

_LE64 = struct.Struct("<Q")
_BE64 = struct.Struct(">Q")
_CHAIN_COUNTER = struct.Struct(">II")


class Inode(msgspec.Struct, omit_defaults=True):
    """One file, directory or symlink. The id is the key, not a field."""

    type: int  # FILE / DIRECTORY / SYMLINK / a special type (FIFO, CHARDEV, BLOCKDEV, SOCKET)
    mode: int  # permission bits only (no S_IF* type bits)
    uid: int
    gid: int
    nlink: int  # files: number of dentries; directories: 1, 0 once handed to GC (their st_nlink: see subdirs)
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    length: int = 0  # files: lazily maintained (grows on hints and close), see docs/meta.md "File length"
    truncate_ver: int = 0  # files: bumped by every truncate; length hints from older versions are ignored
    layout: Layout | None = None  # files: their layout; directories: the default for new children
    parent: int = 0  # directories: the parent directory, for '..' and rename's subtree check
    name: bytes = b""  # directories: the name in the parent (raw bytes, may be non-UTF-8), to find the dentry
    symlink_target: str = ""
    rdev: int = 0  # character and block devices: the device number
    # directories: how many subdirectories it holds, kept by mkdir, rmdir, rename and remove, so that a
    # directory's st_nlink is 2 + subdirs as on ext4 ('.', its name, each child's '..'). -1 = not counted:
    # directories stored before the count existed and the root (it has no dentry, see the concurrency rule
    # above); their st_nlink stays 1 ("unknown", as btrfs answers). A change of the count is a change of
    # the directory's other fields: its dentry is rewritten with it (ops_resolve.count_subdir).
    subdirs: int = -1


class Dentry(msgspec.Struct, omit_defaults=True):
    """A name in a directory: the inode it names, and that inode's type (so walks need not load the inode).
    For a directory also its mode and owner, so walks can check search permission from the dentry."""

    inode: int
    type: int
    mode: int = 0  # directories only
    uid: int = 0
    gid: int = 0
    creator: bytes = b""  # the request that created the entry (request_token), so its retry is recognised

    @property
    def acl(self) -> Acl:
        return Acl(self.mode, self.uid, self.gid)


class WriteSession(msgspec.Struct):
    """A file open for writing. It holds back GC of the file after an unlink until it is closed."""

    client_id: str
    opened_ns: int
    truncate_ver: int = 0  # the file's truncate version the writer's length hints refer to


class ClientRecord(msgspec.Struct):
    """When a meta server last heard from a client; sessions of clients silent too long are pruned."""

    last_seen_ns: int


class IdemRecord(msgspec.Struct):
    """The reply a mutation gave, kept so that its retry (same client, same request id) gets it again."""

    created_ns: int
    reply: bytes  # msgpack of the operation's result


class GcEntry(msgspec.Struct, omit_defaults=True):
    """A file with no names left whose chunks the service must remove before `gc_done` drops the inode, or
    (type DIRECTORY) a directory tree handed over by a recursive remove, which GC empties entry by entry."""

    inode: int
    layout: Layout | None
    length: int
    queued_ns: int
    type: int = FILE


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


def xattr_key(inode: int, name: str) -> bytes:
    return XATTR_PREFIX + _LE64.pack(inode) + name.encode("utf-8", "surrogateescape")


def xattr_range(inode: int) -> tuple[bytes, bytes]:
    prefix = XATTR_PREFIX + _LE64.pack(inode)
    return prefix, strinc(prefix)


def xattr_name(key: bytes) -> str:
    return key[len(XATTR_PREFIX) + 8:].decode("utf-8", "surrogateescape")


def session_prefix(inode: int) -> bytes:
    return SESSION_PREFIX + _LE64.pack(inode)


def session_key(inode: int, session: str) -> bytes:
    return session_prefix(inode) + session.encode()


def session_range(inode: int) -> tuple[bytes, bytes]:
    prefix = session_prefix(inode)
    return prefix, strinc(prefix)


def session_range_all() -> tuple[bytes, bytes]:
    return SESSION_PREFIX, strinc(SESSION_PREFIX)


def parse_session_key(key: bytes) -> tuple[int, str]:
    """(inode, session id) of a SESS key."""
    start = len(SESSION_PREFIX)
    return _LE64.unpack_from(key, start)[0], key[start + 8:].decode()


def gc_key(entry: "GcEntry") -> bytes:
    """Ordered by queue time, so GC scans stop at the first entry too young to collect. Directory entries
    are collected at once, and sort first (time 0)."""
    queued = 0 if entry.type == DIRECTORY else entry.queued_ns
    return GC_PREFIX + _BE64.pack(queued) + _BE64.pack(entry.inode)


def gc_range() -> tuple[bytes, bytes]:
    return GC_PREFIX, strinc(GC_PREFIX)


def client_key(client_id: str) -> bytes:
    raw = client_id.encode()
    assert 0 < len(raw) < 256, client_id
    return bytes([len(raw)]) + raw


def client_record_key(client_id: str) -> bytes:
    return CLIENT_PREFIX + client_key(client_id)


def client_records_range() -> tuple[bytes, bytes]:
    return CLIENT_PREFIX, strinc(CLIENT_PREFIX)


def client_of_record_key(key: bytes) -> str:
    size = key[len(CLIENT_PREFIX)]
    return key[len(CLIENT_PREFIX) + 1:len(CLIENT_PREFIX) + 1 + size].decode()


def request_token(client_id: str, request_id: int) -> bytes:
    """A short fingerprint of one request of one client (3FS keeps a uuid in the dentry for the same end)."""
    return hashlib.blake2b(client_key(client_id) + _BE64.pack(request_id), digest_size=12).digest()


def idem_key(client_id: str, request_id: int) -> bytes:
    return IDEM_PREFIX + client_key(client_id) + _BE64.pack(request_id)


def idem_range() -> tuple[bytes, bytes]:
    return IDEM_PREFIX, strinc(IDEM_PREFIX)


def chain_counter_key(table_id: int, stripe: int) -> bytes:
    return CHAIN_COUNTER_PREFIX + _CHAIN_COUNTER.pack(table_id, stripe)


# -- values ------------------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_inode_decoder = msgspec.msgpack.Decoder(Inode)
_dentry_decoder = msgspec.msgpack.Decoder(Dentry)
_session_decoder = msgspec.msgpack.Decoder(WriteSession)
_gc_decoder = msgspec.msgpack.Decoder(GcEntry)
_client_decoder = msgspec.msgpack.Decoder(ClientRecord)
_idem_decoder = msgspec.msgpack.Decoder(IdemRecord)

encode = _encoder.encode


def decode_inode(raw: bytes) -> Inode:
    return _inode_decoder.decode(raw)


def decode_dentry(raw: bytes) -> Dentry:
    return _dentry_decoder.decode(raw)


def decode_session(raw: bytes) -> WriteSession:
    return _session_decoder.decode(raw)


def decode_gc(raw: bytes) -> GcEntry:
    return _gc_decoder.decode(raw)


def decode_client(raw: bytes) -> ClientRecord:
    return _client_decoder.decode(raw)


def decode_idem(raw: bytes) -> IdemRecord:
    return _idem_decoder.decode(raw)


def encode_counter(value: int) -> bytes:
    return _BE64.pack(value)


def decode_counter(raw: bytes) -> int:
    return _BE64.unpack(raw)[0]


def dir_nlink(directory: Inode) -> int:
    """A directory's st_nlink: 2 + its subdirectories where they are counted, 1 where not (a directory from
    before the count), 0 once handed to GC."""
    if directory.nlink == 0 or directory.subdirs < 0:
        return directory.nlink
    return 2 + directory.subdirs


def to_attr(inode_id: int, inode: Inode) -> InodeAttr:
    """The wire view of a stored inode."""
    return InodeAttr(
        inode=inode_id,
        type=inode.type,
        mode=inode.mode,
        uid=inode.uid,
        gid=inode.gid,
        nlink=dir_nlink(inode) if inode.type == DIRECTORY else inode.nlink,
        length=inode.length,
        atime_ns=inode.atime_ns,
        mtime_ns=inode.mtime_ns,
        ctime_ns=inode.ctime_ns,
        layout=inode.layout,
        symlink_target=inode.symlink_target,
        truncate_ver=inode.truncate_ver,
        rdev=inode.rdev,
    )


def acl_of(inode: Inode) -> Acl:
    return Acl(inode.mode, inode.uid, inode.gid)


def dir_dentry(inode_id: int, inode: Inode) -> Dentry:
    """The dentry naming directory `inode` (its acl copied in)."""
    assert inode.type == DIRECTORY, inode_id
    return Dentry(inode_id, DIRECTORY, inode.mode, inode.uid, inode.gid)
