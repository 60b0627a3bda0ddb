"""Wire schema of the meta service (namespace operations).

Where an operation names a file it takes 3FS's "path at": `parent` (an inode id, default the root) and
`path`. With the default parent (NO_PARENT) the path must be absolute; with a parent inode a relative
path is resolved from that directory and the empty path names the inode `parent` itself. So path-based
callers send absolute paths, and the FUSE daemon sends (parent inode, name) or (inode, "").

Every request that acts for a user carries an optional `user`: the identity to check permissions with.
Only a privileged principal (the cluster token, the FUSE daemon) may set it; for anyone else it must be
absent or equal to the principal's own identity. Mutations carry a `request_id` (unique per client
connection): a retry with the same id after a lost reply returns the first reply instead of failing
(`EEXIST`) or acting twice. The client library fills both in.

The replies of the calls that add or remove names (open with O_CREAT, mkdir, symlink, mknod, link, unlink,
rmdir, remove, rename) carry `parents`: the attributes of each directory whose entries the call changed, as
its transaction committed them (new mtime/ctime, and nlink after a subdirectory came or went). Empty when
it changed none (a create that found the file, a retried request answered from its first reply) and from
servers older than the field; clients older than it ignore it. The FUSE daemon answers the kernel's next
getattr of that directory with them (docs/fuse.md).
"""

from __future__ import annotations

import msgspec

from threefs.common.layout import Layout

FILE = 1
DIRECTORY = 2
SYMLINK = 3
# Special files: inodes of their type with mode and rdev; their IO is the kernel's (pipes, devices,
# sockets), never storage's.
FIFO = 4
CHARDEV = 5
BLOCKDEV = 6
SOCKET = 7
SPECIAL_TYPES = (FIFO, CHARDEV, BLOCKDEV, SOCKET)

NO_PARENT = -1  # `parent` default: the path must be absolute
UTIME_NOW = -1  # SetattrReq.atime_ns / mtime_ns: "the server's current time" (utimensat's UTIME_NOW)


class UserCred(msgspec.Struct, frozen=True):
    """Who an operation acts for: uid, primary gid and supplementary gids (POSIX credentials)."""

    uid: int
    gid: int
    gids: tuple[int, ...] = ()
    # The kernel has already checked this call's permissions with the caller's full credentials (a FUSE
    # mount with default_permissions): meta checks nothing again, it only gives new inodes their owner.
    # Only a privileged principal may send it (users.acting_user).
    kernel_checked: bool = False


class InodeAttr(msgspec.Struct):
    inode: int
    type: int  # FILE / DIRECTORY / SYMLINK
    mode: int  # permission bits, incl. setuid/setgid/sticky (no S_IF* type bits)
    uid: int
    gid: int
    nlink: int
    length: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    layout: Layout | None = None  # file layout, or a directory's default layout
    symlink_target: str = ""
    truncate_ver: int = 0  # files: bumped by every truncate; send it back with length hints (SyncReq)
    rdev: int = 0  # character and block devices: the device number


class DirEntry(msgspec.Struct, array_like=True):  # a readdir page carries up to 1024 of these
    name: str
    inode: int
    type: int


class PathAt(msgspec.Struct, array_like=True):
    parent: int
    path: str


class StatReq(msgspec.Struct, omit_defaults=True):
    path: str
    follow: bool = True  # False: lstat (a final symlink itself)
    parent: int = NO_PARENT
    user: UserCred | None = None
    # a last name that does not exist answers LookupRsp(attr=None) instead of NOT_FOUND (the FUSE daemon's
    # lookup of a name it is about to create: no error path on either side); older servers ignore it
    missing_ok: bool = False


class StatRsp(msgspec.Struct):
    attr: InodeAttr


class LookupRsp(msgspec.Struct):
    """stat's reply to a request with missing_ok (a StatRsp decodes as one)."""

    attr: InodeAttr | None = None


