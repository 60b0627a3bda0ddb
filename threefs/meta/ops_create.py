"""Operations that create inodes or names: root init, mkdir, open (O_CREAT / O_TRUNC / write sessions),
symlink, special files (mknod) and hard link.

Each function is the body of one KV transaction: it gets the transaction and everything else as arguments
(time, chain table, id sources), and touches nothing outside the transaction, so a retry simply runs it again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

from threefs.common import limits
from threefs.common.ids import ROOT_INODE
from threefs.common.layout import Layout
from threefs.common.status import StatusCode, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.ops_resolve import Entry, Walker, count_subdir, load_dir, put_dentry, put_inode, touch_dir
from threefs.meta.paths import Last, ParsedPath, display, encode_name
from threefs.meta.schema import (BLOCKDEV, CHARDEV, DIRECTORY, FILE, SPECIAL_TYPES, SYMLINK, Dentry, Inode,
                                 WriteSession)
from threefs.meta.users import ROOT, R, W, X, allowed, new_owner, require
from threefs.rpc.schemas.meta import InodeAttr, OpenRsp, UserCred

PERMISSION_BITS = 0o7777
INTERMEDIATE_DIR_MODE = 0o755  # `mkdir -p`: directories on the way get this; only the last gets `mode`


class CreateEnv(NamedTuple):
    """What a creating transaction needs from outside the KV. Both `take_*` are synchronous and raise when
    their in-memory block is used up; the store refills it in its own transaction and runs the operation
    again (an id taken by an attempt that did not commit is simply never used)."""

    now_ns: int
    table: Callable[[int], tuple[int, int, int]]  # table id -> (id, table version, number of chains)
    take_inode: Callable[[], int]
    take_chain_slot: Callable[[int, int], int]  # (table id, stripe) -> round-robin slot
    user: UserCred = ROOT
    token: bytes = b""  # the request's fingerprint (schema.request_token), b"" = none

    def retried(self, dentry: Dentry | None) -> bool:
        """Whether an existing entry was made by this very request: a retry after a lost reply, which
        gets the reply again instead of EEXIST (3FS keeps a request uuid in the dentry for this)."""
        return bool(self.token) and dentry is not None and dentry.creator == self.token


class Replan(Exception):
    """The file an O_TRUNC / truncate was planned for changed before the transaction (another truncate,
    a rename): the service removes chunks again for what is there now and reruns the operation."""


def new_inode(kind: int, mode: int, now_ns: int, uid: int = 0, gid: int = 0, **fields) -> Inode:
    return Inode(
        type=kind, mode=mode & PERMISSION_BITS, uid=uid, gid=gid, nlink=1,
        atime_ns=now_ns, mtime_ns=now_ns, ctime_ns=now_ns, **fields,
    )


def require_name(parsed: ParsedPath, what: str) -> None:
    """Namespace changes need a name: the inode itself (SELF) cannot be created, removed or renamed."""
    if parsed.kind is Last.SELF:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"cannot {what} {display(parsed)}: it names an "
                           f"inode, not an entry (give a parent inode and a name)")


async def writable_parent(tr: Transaction, entry: Entry, user: UserCred, what: str,
                          walker: Walker | None = None) -> Inode:
    """The directory that gets or loses a name, after checking the user may change it (write + search).
    `walker`: the walk that found `entry`, which may have read the directory's record already."""
    parent = await (walker.dir_record(entry.dir_id) if walker is not None else load_dir(tr, entry.dir_id))
    require(user, schema.acl_of(parent), W | X, f"{what} (in {entry.display.rsplit('/', 1)[0] or '/'})")
    return parent


def derive_layout(base: Layout, chunk_size: int, stripe: int, n_chains: int) -> Layout:
    """`base` with the caller's chunk size / stripe where given (0 = inherit), validated."""
    layout = Layout(
        table_id=base.table_id, table_version=base.table_version,
        chunk_size=chunk_size or base.chunk_size, stripe=stripe or base.stripe,
    ).validate()
    if stripe and n_chains and stripe > n_chains:
        raise status_error(
            StatusCode.INVALID_ARGUMENT,
            f"stripe {stripe} exceeds the {n_chains} chains of chain table {base.table_id}",
        )
    return layout


