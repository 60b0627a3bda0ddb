"""Operations that remove names: unlink, rmdir, rename; and the GC queue of files left without names.

Each function is the body of one KV transaction (see ops_create). A file whose last name goes away keeps its
inode record (nlink 0) and gets a GCQU entry; the service removes its chunks on storage and then calls
`gc_done`, which deletes the entry and the inode together. Directories and symlinks own no chunks, so their
records go at once.
"""

from __future__ import annotations

from threefs.common import limits
from threefs.common.ids import ROOT_INODE
from threefs.common.status import StatusCode, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.ops_resolve import Entry, Walker, is_empty_dir, load_dir, put_dentry, put_inode, touch_dir
from threefs.meta.paths import Last, ParsedPath, encode_name
from threefs.meta.schema import DIRECTORY, FILE, GcEntry, Inode

# Renames can stack subtrees deeper than any path may name (PATH_DEPTH_MAX), so the walk up the parent
# pointers gets its own, larger bound; reaching it means a cycle, i.e. a broken invariant.
ANCESTOR_WALK_MAX = limits.PATH_BYTES_MAX
GC_SCAN_PAGE = 256
GC_SCAN_ENTRIES_MAX = 4096  # entries one gc_pending call may look at (skipped ones included)
GC_PENDING_MAX = 1024


def release_inode(tr: Transaction, inode_id: int, inode: Inode, now_ns: int) -> None:
    """One name of `inode` is gone: drop a link; a file left without names is queued for GC."""
    if inode.type == DIRECTORY:  # only ever removed empty
        tr.clear(schema.inode_key(inode_id))
        return
    inode.nlink -= 1
    inode.ctime_ns = max(inode.ctime_ns, now_ns)
    assert inode.nlink >= 0, (inode_id, inode.nlink)
    if inode.nlink > 0:
        put_inode(tr, inode_id, inode)
    elif inode.type == FILE:
        put_inode(tr, inode_id, inode)  # kept until GC has removed its chunks
        entry = GcEntry(inode=inode_id, layout=inode.layout, length=inode.length, queued_ns=now_ns)
        tr.set(schema.gc_key(inode_id), schema.encode(entry))
    else:
        tr.clear(schema.inode_key(inode_id))


async def _touch(tr: Transaction, dir_ids: set[int], now_ns: int) -> None:
    for dir_id in sorted(dir_ids):
        touch_dir(tr, dir_id, await load_dir(tr, dir_id), now_ns)


async def unlink(tr: Transaction, parsed: ParsedPath, now_ns: int) -> None:
    walker = Walker(tr, parsed.text, snapshot=False)
    entry = await walker.resolve(parsed, follow=False)
    if parsed.kind is not Last.NAME or (entry.dentry is not None and entry.dentry.type == DIRECTORY):
        raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {parsed.text} (use rmdir)")
    if entry.dentry is None:
        raise walker.not_found(entry.display)
    if parsed.trailing_slash:
        raise walker.not_a_directory(entry.display)
    inode_id = entry.dentry.inode
    inode = await walker.load(inode_id)
    tr.clear(schema.dentry_key(entry.dir_id, entry.name))
    release_inode(tr, inode_id, inode, now_ns)
    await _touch(tr, {entry.dir_id}, now_ns)


async def rmdir(tr: Transaction, parsed: ParsedPath, now_ns: int) -> None:
    walker = Walker(tr, parsed.text, snapshot=False)
    entry = await walker.resolve(parsed, follow=False)
    if parsed.kind is Last.DOT:
        raise status_error(StatusCode.INVALID_PATH, f"cannot remove {parsed.text}: it ends in '.'")
    if parsed.kind is Last.DOTDOT:
        raise status_error(StatusCode.NOT_EMPTY, f"directory not empty: {parsed.text} (ends in '..')")
    if parsed.kind is Last.ROOT:
        raise status_error(StatusCode.BUSY, "cannot remove the root directory")
    if entry.dentry is None:
        raise walker.not_found(entry.display)
    if entry.dentry.type != DIRECTORY:
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {parsed.text} (use unlink)")
    if not await is_empty_dir(tr, entry.dentry.inode):
        raise status_error(StatusCode.NOT_EMPTY, f"directory not empty: {parsed.text}")
    tr.clear(schema.dentry_key(entry.dir_id, entry.name))
    tr.clear(schema.inode_key(entry.dentry.inode))
    await _touch(tr, {entry.dir_id}, now_ns)


async def is_ancestor(tr: Transaction, candidate: int, dir_id: int) -> bool:
    """Whether directory `candidate` is `dir_id` or one of its ancestors, by the parent pointers.

    Snapshot reads plus a read conflict on each ancestor's dentry: a directory's parent only changes by a
    rename, which rewrites its dentry, so a concurrent move that would close a cycle makes one side retry,
    while creates in the ancestors (which rewrite their inode records for mtime) do not.
    """
    current = dir_id
    for _ in range(ANCESTOR_WALK_MAX):
        if current == candidate:
            return True
        if current == ROOT_INODE:
            return False
        inode = await load_dir(tr, current)
        tr.add_read_conflict_key(schema.dentry_key(inode.parent, inode.name))
        current = inode.parent
    raise status_error(StatusCode.INTERNAL, f"no root within {ANCESTOR_WALK_MAX} parents of directory "
                       f"{dir_id}: the tree has a cycle")


