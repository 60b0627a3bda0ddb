"""Operations that remove or move names: unlink, rmdir, rename, and remove (recursive: hand a tree to GC).

Each function is the body of one KV transaction (see ops_create). A file whose last name goes away keeps its
inode record (nlink 0) and gets a GCQU entry; GC removes its chunks on storage and then drops the entry and
the inode together (ops_gc). Empty directories and symlinks own no chunks, so their records go at once. A
non-empty directory removed recursively is unhooked from its parent in one transaction and queued as a GC
entry of type DIRECTORY; GC empties it later, entry by entry (ops_gc).

Checks come in Linux's order (namei.c: do_unlinkat, do_rmdir, do_renameat2 and may_delete), so errnos match.
"""

from __future__ import annotations

from threefs.common import limits
from threefs.common.ids import GC_ROOT_INODE, ROOT_INODE
from threefs.common.status import StatusCode, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.ops_create import require_name
from threefs.meta.ops_resolve import (Entry, Walker, count_subdir, drop_inode, is_empty_dir, load_dir,
                                      put_dentry, put_inode, touch_dir)
from threefs.meta.paths import Last, ParsedPath, display, encode_name
from threefs.meta.schema import DIRECTORY, FILE, GcEntry, Inode
from threefs.meta.users import R, W, X, Acl, require, require_sticky
from threefs.rpc.schemas.meta import UserCred

# Renames can stack subtrees deeper than any path may name (PATH_DEPTH_MAX), so the walk up the parent
# pointers gets its own, larger bound; reaching it means a cycle, i.e. a broken invariant.
ANCESTOR_WALK_MAX = limits.PATH_BYTES_MAX
# A user other than root removing a tree recursively has every directory in it checked first (one snapshot);
# bigger trees must be removed in parts (root's recursive removes are not checked, so not bounded).
TREE_CHECK_ENTRIES_MAX = 10_000
TREE_CHECK_PAGE = 1024


def release_inode(tr: Transaction, inode_id: int, inode: Inode, now_ns: int) -> None:
    """One name of `inode` is gone: drop a link; a file left without names is queued for GC."""
    if inode.type == DIRECTORY:  # only ever removed empty
        drop_inode(tr, inode_id)
        return
    inode.nlink -= 1
    inode.ctime_ns = max(inode.ctime_ns, now_ns)
    assert inode.nlink >= 0, (inode_id, inode.nlink)
    if inode.nlink > 0:
        put_inode(tr, inode_id, inode)
    elif inode.type == FILE:
        put_inode(tr, inode_id, inode)  # kept until GC has removed its chunks
        entry = GcEntry(inode=inode_id, layout=inode.layout, length=inode.length, queued_ns=now_ns)
        tr.set(schema.gc_key(entry), schema.encode(entry))
    else:
        drop_inode(tr, inode_id)


async def _touch(tr: Transaction, parents: dict[int, Inode], now_ns: int) -> None:
    for dir_id in sorted(parents):
        touch_dir(tr, dir_id, parents[dir_id], now_ns)


async def may_delete(
    tr: Transaction, entry: Entry, victim_uid: int, user: UserCred, what: str, walker: Walker | None = None
) -> Inode:
    """Linux may_delete's permission part: write + search on the directory, then the sticky rule.
    Returns the directory's record (for its times; `walker`: the walk that found `entry` may have it)."""
    parent = await (walker.dir_record(entry.dir_id) if walker is not None else load_dir(tr, entry.dir_id))
    acl = schema.acl_of(parent)
    require(user, acl, W | X, what)
    require_sticky(user, acl, victim_uid, what)
    return parent


async def unlink(tr: Transaction, parsed: ParsedPath, user: UserCred, now_ns: int) -> None:
    require_name(parsed, "unlink")
    walker = Walker(tr, display(parsed), snapshot=False, user=user)
    entry = await walker.resolve(parsed, follow=False)
    if parsed.kind is not Last.NAME:
        raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {walker.path} (use rmdir)")
    if entry.dentry is None:
        raise walker.not_found(entry.display)
    if parsed.trailing_slash:
        if entry.dentry.type == DIRECTORY:
            raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {walker.path} (use rmdir)")
        raise walker.not_a_directory(entry.display)
    inode_id = entry.dentry.inode
    inode = await walker.load(inode_id)
    parent = await may_delete(tr, entry, inode.uid, user, f"unlink {walker.path}", walker)
    if entry.dentry.type == DIRECTORY:
        raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {walker.path} (use rmdir)")
    tr.clear(schema.dentry_key(entry.dir_id, entry.name))
    release_inode(tr, inode_id, inode, now_ns)
    await _touch(tr, {entry.dir_id: parent}, now_ns)