def file_layout(default: Layout, chunk_size: int, stripe: int, inode_id: int, env: CreateEnv) -> Layout:
    """A new file's layout: the directory default, the current chain table, a round-robin base chain.

    3FS's ChainAllocator: base = counter % n_chains + 1, then counter += stripe, so consecutive files start on
    consecutive groups of chains. The slot counter is per (table, stripe); counter = slot * stripe.
    """
    table_id, table_version, n_chains = env.table(default.table_id)
    if n_chains <= 0:
        raise status_error(
            StatusCode.CHAIN_TABLE_NOT_FOUND,
            f"chain table {table_id} has no chains yet; files cannot be created until storage is registered",
        )
    layout = derive_layout(default, chunk_size, stripe, n_chains)
    stripe = min(layout.stripe, n_chains)  # an inherited stripe wider than the table would reuse chains
    slot = env.take_chain_slot(table_id, stripe)
    base_index = (slot * stripe) % n_chains + 1
    return Layout(table_id, table_version, layout.chunk_size, stripe, base_index, seed=inode_id)


async def init_root(tr: Transaction, default_layout: Layout, now_ns: int) -> bool:
    """Create the root directory unless it exists. Conflict-tracked read: of two racing servers one creates
    it, the other retries and finds it. Returns whether this call created it."""
    if await tr.get(schema.inode_key(ROOT_INODE)) is not None:
        return False
    root = new_inode(DIRECTORY, 0o755, now_ns, layout=default_layout, parent=ROOT_INODE)
    put_inode(tr, ROOT_INODE, root)
    return True


async def make_dir(
    tr: Transaction, parent_id: int, name: str, mode: int, chunk_size: int, stripe: int, env: CreateEnv,
    shown: str,
) -> tuple[int, Inode]:
    """Add directory `name` to `parent_id` (whose entry must have been checked absent)."""
    parent = await load_dir(tr, parent_id)
    require(env.user, schema.acl_of(parent), W | X, f"mkdir {shown}")
    assert parent.layout is not None, f"directory {parent_id} has no default layout"
    layout = derive_layout(parent.layout, chunk_size, stripe, env.table(parent.layout.table_id)[2])
    inode_id = env.take_inode()
    uid, gid, mode = new_owner(env.user, schema.acl_of(parent), mode & PERMISSION_BITS, True)
    inode = new_inode(DIRECTORY, mode, env.now_ns, uid, gid, layout=layout, parent=parent_id,
                      name=encode_name(name), subdirs=0)
    put_inode(tr, inode_id, inode)
    dentry = schema.dir_dentry(inode_id, inode)
    dentry.creator = env.token
    put_dentry(tr, parent_id, name, dentry)
    await count_subdir(tr, parent_id, parent, +1)
    touch_dir(tr, parent_id, parent, env.now_ns)
    return inode_id, inode


async def mkdir(
    tr: Transaction, parsed: ParsedPath, mode: int, parents: bool, chunk_size: int, stripe: int,
    env: CreateEnv,
) -> InodeAttr:
    walker = Walker(tr, display(parsed), snapshot=False, user=env.user)
    if parents and parsed.kind is not Last.SELF:
        return await _mkdir_parents(walker, parsed, mode, chunk_size, stripe, env)
    entry = await walker.resolve(parsed, follow=False)
    if entry.dentry is not None:  # includes '/', '.', '..' and the start inode itself (Linux: EEXIST)
        if (parents or env.retried(entry.dentry)) and entry.dentry.type == DIRECTORY:
            return schema.to_attr(entry.dentry.inode, await walker.load(entry.dentry.inode))
        raise status_error(StatusCode.EXISTS, f"file exists: {walker.path}")
    inode_id, inode = await make_dir(tr, entry.dir_id, entry.name, mode, chunk_size, stripe, env,
                                     walker.path)
    return schema.to_attr(inode_id, inode)


async def _mkdir_parents(
    walker: Walker, parsed: ParsedPath, mode: int, chunk_size: int, stripe: int, env: CreateEnv
) -> InodeAttr:
    """`mkdir -p`: create what is missing along the path; an existing directory at the end is fine."""
    names = list(parsed.parent) + ([parsed.last] if parsed.kind in (Last.NAME, Last.DOTDOT) else [])
    stack = await walker.start_stack(parsed)
    for i, name in enumerate(names):
        is_last = i == len(names) - 1
        if name == "..":
            await walker.walk_dirs([name], stack)
            continue
        await walker.check_search(stack)
        dentry = await walker.lookup(stack.ids[-1], name)
        if dentry is None:
            args = (mode, chunk_size, stripe) if is_last else (INTERMEDIATE_DIR_MODE, 0, 0)
            inode_id, inode = await make_dir(walker.tr, stack.ids[-1], name, *args, env, walker.path)
            stack.push(inode_id, schema.acl_of(inode), name)
        elif dentry.type == DIRECTORY:
            stack.push(dentry.inode, dentry.acl, name)
        elif dentry.type == SYMLINK:
            await walker.walk_dirs([name], stack)
        else:
            code = StatusCode.EXISTS if is_last else StatusCode.NOT_DIRECTORY
            raise status_error(code, f"{stack.display(name)} exists and is not a directory "
                               f"(mkdir -p {parsed.text})")
    return schema.to_attr(stack.ids[-1], await walker.load(stack.ids[-1]))


