"""Wire schema of the meta service (namespace operations). Paths are absolute, '/'-separated."""

from __future__ import annotations

import msgspec

from threefs.common.layout import Layout

FILE = 1
DIRECTORY = 2
SYMLINK = 3


class InodeAttr(msgspec.Struct):
    inode: int
    type: int  # FILE / DIRECTORY / SYMLINK
    mode: int  # permission bits (no type bits)
    uid: int
    gid: int
    nlink: int
    length: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    layout: Layout | None = None  # file layout, or a directory's default layout
    symlink_target: str = ""


class DirEntry(msgspec.Struct):
    name: str
    inode: int
    type: int


class StatReq(msgspec.Struct):
    path: str
    follow: bool = True


class StatRsp(msgspec.Struct):
    attr: InodeAttr


class MkdirReq(msgspec.Struct):
    path: str
    mode: int = 0o755
    parents: bool = False
    chunk_size: int = 0  # 0 = inherit the parent's default layout
    stripe: int = 0


class OpenReq(msgspec.Struct):
    path: str
    flags: int  # os.O_* bits: O_WRONLY/O_RDWR, O_CREAT, O_EXCL, O_TRUNC, O_APPEND
    mode: int = 0o644
    chunk_size: int = 0  # for O_CREAT: 0 = the directory's default
    stripe: int = 0


class OpenRsp(msgspec.Struct):
    attr: InodeAttr
    session: str = ""  # write session id ("" for read-only opens)
    truncated: bool = False  # O_TRUNC removed existing data


class CloseReq(msgspec.Struct):
    inode: int
    session: str = ""
    length_hint: int = -1  # end of the highest byte written, -1 = nothing written


class AttrRsp(msgspec.Struct):
    attr: InodeAttr


class ReaddirReq(msgspec.Struct):
    path: str
    start_after: str = ""
    limit: int = 1024


class ReaddirRsp(msgspec.Struct):
    entries: list[DirEntry]
    more: bool


class PathReq(msgspec.Struct):
    path: str


class RenameReq(msgspec.Struct):
    src: str
    dst: str
    noreplace: bool = False


class TruncateReq(msgspec.Struct):
    path: str
    length: int


class OkRsp(msgspec.Struct):
    pass