async def _directory_entry(walker: Walker, parsed: ParsedPath) -> Entry:
    """rmdir's checks of the last component (Linux do_rmdir), before permissions."""
    require_name(parsed, "remove")
    entry = await walker.resolve(parsed, follow=False)
    if parsed.kind is Last.DOT:
        raise status_error(StatusCode.INVALID_PATH, f"cannot remove {walker.path}: it ends in '.'")
    if parsed.kind is Last.DOTDOT:
        raise status_error(StatusCode.NOT_EMPTY, f"directory not empty: {walker.path} (ends in '..')")
    if parsed.kind is Last.ROOT:
        raise status_error(StatusCode.BUSY, "cannot remove the root directory")
    if entry.dentry is None:
        raise walker.not_found(entry.display)
    return entry


async def rmdir(tr: Transaction, parsed: ParsedPath, user: UserCred, now_ns: int) -> None:
    walker = Walker(tr, display(parsed), snapshot=False, user=user)
    entry = await _directory_entry(walker, parsed)
    if entry.dentry.type == DIRECTORY:
        victim_uid = entry.dentry.uid
    else:
        victim_uid = (await walker.load(entry.dentry.inode)).uid
    parent = await may_delete(tr, entry, victim_uid, user, f"rmdir {walker.path}", walker)
    if entry.dentry.type != DIRECTORY:
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {walker.path} (use unlink)")
    if not await is_empty_dir(tr, entry.dentry.inode):
        raise status_error(StatusCode.NOT_EMPTY, f"directory not empty: {walker.path}")
    tr.clear(schema.dentry_key(entry.dir_id, entry.name))
    drop_inode(tr, entry.dentry.inode)
    await count_subdir(tr, entry.dir_id, parent, -1)
    await _touch(tr, {entry.dir_id: parent}, now_ns)


async def remove(tr: Transaction, parsed: ParsedPath, recursive: bool, user: UserCred, now_ns: int) -> bool:
    """Remove any entry: files and symlinks as unlink, empty directories as rmdir; with `recursive`, a
    non-empty directory is unhooked and queued for GC in this one transaction. Returns whether a tree went
    to GC. A user other than root must have had the tree checked (check_tree) first."""
    walker = Walker(tr, display(parsed), snapshot=False, user=user)
    entry = await _directory_entry(walker, parsed)
    if entry.dentry.type != DIRECTORY:
        await unlink(tr, parsed, user, now_ns)
        return False
    if not recursive or await is_empty_dir(tr, entry.dentry.inode):
        await rmdir(tr, parsed, user, now_ns)
        return False
    parent = await may_delete(tr, entry, entry.dentry.uid, user, f"remove {walker.path}", walker)
    inode_id = entry.dentry.inode
    tree = await walker.load(inode_id)
    hand_to_gc(tr, inode_id, tree, now_ns)
    tr.clear(schema.dentry_key(entry.dir_id, entry.name))
    await count_subdir(tr, entry.dir_id, parent, -1)
    await _touch(tr, {entry.dir_id: parent}, now_ns)
    return True


def hand_to_gc(tr: Transaction, dir_id: int, directory: Inode, now_ns: int) -> None:
    """Queue a directory (and so its tree) for GC: it takes no new names (nlink 0), and its parent pointer
    names the GC root, so ancestor walks from inside the tree stop there."""
    directory.nlink, directory.parent = 0, GC_ROOT_INODE
    directory.ctime_ns = max(directory.ctime_ns, now_ns)
    put_inode(tr, dir_id, directory)
    entry = GcEntry(inode=dir_id, layout=None, length=0, queued_ns=now_ns, type=DIRECTORY)
    tr.set(schema.gc_key(entry), schema.encode(entry))


