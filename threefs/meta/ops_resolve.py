"""Path resolution inside one KV transaction, and the small helpers every operation shares.

The walk reads one dentry per component (a dentry carries the type, so intermediate directories need not be
loaded). '..' pops the stack of directories walked so far, so it is the *physical* parent, as in Linux, and
'..' of the root is the root. Symlinks are followed in the middle of a path always and at its end when asked,
at most SYMLINK_FOLLOW_MAX times per operation. A relative path starts at an inode (3FS's PathAt: FUSE calls
name a parent inode and one name), and the empty relative path names that inode itself.

Every directory searched needs search (x) permission for the walker's user; directories' dentries carry
their mode and owner, so this costs no extra reads (root is exempt and reads nothing).

Reads are conflict-tracked when the walker is built for an operation that writes (`snapshot=False`): a
concurrent rename or rmdir of any directory on the path then makes one of the two transactions retry, so an
entry is never created in a directory that was removed in the meantime.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

from threefs.common import limits
from threefs.common.ids import GC_ROOT_INODE, ROOT_INODE
from threefs.common.status import StatusCode, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.paths import Last, ParsedPath, split_components, split_last
from threefs.meta.schema import DIRECTORY, SYMLINK, Dentry, Inode
from threefs.meta.users import ROOT, X, Acl, require
from threefs.rpc.schemas.meta import InodeAttr, UserCred


class Entry(NamedTuple):
    """Where a path leads: the directory chain walked, and the name in the last directory.

    `name` is '' when the path ends at an inode reached without a name ('/', '.', '..', or the start inode
    itself); then `dentry` describes that inode. `dentry` is None when the name does not exist (yet).
    """

    ids: list[int]  # directory inode ids from the start of the walk to the one holding `name`
    shown: list[str]  # their names, for messages
    name: str
    dentry: Dentry | None
    origin: str = ""  # "" when `ids` starts at the root, else "<inode N>" (a walk from a start inode)

    @property
    def dir_id(self) -> int:
        return self.ids[-1]

    @property
    def rooted(self) -> bool:
        """Whether `ids` are all the ancestors of the entry's directory (the walk began at the root)."""
        return not self.origin

    @property
    def display(self) -> str:
        return self.origin + "/" + "/".join([*self.shown, self.name] if self.name else self.shown)


class _Stack:
    """The directories walked so far, with what a search-permission check needs about each."""

    def __init__(self, ids: list[int], acls: list[Acl | None], origin: str):
        self.ids, self.acls, self.shown, self.origin = ids, acls, [], origin

    def push(self, inode_id: int, acl: Acl | None, name: str) -> None:
        self.ids.append(inode_id)
        self.acls.append(acl)
        self.shown.append(name)

    def pop(self) -> None:
        self.ids.pop()
        self.acls.pop()
        self.shown.pop()

    def reset_root(self) -> None:
        self.ids, self.acls, self.shown, self.origin = [ROOT_INODE], [None], [], ""

    def display(self, name: str = "") -> str:
        return self.origin + "/" + "/".join([*self.shown, name] if name else self.shown)

    def entry(self, name: str, dentry: Dentry | None) -> Entry:
        return Entry(list(self.ids), list(self.shown), name, dentry, self.origin)


