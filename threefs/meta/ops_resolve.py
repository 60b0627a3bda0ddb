"""Path resolution inside one KV transaction, and the small helpers every operation shares.

The walk reads one dentry per component (a dentry carries the type, so intermediate directories need not be
loaded). '..' pops the stack of directories walked so far, so it is the *physical* parent, as in Linux, and
'..' of the root is the root. Symlinks are followed in the middle of a path always and at its end when asked,
at most SYMLINK_FOLLOW_MAX times per operation.

Reads are conflict-tracked when the walker is built for an operation that writes (`snapshot=False`): a
concurrent rename or rmdir of any directory on the path then makes one of the two transactions retry, so an
entry is never created in a directory that was removed in the meantime.
"""

from __future__ import annotations

from typing import NamedTuple

from threefs.common import limits
from threefs.common.ids import ROOT_INODE
from threefs.common.status import StatusCode, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.paths import Last, ParsedPath, split_components, split_last
from threefs.meta.schema import DIRECTORY, SYMLINK, Dentry, Inode


class Entry(NamedTuple):
    """Where a path leads: the directory chain walked, and the name in the last directory.

    `name` is '' when the path ends at a directory reached without a name ('/', '.', '..'); then `dentry`
    describes that directory itself. `dentry` is None when the name does not exist (yet).
    """

    ids: list[int]  # directory inode ids from the root to the one holding `name`
    shown: list[str]  # their names, for messages
    name: str
    dentry: Dentry | None

    @property
    def dir_id(self) -> int:
        return self.ids[-1]

    @property
    def display(self) -> str:
        return "/" + "/".join([*self.shown, self.name] if self.name else self.shown)


class Walker:
    """Resolves paths in one transaction; counts symlinks followed for the whole operation."""

    def __init__(self, tr: Transaction, path: str, *, snapshot: bool):
        self.tr = tr
        self.path = path  # the caller's path, named in every error
        self.snapshot = snapshot
        self.symlinks_followed = 0

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
        ids, shown = await self.walk_dirs(parsed.parent, [ROOT_INODE], [])
        return await self._last(ids, shown, parsed.last, parsed.kind, follow)

    async def walk_dirs(self, names: tuple[str, ...] | list[str], ids: list[int], shown: list[str]):
        """Walk `names`, each of which must be a directory (or a symlink to one); returns (ids, shown)."""
        ids, shown = list(ids), list(shown)
        for name in names:
            if name == "..":
                if len(ids) > 1:
                    ids.pop()
                    shown.pop()
                continue
            dentry = await self.lookup(ids[-1], name)
            if dentry is None:
                raise self.not_found("/" + "/".join([*shown, name]))
            if dentry.type == SYMLINK:
                ids, shown = await self._follow_dir(dentry.inode, ids, shown)
            elif dentry.type != DIRECTORY:
                raise self.not_a_directory("/" + "/".join([*shown, name]))
            else:
                ids.append(dentry.inode)
                shown.append(name)
        return ids, shown

    async def _last(self, ids: list[int], shown: list[str], last: str, kind: Last, follow: bool) -> Entry:
        if kind is Last.ROOT:
            ids, shown = ids[:1], []
        elif kind is Last.DOTDOT and len(ids) > 1:
            ids, shown = ids[:-1], shown[:-1]
        if kind is not Last.NAME:
            return Entry(ids, shown, "", Dentry(ids[-1], DIRECTORY))
        dentry = await self.lookup(ids[-1], last)
        if dentry is None or dentry.type != SYMLINK or not follow:
            return Entry(ids, shown, last, dentry)
        target = await self._symlink_target(dentry.inode)
        if target.startswith("/"):
            ids, shown = ids[:1], []
        parent, last, kind = split_last(target)
        ids, shown = await self.walk_dirs(parent, ids, shown)
        return await self._last(ids, shown, last, kind, follow)

    async def _follow_dir(self, symlink: int, ids: list[int], shown: list[str]):
        target = await self._symlink_target(symlink)
        if target.startswith("/"):
            ids, shown = [ROOT_INODE], []
        return await self.walk_dirs(split_components(target), ids, shown)

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


def touch_dir(tr: Transaction, dir_id: int, inode: Inode, now_ns: int) -> None:
    """Move a directory's mtime/ctime after an entry was added or removed. Times only move forward, so a
    server with a slow clock cannot rewind them."""
    inode.mtime_ns = max(inode.mtime_ns, now_ns)
    inode.ctime_ns = max(inode.ctime_ns, now_ns)
    tr.set(schema.inode_key(dir_id), schema.encode(inode))


async def is_empty_dir(tr: Transaction, dir_id: int) -> bool:
    """Whether a directory has no entries; conflict-tracked, so a concurrent create makes one side retry."""
    begin, end = schema.dentry_range(dir_id)
    return not await tr.get_range(begin, end, limit=1)


def put_inode(tr: Transaction, inode_id: int, inode: Inode) -> None:
    tr.set(schema.inode_key(inode_id), schema.encode(inode))


def put_dentry(tr: Transaction, dir_id: int, name: str, dentry: Dentry) -> None:
    tr.set(schema.dentry_key(dir_id, name), schema.encode(dentry))