def _is_write(flags: int) -> bool:
    return flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


async def open_file(
    tr: Transaction, parsed: ParsedPath, flags: int, mode: int, chunk_size: int, stripe: int,
    session: str, client_id: str, env: CreateEnv, trunc_plan: tuple[int, int] | None = None,
    stamp_client: bool = True,
) -> OpenRsp:
    """open(2) on the namespace: create, truncate and register a write session as `flags` ask.

    `trunc_plan` is the (inode, truncate version) whose chunks the service removed before this O_TRUNC
    (None: no storage behind this store); a different file or version at the path raises Replan."""
    create, exclusive = bool(flags & os.O_CREAT), bool(flags & os.O_EXCL)
    # O_CREAT|O_EXCL never follows a final symlink (POSIX), O_NOFOLLOW neither; a trailing slash always does.
    follow = parsed.trailing_slash or not (flags & os.O_NOFOLLOW or (create and exclusive))
    walker = Walker(tr, display(parsed), snapshot=False, user=env.user)
    entry = await walker.resolve(parsed, follow=follow)
    if create and (parsed.kind not in (Last.NAME, Last.SELF) or parsed.trailing_slash):
        raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {walker.path} (cannot create a file)")
    truncated = False
    if entry.dentry is None:
        if not create:
            raise walker.not_found(entry.display)
        inode_id, inode = await _create_file(walker, entry, mode, chunk_size, stripe, env)
    else:
        if create and exclusive and not env.retried(entry.dentry):
            raise status_error(StatusCode.EXISTS, f"file exists: {walker.path} (O_CREAT|O_EXCL)")
        inode_id = entry.dentry.inode
        inode = await walker.load(inode_id)
        _check_open_existing(inode, flags, parsed, walker.path)
        _check_open_access(env.user, inode, flags, walker.path)
        if flags & os.O_TRUNC and inode.type == FILE:
            if trunc_plan is not None and trunc_plan != (inode_id, inode.truncate_ver):
                raise Replan(walker.path)
            truncated = inode.length > 0
            set_length(tr, inode_id, inode, 0, env.now_ns, touch=True)
    if _is_write(flags):
        open_session(tr, inode_id, inode, session, client_id, env.now_ns, stamp_client)
    return OpenRsp(schema.to_attr(inode_id, inode), session if _is_write(flags) else "", truncated)


def open_session(tr: Transaction, inode_id: int, inode: Inode, session: str, client_id: str,
                 now_ns: int, stamp_client: bool) -> None:
    """Record a write session. `stamp_client` marks the client as seen in the same transaction (a blind
    write: it never conflicts with other opens, only with a pruner deciding the client is gone), so a
    session never exists without its client's record; the service skips it when it stamped the client
    recently (background.py)."""
    record = WriteSession(client_id=client_id, opened_ns=now_ns, truncate_ver=inode.truncate_ver)
    tr.set(schema.session_key(inode_id, session), schema.encode(record))
    if client_id and stamp_client:
        tr.set(schema.client_record_key(client_id), schema.encode(schema.ClientRecord(now_ns)))


async def _create_file(
    walker: Walker, entry: Entry, mode: int, chunk_size: int, stripe: int, env: CreateEnv
) -> tuple[int, Inode]:
    tr = walker.tr
    parent = await writable_parent(tr, entry, env.user, f"create {walker.path}", walker)
    assert parent.layout is not None, f"directory {entry.dir_id} has no default layout"
    inode_id = env.take_inode()
    layout = file_layout(parent.layout, chunk_size, stripe, inode_id, env)
    uid, gid, mode = new_owner(env.user, schema.acl_of(parent), mode & PERMISSION_BITS, False)
    inode = new_inode(FILE, mode, env.now_ns, uid, gid, layout=layout)
    put_inode(tr, inode_id, inode)
    put_dentry(tr, entry.dir_id, entry.name, Dentry(inode_id, FILE, creator=env.token))
    touch_dir(tr, entry.dir_id, parent, env.now_ns)
    return inode_id, inode