async def check_tree(tr: Transaction, parsed: ParsedPath, user: UserCred) -> int:
    """For a non-root recursive remove: every directory in the tree must be readable, writable and
    searchable by `user`, and sticky directories must allow each removal, as `rm -r` would need. Snapshot
    reads, at most TREE_CHECK_ENTRIES_MAX entries. Returns the number of entries seen."""
    walker = Walker(tr, display(parsed), snapshot=True, user=user)
    entry = await walker.resolve(parsed, follow=False)
    if entry.dentry is None or entry.dentry.type != DIRECTORY or user.uid == 0:
        return 0
    pending, seen = [(entry.dentry.inode, entry.dentry.acl, walker.path)], 0
    while pending:
        dir_id, acl, shown = pending.pop()
        require(user, acl, R | W | X, f"remove {walker.path} (in {shown})")
        seen = await _check_children(tr, dir_id, acl, shown, user, seen, pending)
    return seen


async def _check_children(tr, dir_id: int, acl: Acl, shown: str, user: UserCred, seen: int,
                          pending: list) -> int:
    begin, end = schema.dentry_range(dir_id)
    while True:  # bounded by TREE_CHECK_ENTRIES_MAX overall
        rows = await tr.get_range(begin, end, limit=TREE_CHECK_PAGE, snapshot=True)
        for key, raw in rows:
            seen += 1
            if seen > TREE_CHECK_ENTRIES_MAX:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"tree has over {TREE_CHECK_ENTRIES_MAX} "
                                   "entries: remove its subdirectories first, or as root")
            dentry = schema.decode_dentry(raw)
            name = key[len(schema.dentry_prefix(dir_id)):].decode("utf-8", "surrogateescape")
            uid = dentry.uid
            if dentry.type != DIRECTORY:
                inode_raw = await tr.get(schema.inode_key(dentry.inode), snapshot=True)
                uid = schema.decode_inode(inode_raw).uid if inode_raw else uid
            else:
                pending.append((dentry.inode, dentry.acl, f"{shown}/{name}"))
            require_sticky(user, acl, uid, f"remove {shown}/{name}")
        if len(rows) < TREE_CHECK_PAGE:
            return seen
        begin = rows[-1][0] + b"\x00"


# -- rename ------------------------------------------------------------------------------------------------


async def is_ancestor(tr: Transaction, candidate: int, dir_id: int) -> bool:
    """Whether directory `candidate` is `dir_id` or one of its ancestors, by the parent pointers.

    Snapshot reads plus a read conflict on each ancestor's dentry: a directory's parent only changes by a
    rename, which rewrites its dentry, so a concurrent move that would close a cycle makes one side retry,
    while creates in the ancestors (which rewrite their inode records for mtime) do not. Reaching the GC
    root means `dir_id` lies in a tree handed to GC: it is gone.
    """
    current = dir_id
    for _ in range(ANCESTOR_WALK_MAX):
        if current == candidate:
            return True
        if current == ROOT_INODE:
            return False
        if current == GC_ROOT_INODE:
            raise status_error(StatusCode.NOT_FOUND, f"directory {dir_id} lies in a removed tree")
        inode = await load_dir(tr, current)
        tr.add_read_conflict_key(schema.dentry_key(inode.parent, inode.name))
        current = inode.parent
    raise status_error(StatusCode.INTERNAL, f"no root within {ANCESTOR_WALK_MAX} parents of directory "
                       f"{dir_id}: the tree has a cycle")


