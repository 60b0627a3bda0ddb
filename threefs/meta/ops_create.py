"""Operations that create inodes: root init, mkdir, open (with O_CREAT / O_TRUNC / write sessions).

Each function is the body of one KV transaction: it gets the transaction and everything else as arguments
(time, chain table, id sources), and touches nothing outside the transaction, so a retry simply runs it again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

from threefs.common.ids import ROOT_INODE
from threefs.common.layout import Layout
from threefs.common.status import StatusCode, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.ops_resolve import Entry, Walker, load_dir, put_dentry, put_inode, touch_dir
from threefs.meta.paths import Last, ParsedPath, encode_name
from threefs.meta.schema import DIRECTORY, FILE, SYMLINK, Dentry, Inode, TruncateJob, WriteSession
from threefs.rpc.schemas.meta import InodeAttr, OpenRsp

PERMISSION_BITS = 0o7777
INTERMEDIATE_DIR_MODE = 0o755  # `mkdir -p`: directories on the way get this; only the last gets `mode`


class CreateEnv(NamedTuple):
    """What a creating transaction needs from outside the KV. Both `take_*` are synchronous and raise when
    their in-memory block is used up; the store refills it in its own transaction and runs the operation
    again (an id taken by an attempt that did not commit is simply never used)."""

    now_ns: int
    table: tuple[int, int, int]  # (chain table id, table version, number of chains)
    take_inode: Callable[[], int]
    take_chain_slot: Callable[[int, int], int]  # (table id, stripe) -> round-robin slot


def new_inode(kind: int, mode: int, now_ns: int, **fields) -> Inode:
    return Inode(
        type=kind, mode=mode & PERMISSION_BITS, uid=0, gid=0, nlink=1,
        atime_ns=now_ns, mtime_ns=now_ns, ctime_ns=now_ns, **fields,
    )


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
    table_id, table_version, n_chains = env.table
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
    tr: Transaction, parent_id: int, name: str, mode: int, chunk_size: int, stripe: int, env: CreateEnv
) -> tuple[int, Inode]:
    """Add directory `name` to `parent_id` (whose entry must have been checked absent)."""
    parent = await load_dir(tr, parent_id)
    assert parent.layout is not None, f"directory {parent_id} has no default layout"
    layout = derive_layout(parent.layout, chunk_size, stripe, env.table[2])
    inode_id = env.take_inode()
    inode = new_inode(DIRECTORY, mode, env.now_ns, layout=layout, parent=parent_id, name=encode_name(name))
    put_inode(tr, inode_id, inode)
    put_dentry(tr, parent_id, name, Dentry(inode_id, DIRECTORY))
    touch_dir(tr, parent_id, parent, env.now_ns)
    return inode_id, inode


async def mkdir(
    tr: Transaction, parsed: ParsedPath, mode: int, parents: bool, chunk_size: int, stripe: int,
    env: CreateEnv,
) -> InodeAttr:
    walker = Walker(tr, parsed.text, snapshot=False)
    if parents:
        return await _mkdir_parents(walker, parsed, mode, chunk_size, stripe, env)
    entry = await walker.resolve(parsed, follow=False)
    if entry.dentry is not None:  # includes '/', '.', '..' (Linux: EEXIST)
        raise status_error(StatusCode.EXISTS, f"file exists: {parsed.text}")
    inode_id, inode = await make_dir(tr, entry.dir_id, entry.name, mode, chunk_size, stripe, env)
    return schema.to_attr(inode_id, inode)


async def _mkdir_parents(
    walker: Walker, parsed: ParsedPath, mode: int, chunk_size: int, stripe: int, env: CreateEnv
) -> InodeAttr:
    """`mkdir -p`: create what is missing along the path; an existing directory at the end is fine."""
    names = list(parsed.parent) + ([parsed.last] if parsed.kind in (Last.NAME, Last.DOTDOT) else [])
    ids, shown = [ROOT_INODE], []
    for i, name in enumerate(names):
        is_last = i == len(names) - 1
        if name == "..":
            ids, shown = await walker.walk_dirs([name], ids, shown)
            continue
        dentry = await walker.lookup(ids[-1], name)
        if dentry is None:
            args = (mode, chunk_size, stripe) if is_last else (INTERMEDIATE_DIR_MODE, 0, 0)
            inode_id, _ = await make_dir(walker.tr, ids[-1], name, *args, env)
            ids, shown = [*ids, inode_id], [*shown, name]
        elif dentry.type == DIRECTORY:
            ids, shown = [*ids, dentry.inode], [*shown, name]
        elif dentry.type == SYMLINK:
            ids, shown = await walker.walk_dirs([name], ids, shown)
        else:
            code = StatusCode.EXISTS if is_last else StatusCode.NOT_DIRECTORY
            raise status_error(code, f"{'/' + '/'.join([*shown, name])} exists and is not a directory "
                               f"(mkdir -p {parsed.text})")
    return schema.to_attr(ids[-1], await walker.load(ids[-1]))


def _is_write(flags: int) -> bool:
    return flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


async def open_file(
    tr: Transaction, parsed: ParsedPath, flags: int, mode: int, chunk_size: int, stripe: int,
    session: str, client_id: str, env: CreateEnv,
) -> tuple[OpenRsp, TruncateJob | None]:
    """open(2) on the namespace: create, truncate and register a write session as `flags` ask."""
    create, exclusive = bool(flags & os.O_CREAT), bool(flags & os.O_EXCL)
    # O_CREAT|O_EXCL never follows a final symlink (POSIX), O_NOFOLLOW neither; a trailing slash always does.
    follow = parsed.trailing_slash or not (flags & os.O_NOFOLLOW or (create and exclusive))
    walker = Walker(tr, parsed.text, snapshot=False)
    entry = await walker.resolve(parsed, follow=follow)
    if create and (parsed.kind is not Last.NAME or parsed.trailing_slash):
        raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {parsed.text} (cannot create a file)")
    job = None
    if entry.dentry is None:
        if not create:
            raise walker.not_found(entry.display)
        inode_id, inode = await _create_file(walker, entry, mode, chunk_size, stripe, env)
    else:
        if create and exclusive:
            raise status_error(StatusCode.EXISTS, f"file exists: {parsed.text} (O_CREAT|O_EXCL)")
        inode_id = entry.dentry.inode
        inode = await walker.load(inode_id)
        _check_open_existing(inode, flags, parsed)
        if flags & os.O_TRUNC and inode.type == FILE:
            job = truncate_inode(tr, inode_id, inode, 0, env.now_ns)
    if _is_write(flags):
        record = WriteSession(client_id=client_id, opened_ns=env.now_ns)
        tr.set(schema.session_key(inode_id, session), schema.encode(record))
    rsp = OpenRsp(schema.to_attr(inode_id, inode), session if _is_write(flags) else "", job is not None)
    return rsp, job


async def _create_file(
    walker: Walker, entry: Entry, mode: int, chunk_size: int, stripe: int, env: CreateEnv
) -> tuple[int, Inode]:
    tr = walker.tr
    parent = await load_dir(tr, entry.dir_id)
    assert parent.layout is not None, f"directory {entry.dir_id} has no default layout"
    inode_id = env.take_inode()
    layout = file_layout(parent.layout, chunk_size, stripe, inode_id, env)
    inode = new_inode(FILE, mode, env.now_ns, layout=layout)
    put_inode(tr, inode_id, inode)
    put_dentry(tr, entry.dir_id, entry.name, Dentry(inode_id, FILE))
    touch_dir(tr, entry.dir_id, parent, env.now_ns)
    return inode_id, inode


def _check_open_existing(inode: Inode, flags: int, parsed: ParsedPath) -> None:
    """Linux's answers for opening something that exists (checked in Linux's order)."""
    path = parsed.text
    if inode.type == DIRECTORY:
        if _is_write(flags) or flags & (os.O_CREAT | os.O_TRUNC):
            raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {path} (cannot open it to write)")
        return
    if parsed.trailing_slash or flags & os.O_DIRECTORY:
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {path}")
    if inode.type == SYMLINK:  # only reached when not following (O_NOFOLLOW)
        raise status_error(StatusCode.TOO_MANY_SYMLINKS, f"{path} is a symbolic link (O_NOFOLLOW)")


def truncate_inode(
    tr: Transaction, inode_id: int, inode: Inode, length: int, now_ns: int
) -> TruncateJob | None:
    """Set a file's length (mtime/ctime move, as truncate(2) does). Returns the storage job when it shrank."""
    assert inode.type == FILE and inode.layout is not None, (inode_id, inode.type)
    old_length = inode.length
    inode.length = length
    inode.mtime_ns = max(inode.mtime_ns, now_ns)
    inode.ctime_ns = max(inode.ctime_ns, now_ns)
    put_inode(tr, inode_id, inode)
    if length >= old_length:
        return None
    return TruncateJob(inode=inode_id, layout=inode.layout, old_length=old_length, new_length=length)