class BatchStatReq(msgspec.Struct):
    items: list[PathAt]  # at most limits.BATCH_STAT_MAX
    follow: bool = True
    user: UserCred | None = None


class BatchStatRsp(msgspec.Struct):
    attrs: list[InodeAttr | None]  # None where the item failed
    errors: list[int]  # StatusCode per item (0 = ok)
    messages: list[str]


class MkdirReq(msgspec.Struct):
    path: str
    mode: int = 0o755
    parents: bool = False
    chunk_size: int = 0  # 0 = inherit the parent's default layout
    stripe: int = 0
    parent: int = NO_PARENT
    user: UserCred | None = None
    request_id: int = 0


class OpenReq(msgspec.Struct):
    path: str
    flags: int  # os.O_* bits: O_WRONLY/O_RDWR, O_CREAT, O_EXCL, O_TRUNC, O_APPEND, O_NOFOLLOW, O_DIRECTORY
    mode: int = 0o644
    chunk_size: int = 0  # for O_CREAT: 0 = the directory's default
    stripe: int = 0
    parent: int = NO_PARENT
    user: UserCred | None = None
    request_id: int = 0


class OpenRsp(msgspec.Struct, omit_defaults=True):
    attr: InodeAttr
    session: str = ""  # write session id ("" for read-only opens)
    truncated: bool = False  # O_TRUNC removed existing data
    parents: list[InodeAttr] = []  # O_CREAT that created the file: its directory, as committed (above)


class CloseReq(msgspec.Struct):
    inode: int
    session: str = ""
    length_hint: int = -1  # end of the highest byte written, -1 = nothing written (no length query)
    # False: the hint is the file's end as its only writer knows it (every write acknowledged: the S3
    # gateway's objects and records), so meta stores it without measuring the file on storage (servers
    # that predate the field measure, which gives the same length)
    exact: bool = True


CLOSE_MANY_MAX = 1024  # sessions ended by one CloseManyReq


class SessionRef(msgspec.Struct, array_like=True):
    inode: int
    session: str


class CloseManyReq(msgspec.Struct):
    """[meta] End write sessions to which nothing was written (the close of a file opened for writing and
    left untouched): one transaction for all of them, nothing but the sessions changes. Sessions of other
    clients, and ones already gone, are left alone. At most CLOSE_MANY_MAX."""

    items: list[SessionRef]


class SyncReq(msgspec.Struct):
    """While writing: `exact=False` raises the length to `length_hint` (cheap, lazy); `exact=True` (fsync)
    sets it from storage's last chunks. A hint sent with an old `truncate_ver` is ignored, so a hint from
    before a truncate cannot bring truncated data back."""

    inode: int
    session: str = ""
    length_hint: int = -1
    truncate_ver: int = -1  # the InodeAttr.truncate_ver the writer knows; -1 = the session's
    exact: bool = False


class AttrRsp(msgspec.Struct, omit_defaults=True):
    attr: InodeAttr
    parents: list[InodeAttr] = []  # mkdir, symlink, mknod, link: the directories changed (module docstring)
    published: bool = False  # setattr: SetattrReq.publish was applied (servers that predate it answer False)


class ChangedRsp(msgspec.Struct, omit_defaults=True):
    """unlink / rmdir / remove / rename (older servers answer OkRsp: no fields, decodes as this)."""

    parents: list[InodeAttr] = []  # the directories whose entries changed, as committed (module docstring)


class ReaddirReq(msgspec.Struct):
    path: str
    start_after: str = ""
    limit: int = 1024
    parent: int = NO_PARENT
    user: UserCred | None = None


class ReaddirRsp(msgspec.Struct):
    entries: list[DirEntry]
    more: bool


class PathReq(msgspec.Struct):
    """unlink / rmdir."""

    path: str
    parent: int = NO_PARENT
    user: UserCred | None = None
    request_id: int = 0