async def rename(
    tr: Transaction, src: ParsedPath, dst: ParsedPath, noreplace: bool, user: UserCred, now_ns: int
) -> None:
    """rename(2), atomically; the checks come in Linux's order so errnos match it."""
    require_name(src, "rename")
    require_name(dst, "rename onto")
    src_text, dst_text = display(src), display(dst)
    source = await Walker(tr, src_text, snapshot=False, user=user).resolve(src, follow=False)
    target = await Walker(tr, dst_text, snapshot=False, user=user).resolve(dst, follow=False)
    if src.kind is not Last.NAME or dst.kind is not Last.NAME:
        raise status_error(StatusCode.BUSY, f"cannot rename {src_text} to {dst_text}: '/', '.' and '..' "
                           f"cannot be renamed or replaced")
    if source.dentry is None:
        raise status_error(StatusCode.NOT_FOUND, f"no such file or directory: {src_text}")
    if noreplace and target.dentry is not None:
        raise status_error(StatusCode.EXISTS, f"file exists: {dst_text} (rename without replace)")
    moving_dir = source.dentry.type == DIRECTORY
    if not moving_dir and (src.trailing_slash or dst.trailing_slash):
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {src_text} (a trailing '/' in "
                           f"rename needs a directory)")
    await _check_subtrees(tr, source, target, src_text, dst_text)
    if target.dentry is not None and target.dentry.inode == source.dentry.inode:
        return  # POSIX: two names of one file (or one name twice): do nothing
    walker = Walker(tr, src_text, snapshot=False, user=user)
    moved = await walker.load(source.dentry.inode)
    parents = {source.dir_id: await may_delete(tr, source, moved.uid, user, f"rename {src_text}")}
    replaced = await _check_target(tr, source, target, user, dst_text, parents)
    if moving_dir and source.dir_id != target.dir_id:  # its '..' changes
        require(user, schema.acl_of(moved), W, f"move directory {src_text} to another directory")
    replaces_dir = replaced is not None and replaced.type == DIRECTORY
    if replaces_dir and not await is_empty_dir(tr, target.dentry.inode):
        raise status_error(StatusCode.NOT_EMPTY, f"directory not empty: {dst_text}")
    tr.clear(schema.dentry_key(source.dir_id, source.name))
    moved.ctime_ns = max(moved.ctime_ns, now_ns)
    if moving_dir:
        moved.parent, moved.name = target.dir_id, encode_name(target.name)
    put_dentry(tr, target.dir_id, target.name, source.dentry)
    if replaced is not None:
        release_inode(tr, target.dentry.inode, replaced, now_ns)
    if moving_dir and source.dir_id != target.dir_id:  # the subdirectory counts
        await count_subdir(tr, source.dir_id, parents[source.dir_id], -1)
        await count_subdir(tr, target.dir_id, parents[target.dir_id], +1)
    if replaces_dir:
        await count_subdir(tr, target.dir_id, parents[target.dir_id], -1)
    put_inode(tr, source.dentry.inode, moved)
    await _touch(tr, parents, now_ns)


async def _check_subtrees(tr: Transaction, source: Entry, target: Entry, src: str, dst: str) -> None:
    """Linux's two "trap" checks: a directory cannot move into itself (EINVAL), and the target cannot be an
    ancestor of the source, which it contains (ENOTEMPTY)."""
    if source.dentry.type == DIRECTORY and source.dir_id != target.dir_id:
        if await is_ancestor(tr, source.dentry.inode, target.dir_id):
            raise status_error(StatusCode.INVALID_PATH, f"cannot move directory {src} into its own "
                               f"subtree ({dst})")
    if target.dentry is None or target.dentry.type != DIRECTORY:
        return
    if source.rooted:
        contains = target.dentry.inode in source.ids
    else:  # a walk from an inode does not know all the ancestors
        contains = await is_ancestor(tr, target.dentry.inode, source.dir_id)
    if contains:
        raise status_error(StatusCode.NOT_EMPTY, f"directory not empty: {dst} (it contains {src})")


async def _check_target(
    tr: Transaction, source: Entry, target: Entry, user: UserCred, dst: str, parents: dict[int, Inode]
) -> Inode | None:
    """may_delete of a replaced target (then its type), or may_create in the target directory."""
    if target.dentry is None:
        if target.dir_id not in parents:
            parents[target.dir_id] = await load_dir(tr, target.dir_id)
        require(user, schema.acl_of(parents[target.dir_id]), W | X, f"rename to {dst}")
        return None
    replaced = await Walker(tr, dst, snapshot=False).load(target.dentry.inode)
    parent = parents.get(target.dir_id)
    if parent is None:
        parent = parents[target.dir_id] = await load_dir(tr, target.dir_id)
    acl = schema.acl_of(parent)
    require(user, acl, W | X, f"rename to {dst}")
    require_sticky(user, acl, replaced.uid, f"replace {dst}")
    if source.dentry.type == DIRECTORY and target.dentry.type != DIRECTORY:
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {dst} (a directory can only "
                           f"replace a directory)")
    if source.dentry.type != DIRECTORY and target.dentry.type == DIRECTORY:
        raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {dst} (a file cannot replace "
                           f"a directory)")
    return replaced