def _check_open_existing(inode: Inode, flags: int, parsed: ParsedPath, path: str) -> None:
    """Linux's answers for opening something that exists (checked in Linux's order)."""
    if inode.type == DIRECTORY:
        if _is_write(flags) or flags & (os.O_CREAT | os.O_TRUNC):
            raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {path} (cannot open it to write)")
        return
    if parsed.trailing_slash or flags & os.O_DIRECTORY:
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {path}")
    if inode.type == SYMLINK:  # only reached when not following (O_NOFOLLOW)
        raise status_error(StatusCode.TOO_MANY_SYMLINKS, f"{path} is a symbolic link (O_NOFOLLOW)")
    if inode.type in SPECIAL_TYPES:  # pipes, devices and sockets are opened by the kernel, not here
        raise status_error(StatusCode.NOT_SUPPORTED, f"{path} is a special file (FIFO, device or socket): "
                           "open it through a FUSE mount, where the kernel does its IO")


def _check_open_access(user: UserCred, inode: Inode, flags: int, path: str) -> None:
    """Read / write permission for the access mode; O_TRUNC needs write (Linux may_open)."""
    accmode = flags & os.O_ACCMODE
    want = (R if accmode in (os.O_RDONLY, os.O_RDWR) else 0) | (W if _is_write(flags) else 0)
    if flags & os.O_TRUNC:
        want |= W
    require(user, schema.acl_of(inode), want, f"open {path}")


def set_length(tr: Transaction, inode_id: int, inode: Inode, length: int, now_ns: int, touch: bool) -> None:
    """A truncate's metadata: the new length and a new truncate version (so length hints from before it
    are ignored). mtime/ctime move when the length changed or `touch` (O_TRUNC always moves them)."""
    assert inode.type == FILE and inode.layout is not None, (inode_id, inode.type)
    if touch or length != inode.length:
        inode.mtime_ns = max(inode.mtime_ns, now_ns)
        inode.ctime_ns = max(inode.ctime_ns, now_ns)
    inode.length = length
    inode.truncate_ver += 1
    put_inode(tr, inode_id, inode)


# -- symlink and hard link ---------------------------------------------------------------------------------


def check_symlink_target(target: str) -> None:
    if not isinstance(target, str) or not target:
        raise status_error(StatusCode.NOT_FOUND, "a symlink target cannot be empty (Linux: ENOENT)")
    if "\x00" in target:
        raise status_error(StatusCode.INVALID_PATH, "a symlink target cannot contain a NUL byte")
    size = len(encode_name(target))
    if size > limits.PATH_BYTES_MAX:
        raise status_error(StatusCode.NAME_TOO_LONG, f"symlink target is {size} bytes, over the limit of "
                           f"{limits.PATH_BYTES_MAX}")


async def symlink(tr: Transaction, parsed: ParsedPath, target: str, env: CreateEnv) -> InodeAttr:
    """symlink(2): a new name holding `target` as given (resolved only when followed)."""
    check_symlink_target(target)
    require_name(parsed, "create a symlink at")
    walker = Walker(tr, display(parsed), snapshot=False, user=env.user)
    entry = await walker.resolve(parsed, follow=False)
    if env.retried(entry.dentry):
        return schema.to_attr(entry.dentry.inode, await walker.load(entry.dentry.inode))
    if entry.dentry is not None or parsed.kind is not Last.NAME:
        raise status_error(StatusCode.EXISTS, f"file exists: {walker.path}")
    if parsed.trailing_slash:  # Linux: the new name would have to be a directory
        raise walker.not_found(walker.path)
    parent = await writable_parent(tr, entry, walker.user, f"symlink {walker.path}", walker)
    inode_id = env.take_inode()
    uid, gid, _ = new_owner(env.user, schema.acl_of(parent), 0, False)
    inode = new_inode(SYMLINK, 0o777, env.now_ns, uid, gid, length=len(encode_name(target)),
                      symlink_target=target)
    put_inode(tr, inode_id, inode)
    put_dentry(tr, entry.dir_id, entry.name, Dentry(inode_id, SYMLINK, creator=env.token))
    touch_dir(tr, entry.dir_id, parent, env.now_ns)
    return schema.to_attr(inode_id, inode)


RDEV_MAX = (1 << 64) - 1