class RemoveReq(msgspec.Struct):
    """Remove any entry; `recursive` hands a non-empty directory tree to GC in one transaction."""

    path: str
    recursive: bool = False
    parent: int = NO_PARENT
    user: UserCred | None = None
    request_id: int = 0


class RenameReq(msgspec.Struct):
    src: str
    dst: str
    noreplace: bool = False  # RENAME_NOREPLACE
    src_parent: int = NO_PARENT
    dst_parent: int = NO_PARENT
    user: UserCred | None = None
    request_id: int = 0


class LinkReq(msgspec.Struct):
    """Hard link: a new name `dst` for the file `src` (never followed if a symlink, as linkat without
    AT_SYMLINK_FOLLOW). FUSE's link(inode, newparent, newname) is src="" src_parent=inode."""

    src: str
    dst: str
    src_parent: int = NO_PARENT
    dst_parent: int = NO_PARENT
    user: UserCred | None = None
    request_id: int = 0


class SymlinkReq(msgspec.Struct):
    path: str  # the new link
    target: str  # what it points to (stored as given, not resolved)
    parent: int = NO_PARENT
    user: UserCred | None = None
    request_id: int = 0


class MknodReq(msgspec.Struct):
    """mknod(2) of a special file (FIFO / CHARDEV / BLOCKDEV / SOCKET); regular files are open's."""

    path: str
    type: int
    mode: int = 0o644
    rdev: int = 0
    parent: int = NO_PARENT
    user: UserCred | None = None
    request_id: int = 0


XATTR_GET, XATTR_SET, XATTR_LIST, XATTR_REMOVE = "get", "set", "list", "remove"
XATTR_CREATE, XATTR_REPLACE = 1, 2  # setxattr flags (os.XATTR_CREATE / os.XATTR_REPLACE)


class XattrReq(msgspec.Struct):
    """Extended attributes of an inode: op get / set / list / remove (see meta/ops_xattr.py)."""

    op: str
    path: str
    name: str = ""
    value: bytes = b""
    flags: int = 0  # set: XATTR_CREATE / XATTR_REPLACE
    follow: bool = True
    parent: int = NO_PARENT
    user: UserCred | None = None
    request_id: int = 0


class XattrRsp(msgspec.Struct):
    value: bytes = b""  # get
    names: list[str] = []  # list


class ReadlinkRsp(msgspec.Struct):
    target: str


class SetattrReq(msgspec.Struct):
    """chmod / chown / utimens / truncate in one call; None leaves a field alone. atime_ns / mtime_ns
    UTIME_NOW mean "now". `length` truncates (a file only)."""

    path: str
    parent: int = NO_PARENT
    follow: bool = True
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    length: int | None = None
    user: UserCred | None = None
    request_id: int = 0
    # a directory's default layout for files created in it from now on (0 / None: unchanged)
    chunk_size: int | None = None
    stripe: int | None = None
    table_id: int | None = None
    # a writer's length hint (exact=False), published in the same transaction before the changes: times set
    # on a file with unpublished writes (FUSE: tar and cp -p set them before closing) are not then moved
    # by the publication; AttrRsp.published says it was done
    publish: SyncReq | None = None


class TruncateReq(msgspec.Struct):
    path: str
    length: int
    parent: int = NO_PARENT
    user: UserCred | None = None


class StatfsReq(msgspec.Struct):
    pass


class StatfsRsp(msgspec.Struct):
    """Space as a user sees it: bytes of file data (one replica's worth), so `df` matches `du`."""

    capacity_bytes: int  # used + free
    used_bytes: int  # file data stored, divided by the replica count
    free_bytes: int  # free space of the targets' file systems (each counted once), / replica count
    replicas: int
    targets: int
    targets_reporting: int  # targets whose last heartbeat carried free-space figures


class KeepaliveReq(msgspec.Struct):
    pass


class OkRsp(msgspec.Struct):
    pass