class Walker:
    """Resolves paths in one transaction for one user; counts symlinks followed for the whole operation."""

    def __init__(self, tr: Transaction, path: str, *, snapshot: bool, user: UserCred = ROOT):
        self.tr = tr
        self.path = path  # the caller's path, named in every error
        self.snapshot = snapshot
        self.user = user
        self.symlinks_followed = 0
        self._start_dir: tuple[int, Inode] | None = None  # the directory a relative walk began at, as read

    async def lookup(self, dir_id: int, name: str) -> Dentry | None:
        raw = await self.tr.get(schema.dentry_key(dir_id, name), snapshot=self.snapshot)
        return None if raw is None else schema.decode_dentry(raw)

    async def load(self, inode_id: int) -> Inode:
        """The inode a dentry points at; its absence means a broken invariant, not a user error."""
        raw = await self.tr.get(schema.inode_key(inode_id), snapshot=self.snapshot)
        if raw is None:
            raise status_error(StatusCode.INTERNAL, f"inode {inode_id} of {self.path} is missing")
        return schema.decode_inode(raw)

    async def resolve(self, parsed: ParsedPath, *, follow: bool) -> Entry:
        """Walk to the last component of `parsed`; follow a final symlink if `follow`."""
        if parsed.relative and parsed.kind is Last.SELF and not parsed.parent:
            return (await self._start(parsed.start))[1]
        stack = await self.start_stack(parsed)
        await self.walk_dirs(parsed.parent, stack)
        return await self._last(stack, parsed.last, parsed.kind, follow)

    async def start_stack(self, parsed: ParsedPath) -> _Stack:
        """Where the walk of `parsed` begins: the root, or the directory inode a relative path starts at."""
        if not parsed.relative:
            return _Stack([ROOT_INODE], [None], "")
        stack, start = await self._start(parsed.start)
        if start.dentry.type != DIRECTORY:
            raise self.not_a_directory(stack.display())
        return stack

    async def _start(self, inode_id: int) -> tuple[_Stack, Entry]:
        """The inode a relative walk starts from, as a stack and as an Entry naming the inode itself.

        A directory's record is read from a snapshot plus a read conflict on its dentry (see the concurrency
        rule in schema.py); a directory handed to GC (nlink 0) no longer takes new names."""
        origin = f"<inode {inode_id}>"
        raw = await self.tr.get(schema.inode_key(inode_id), snapshot=True)
        if raw is None:
            raise status_error(StatusCode.NOT_FOUND, f"no such file or directory: {self.path} (inode "
                               f"{inode_id} does not exist)")
        inode = schema.decode_inode(raw)
        if inode.type == DIRECTORY:
            if inode_id != ROOT_INODE and not self.snapshot:
                self.tr.add_read_conflict_key(schema.dentry_key(inode.parent, inode.name))
            if inode.nlink == 0:
                raise status_error(StatusCode.NOT_FOUND, f"no such file or directory: {self.path} "
                                   f"(directory inode {inode_id} was removed)")
            dentry = schema.dir_dentry(inode_id, inode)
            self._start_dir = (inode_id, inode)
        else:
            if not self.snapshot:
                self.tr.add_read_conflict_key(schema.inode_key(inode_id))
            dentry = Dentry(inode_id, inode.type)
        stack = _Stack([inode_id], [schema.acl_of(inode)], origin)
        return stack, Entry([inode_id], [], "", dentry, origin)

    async def dir_record(self, dir_id: int) -> Inode:
        """load_dir(dir_id) for an entry change: the record this walk read at its start when it began at
        `dir_id` (the same snapshot read: a FUSE call names the directory by inode), handed out once; else
        read now."""
        started = self._start_dir
        if started is not None and started[0] == dir_id:
            self._start_dir = None
            return started[1]
        return await load_dir(self.tr, dir_id)

    async def walk_dirs(self, names: tuple[str, ...] | list[str], stack: _Stack) -> None:
        """Walk `names`, each of which must be a directory (or a symlink to one), pushing onto `stack`."""
        for name in names:
            if name == "..":
                await self._dotdot(stack)
                continue
            await self.check_search(stack)
            dentry = await self.lookup(stack.ids[-1], name)
            if dentry is None:
                raise self.not_found(stack.display(name))
            if dentry.type == SYMLINK:
                await self._follow_dir(dentry.inode, stack)
            elif dentry.type != DIRECTORY:
                raise self.not_a_directory(stack.display(name))
            else:
                stack.push(dentry.inode, dentry.acl, name)

    async def _dotdot(self, stack: _Stack) -> None:
        """'..': the physical parent. Past the start of a relative walk, from the directory's record."""
        if len(stack.ids) > 1:
            stack.pop()
            return
        if stack.ids[0] == ROOT_INODE:
            return  # '..' of the root is the root
        current = await self.load(stack.ids[0])
        if current.parent == GC_ROOT_INODE:
            raise self.not_found(stack.display(".."))
        parent = await self.load(current.parent)
        stack.ids, stack.acls = [current.parent], [schema.acl_of(parent)]
        stack.shown, stack.origin = [], f"<inode {current.parent}>"

    async def check_search(self, stack: _Stack) -> None:
        """EACCES unless the user may search the directory on top of the stack."""
        if self.user.uid == 0 or self.user.kernel_checked:
            return
        acl = stack.acls[-1]
        if acl is None:  # the root: its record, from a snapshot (no blind writes race with this check)
            raw = await self.tr.get(schema.inode_key(stack.ids[-1]), snapshot=True)
            assert raw is not None, stack.ids[-1]
            acl = stack.acls[-1] = schema.acl_of(schema.decode_inode(raw))
        require(self.user, acl, X, f"{self.path} (searching {stack.display()})")

    async def _last(self, stack: _Stack, last: str, kind: Last, follow: bool) -> Entry:
        if kind is Last.ROOT:
            stack.reset_root()
        elif kind is Last.DOTDOT:
            await self._dotdot(stack)
        if kind is not Last.NAME:
            return stack.entry("", Dentry(stack.ids[-1], DIRECTORY, *(stack.acls[-1] or (0, 0, 0))))
        await self.check_search(stack)
        dentry = await self.lookup(stack.ids[-1], last)
        if dentry is None or dentry.type != SYMLINK or not follow:
            return stack.entry(last, dentry)
        target = await self._symlink_target(dentry.inode)
        if target.startswith("/"):
            stack.reset_root()
        parent, last, kind = split_last(target)
        await self.walk_dirs(parent, stack)
        return await self._last(stack, last, kind, follow)

    async def _follow_dir(self, symlink: int, stack: _Stack) -> None:
        target = await self._symlink_target(symlink)
        if target.startswith("/"):
            stack.reset_root()
        await self.walk_dirs(split_components(target), stack)

    async def _symlink_target(self, symlink: int) -> str:
        self.symlinks_followed += 1
        if self.symlinks_followed > limits.SYMLINK_FOLLOW_MAX:
            raise status_error(
                StatusCode.TOO_MANY_SYMLINKS,
                f"too many levels of symbolic links in {self.path} (limit {limits.SYMLINK_FOLLOW_MAX})",
            )
        return (await self.load(symlink)).symlink_target

    def not_found(self, shown: str):
        detail = "" if shown == self.path else f" ({shown} does not exist)"
        return status_error(StatusCode.NOT_FOUND, f"no such file or directory: {self.path}{detail}")

    def not_a_directory(self, shown: str):
        detail = "" if shown == self.path else f" ({shown} is not a directory)"
        return status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {self.path}{detail}")