async def mknod(tr: Transaction, parsed: ParsedPath, kind: int, mode: int, rdev: int,
                env: CreateEnv) -> InodeAttr:
    """mknod(2) of a FIFO, device or socket: an inode of that type with its mode and rdev (no layout, no
    chunks; the kernel does its IO). Creating devices is the kernel's to allow (CAP_MKNOD)."""
    if kind not in SPECIAL_TYPES:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"mknod type {kind} is not a special file type "
                           f"(FIFO, CHARDEV, BLOCKDEV, SOCKET); regular files are created by open")
    if not 0 <= rdev <= RDEV_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"mknod: device number {rdev} is out of range")
    require_name(parsed, "create a special file at")
    walker = Walker(tr, display(parsed), snapshot=False, user=env.user)
    entry = await walker.resolve(parsed, follow=False)
    if env.retried(entry.dentry):
        return schema.to_attr(entry.dentry.inode, await walker.load(entry.dentry.inode))
    if entry.dentry is not None or parsed.kind is not Last.NAME:
        raise status_error(StatusCode.EXISTS, f"file exists: {walker.path}")
    if parsed.trailing_slash:
        raise walker.not_found(walker.path)
    parent = await writable_parent(tr, entry, walker.user, f"mknod {walker.path}", walker)
    inode_id = env.take_inode()
    uid, gid, mode = new_owner(env.user, schema.acl_of(parent), mode & PERMISSION_BITS, False)
    inode = new_inode(kind, mode, env.now_ns, uid, gid, rdev=rdev if kind in (CHARDEV, BLOCKDEV) else 0)
    put_inode(tr, inode_id, inode)
    put_dentry(tr, entry.dir_id, entry.name, Dentry(inode_id, kind, creator=env.token))
    touch_dir(tr, entry.dir_id, parent, env.now_ns)
    return schema.to_attr(inode_id, inode)


async def link(tr: Transaction, src: ParsedPath, dst: ParsedPath, env: CreateEnv) -> InodeAttr:
    """link(2) (linkat without AT_SYMLINK_FOLLOW): another name for a file or symlink, never a directory."""
    user = env.user
    source = await Walker(tr, display(src), snapshot=False, user=user).resolve(src, follow=False)
    walker = Walker(tr, display(dst), snapshot=False, user=user)
    target = await walker.resolve(dst, follow=False)
    if source.dentry is None:
        raise status_error(StatusCode.NOT_FOUND, f"no such file or directory: {display(src)}")
    if source.dentry.type == DIRECTORY:
        raise status_error(StatusCode.NOT_PERMITTED, f"cannot hard-link directory {display(src)} (only "
                           "files and symlinks have several names)")
    if src.trailing_slash:
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {display(src)}")
    require_name(dst, "link to")
    if env.retried(target.dentry):
        return schema.to_attr(target.dentry.inode, await walker.load(target.dentry.inode))
    if target.dentry is not None or dst.kind is not Last.NAME:
        raise status_error(StatusCode.EXISTS, f"file exists: {walker.path}")
    if dst.trailing_slash:
        raise walker.not_found(walker.path)
    inode_id = source.dentry.inode
    inode = await walker.load(inode_id)
    _check_link_source(user, inode, inode_id, display(src))
    parent = await writable_parent(tr, target, user, f"link {walker.path}")
    inode.nlink += 1
    inode.ctime_ns = max(inode.ctime_ns, env.now_ns)
    put_inode(tr, inode_id, inode)
    put_dentry(tr, target.dir_id, target.name, Dentry(inode_id, inode.type, creator=env.token))
    touch_dir(tr, target.dir_id, parent, env.now_ns)
    return schema.to_attr(inode_id, inode)


def _check_link_source(user: UserCred, inode: Inode, inode_id: int, shown: str) -> None:
    if inode.nlink == 0:  # unlinked but still open: Linux refuses to give it a name again
        raise status_error(StatusCode.NOT_FOUND, f"{shown} (inode {inode_id}) has been removed")
    if inode.nlink >= limits.NLINK_MAX:
        raise status_error(StatusCode.TOO_MANY_LINKS, f"{shown} already has {inode.nlink} names (limit "
                           f"{limits.NLINK_MAX})")
    # Linux's protected_hardlinks: only the owner, or someone who may read and write the file, links it.
    if user.uid != 0 and user.uid != inode.uid and not allowed(user, schema.acl_of(inode), R | W):
        raise status_error(StatusCode.NOT_PERMITTED, f"operation not permitted: link {shown} (uid "
                           f"{user.uid} neither owns it nor may read and write it)")
