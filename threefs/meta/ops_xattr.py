"""Extended attributes: get / set / list / remove, stored with the inode (XATR + inode + name -> value) and
dropped with it (ops_resolve.drop_inode). Each function is the body of one KV transaction (see ops_create).

Limits and rules are ext4's (Linux fs/xattr.c): a name is at most 255 bytes (ERANGE), a value at most
64 KiB (E2BIG); names live in the user., trusted. and security. namespaces (others: EOPNOTSUPP; a bare
prefix: EINVAL). For callers meta checks itself (not kernel_checked): user.* only on regular files and
directories (EPERM to write, ENODATA to read elsewhere), write permission to change, read permission to
read, only the owner in a sticky directory; trusted.* and security.* are root's. trusted.* names are
listed to root only. Setting or removing one moves the inode's ctime.

POSIX ACLs (system.posix_acl_*) are not kept: the FUSE kernel module answers EOPNOTSUPP for them unless
the daemon asks for ACL support, which it does not (docs/client.md lists it among the departures).
"""

from __future__ import annotations

import stat as st

from threefs.common.status import StatusCode, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.ops_attr import resolve_existing
from threefs.meta.ops_resolve import Walker, put_inode
from threefs.meta.paths import ParsedPath, display
from threefs.meta.schema import DIRECTORY, FILE, Inode
from threefs.meta.users import R, W, require
from threefs.rpc.schemas import meta as m

NAME_BYTES_MAX = 255
VALUE_BYTES_MAX = 64 * 1024
XATTRS_PER_INODE_MAX = 1024  # ENOSPC beyond (ext4 runs out of its xattr block far sooner)
NAMESPACES = ("user.", "trusted.", "security.")
PRIVILEGED_NAMESPACES = ("trusted.", "security.")


async def xattr(tr: Transaction, parsed: ParsedPath, req: m.XattrReq, user: m.UserCred,
                now_ns: int) -> m.XattrRsp:
    reading = req.op in (m.XATTR_GET, m.XATTR_LIST)
    if not reading and req.op not in (m.XATTR_SET, m.XATTR_REMOVE):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"xattr op {req.op!r} is not one of get, set, list, "
                           "remove")
    walker = Walker(tr, display(parsed), snapshot=reading, user=user)
    entry, inode = await resolve_existing(walker, parsed, req.follow)
    inode_id = entry.dentry.inode
    if req.op == m.XATTR_LIST:
        return m.XattrRsp(names=await _names(tr, inode_id, user))
    _check_name(req.name)
    _check_access(user, inode, req.name, writing=not reading, what=walker.path)
    key = schema.xattr_key(inode_id, req.name)
    value = await tr.get(key, snapshot=reading)
    if req.op == m.XATTR_GET:
        if value is None:
            raise _missing(req.name, walker.path)
        return m.XattrRsp(value=value)
    if req.op == m.XATTR_SET:
        await _set(tr, inode_id, key, value, req, walker.path)
    else:
        if value is None:
            raise _missing(req.name, walker.path)
        tr.clear(key)
    inode.ctime_ns = max(inode.ctime_ns, now_ns)
    put_inode(tr, inode_id, inode)
    return m.XattrRsp()


async def _set(tr: Transaction, inode_id: int, key: bytes, old: bytes | None, req: m.XattrReq,
               shown: str) -> None:
    if len(req.value) > VALUE_BYTES_MAX:
        raise status_error(StatusCode.VALUE_TOO_LARGE, f"setxattr {shown}: value of {req.name} is "
                           f"{len(req.value)} bytes, over {VALUE_BYTES_MAX}")
    if req.flags & m.XATTR_CREATE and old is not None:
        raise status_error(StatusCode.EXISTS, f"setxattr {shown}: {req.name} exists (XATTR_CREATE)")
    if req.flags & m.XATTR_REPLACE and old is None:
        raise _missing(req.name, shown)
    if old is None:
        begin, end = schema.xattr_range(inode_id)
        if len(await tr.get_range(begin, end, limit=XATTRS_PER_INODE_MAX)) >= XATTRS_PER_INODE_MAX:
            raise status_error(StatusCode.NO_SPACE, f"setxattr {shown}: it already has "
                               f"{XATTRS_PER_INODE_MAX} extended attributes")
    tr.set(key, bytes(req.value))


async def _names(tr: Transaction, inode_id: int, user: m.UserCred) -> list[str]:
    begin, end = schema.xattr_range(inode_id)
    rows = await tr.get_range(begin, end, limit=XATTRS_PER_INODE_MAX, snapshot=True)
    names = [schema.xattr_name(k) for k, _ in rows]
    if user.uid != 0:  # trusted.* is visible to CAP_SYS_ADMIN only (ext4)
        names = [n for n in names if not n.startswith("trusted.")]
    return names


def _check_name(name: str) -> None:
    raw = name.encode("utf-8", "surrogateescape")
    if not raw or len(raw) > NAME_BYTES_MAX:
        raise status_error(StatusCode.OUT_OF_RANGE, f"extended attribute name of {len(raw)} bytes (1 to "
                           f"{NAME_BYTES_MAX})")
    space = next((p for p in NAMESPACES if name.startswith(p)), None)
    if space is None:
        raise status_error(StatusCode.NOT_SUPPORTED, f"extended attribute {name[:64]!r}: namespaces are "
                           f"{', '.join(NAMESPACES)}")
    if name == space:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"extended attribute {name!r} has no name after "
                           "its namespace")


def _check_access(user: m.UserCred, inode: Inode, name: str, writing: bool, what: str) -> None:
    """Linux xattr_permission, for callers the kernel has not checked already."""
    if user.kernel_checked:
        return
    if name.startswith(PRIVILEGED_NAMESPACES):
        if user.uid != 0:
            if writing:
                raise status_error(StatusCode.NOT_PERMITTED, f"{name} of {what}: only root sets it")
            raise _missing(name, what)
        return
    if inode.type not in (FILE, DIRECTORY):
        if writing:
            raise status_error(StatusCode.NOT_PERMITTED, f"{what}: user.* attributes belong to regular files "
                               "and directories only")
        raise _missing(name, what)
    acl = schema.acl_of(inode)
    if writing and inode.type == DIRECTORY and inode.mode & st.S_ISVTX and user.uid not in (0, inode.uid):
        raise status_error(StatusCode.NOT_PERMITTED, f"{what} is sticky: only its owner sets user.* there")
    require(user, acl, W if writing else R, f"{'set' if writing else 'get'} {name} of {what}")


def _missing(name: str, what: str):
    return status_error(StatusCode.NO_ATTRIBUTE, f"{what} has no extended attribute {name[:300]}")