async def load_dir(tr: Transaction, dir_id: int) -> Inode:
    """A directory's record read for an entry change: a *snapshot* read, on purpose, so that concurrent
    creates in one directory do not conflict with each other (see the concurrency rule in schema.py)."""
    raw = await tr.get(schema.inode_key(dir_id), snapshot=True)
    if raw is None:
        raise status_error(StatusCode.INTERNAL, f"directory inode {dir_id} is missing")
    inode = schema.decode_inode(raw)
    assert inode.type == DIRECTORY, (dir_id, inode.type)
    return inode


async def count_subdir(tr: Transaction, dir_id: int, directory: Inode, delta: int) -> None:
    """A subdirectory was added to (+1) or taken from (-1) `directory`, whose record the caller writes. The
    record is rewritten from a snapshot read by every entry change beside it (the concurrency rule in
    schema.py), which would undo a concurrent count: so the directory's dentry is written too (its bytes
    unchanged), and the entry changes that read it with conflict tracking retry instead. The root has no
    dentry and is not counted (subdirs -1), nor are directories from before the count."""
    if directory.subdirs < 0 or dir_id == ROOT_INODE:
        return
    directory.subdirs = max(0, directory.subdirs + delta)
    key = schema.dentry_key(directory.parent, directory.name)
    raw = await tr.get(key)
    if raw is None:
        raise status_error(StatusCode.INTERNAL, f"directory {dir_id} has no dentry in {directory.parent}")
    tr.set(key, raw)


# per transaction (one attempt): directory inode -> the record touch_dir wrote for it, the last one
_DIRS_WRITTEN: "weakref.WeakKeyDictionary[Transaction, dict[int, bytes]]" = weakref.WeakKeyDictionary()


def touch_dir(tr: Transaction, dir_id: int, inode: Inode, now_ns: int) -> None:
    """Move a directory's mtime/ctime after an entry was added or removed. Times only move forward, so a
    server with a slow clock cannot rewind them. Every other change of the directory's record in the same
    transaction (a subdirectory count) is made before this, which writes the record (dirs_written)."""
    inode.mtime_ns = max(inode.mtime_ns, now_ns)
    inode.ctime_ns = max(inode.ctime_ns, now_ns)
    raw = schema.encode(inode)
    tr.set(schema.inode_key(dir_id), raw)
    written = _DIRS_WRITTEN.get(tr)
    if written is None:
        written = _DIRS_WRITTEN[tr] = {}
    written[dir_id] = raw


def dirs_written(tr: Transaction) -> list[InodeAttr]:
    """The attributes of the directories whose entries this transaction changed, from the very records it
    writes (so, once it commits, as committed: see the concurrency rule in schema.py; a concurrent entry
    change beside it may write the record again later, as any later change may)."""
    return [schema.to_attr(dir_id, schema.decode_inode(raw))
            for dir_id, raw in _DIRS_WRITTEN.get(tr, {}).items()]


async def is_empty_dir(tr: Transaction, dir_id: int) -> bool:
    """Whether a directory has no entries; conflict-tracked, so a concurrent create makes one side retry."""
    begin, end = schema.dentry_range(dir_id)
    return not await tr.get_range(begin, end, limit=1)


def put_inode(tr: Transaction, inode_id: int, inode: Inode) -> None:
    tr.set(schema.inode_key(inode_id), schema.encode(inode))


def drop_inode(tr: Transaction, inode_id: int) -> None:
    """An inode's record goes, and its extended attributes with it."""
    tr.clear(schema.inode_key(inode_id))
    tr.clear_range(*schema.xattr_range(inode_id))


def put_dentry(tr: Transaction, dir_id: int, name: str, dentry: Dentry) -> None:
    tr.set(schema.dentry_key(dir_id, name), schema.encode(dentry))