async def rename(tr: Transaction, src: ParsedPath, dst: ParsedPath, noreplace: bool, now_ns: int) -> None:
    """rename(2), atomically; the checks come in Linux's order so errnos match it."""
    source = await Walker(tr, src.text, snapshot=False).resolve(src, follow=False)
    target = await Walker(tr, dst.text, snapshot=False).resolve(dst, follow=False)
    if src.kind is not Last.NAME or dst.kind is not Last.NAME:
        raise status_error(StatusCode.BUSY, f"cannot rename {src.text} to {dst.text}: '/', '.' and '..' "
                           f"cannot be renamed or replaced")
    if source.dentry is None:
        raise status_error(StatusCode.NOT_FOUND, f"no such file or directory: {src.text}")
    if noreplace and target.dentry is not None:
        raise status_error(StatusCode.EXISTS, f"file exists: {dst.text} (rename without replace)")
    moving_dir = source.dentry.type == DIRECTORY
    if not moving_dir and (src.trailing_slash or dst.trailing_slash):
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {src.text} (a trailing '/' in "
                           f"rename needs a directory)")
    await _check_subtrees(tr, source, target, src, dst)
    if target.dentry is not None and target.dentry.inode == source.dentry.inode:
        return  # POSIX: two names of one file (or one name twice): do nothing
    replaced = await _check_replace(tr, source, target, dst) if target.dentry is not None else None
    moved = await Walker(tr, src.text, snapshot=False).load(source.dentry.inode)
    tr.clear(schema.dentry_key(source.dir_id, source.name))
    put_dentry(tr, target.dir_id, target.name, source.dentry)
    if replaced is not None:
        release_inode(tr, target.dentry.inode, replaced, now_ns)
    moved.ctime_ns = max(moved.ctime_ns, now_ns)
    if moving_dir:
        moved.parent, moved.name = target.dir_id, encode_name(target.name)
    put_inode(tr, source.dentry.inode, moved)
    await _touch(tr, {source.dir_id, target.dir_id}, now_ns)


async def _check_subtrees(tr: Transaction, source: Entry, target: Entry, src: ParsedPath, dst: ParsedPath):
    """Linux's two "trap" checks: a directory cannot move into itself (EINVAL), and the target cannot be an
    ancestor of the source, which it contains (ENOTEMPTY)."""
    if source.dentry.type == DIRECTORY and source.dir_id != target.dir_id:
        if await is_ancestor(tr, source.dentry.inode, target.dir_id):
            raise status_error(StatusCode.INVALID_PATH, f"cannot move directory {src.text} into its own "
                               f"subtree ({dst.text})")
    if target.dentry is not None and target.dentry.inode in source.ids:
        raise status_error(StatusCode.NOT_EMPTY, f"directory not empty: {dst.text} (it contains {src.text})")


async def _check_replace(tr: Transaction, source: Entry, target: Entry, dst: ParsedPath) -> Inode:
    """Whether the source may replace the existing target; returns the target's inode."""
    if source.dentry.type == DIRECTORY and target.dentry.type != DIRECTORY:
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {dst.text} (a directory can only "
                           f"replace a directory)")
    if source.dentry.type != DIRECTORY and target.dentry.type == DIRECTORY:
        raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {dst.text} (a file cannot replace "
                           f"a directory)")
    if target.dentry.type == DIRECTORY and not await is_empty_dir(tr, target.dentry.inode):
        raise status_error(StatusCode.NOT_EMPTY, f"directory not empty: {dst.text}")
    return await Walker(tr, dst.text, snapshot=False).load(target.dentry.inode)


async def gc_pending(tr: Transaction, limit: int, queued_before_ns: int | None) -> list[GcEntry]:
    """Queued files, lowest inode first, whose chunks may be removed now: none has a write session left
    (a writer of an unlinked file may still be adding chunks). Looks at GC_SCAN_ENTRIES_MAX entries at
    most."""
    if not 1 <= limit <= GC_PENDING_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"gc_pending limit {limit} is not in [1, "
                           f"{GC_PENDING_MAX}]")
    begin, end = schema.gc_range()
    ready: list[GcEntry] = []
    for _ in range(GC_SCAN_ENTRIES_MAX // GC_SCAN_PAGE):
        rows = await tr.get_range(begin, end, limit=GC_SCAN_PAGE, snapshot=True)
        for _key, raw in rows:
            entry = schema.decode_gc(raw)
            if queued_before_ns is not None and entry.queued_ns > queued_before_ns:
                continue
            session_begin, session_end = schema.session_range(entry.inode)
            if await tr.get_range(session_begin, session_end, limit=1, snapshot=True):
                continue
            ready.append(entry)
            if len(ready) == limit:
                return ready
        if len(rows) < GC_SCAN_PAGE:
            break
        begin = rows[-1][0] + b"\x00"
    return ready


async def gc_done(tr: Transaction, inode_id: int) -> bool:
    """Drop a collected file: its GC entry, inode record and any stale sessions, together. Idempotent;
    returns whether there was an entry."""
    if await tr.get(schema.gc_key(inode_id)) is None:
        return False
    raw = await tr.get(schema.inode_key(inode_id))
    if raw is not None and schema.decode_inode(raw).nlink != 0:
        raise status_error(StatusCode.INTERNAL, f"inode {inode_id} is queued for GC but has names again")
    tr.clear(schema.gc_key(inode_id))
    tr.clear(schema.inode_key(inode_id))
    tr.clear_range(*schema.session_range(inode_id))
    return True
