"""Operations on attributes and listings: stat, batch stat, readdir, readlink, setattr, file length (sync,
close, truncate).

Each function is the body of one KV transaction (see ops_create). Read-only operations use snapshot reads:
they commit nothing, so there is nothing to conflict with.

File length (docs/meta.md). The length in the inode is lazy: writers raise it with hints, and close/fsync
set it from storage's last chunks. Every truncate bumps the file's `truncate_ver`; a hint is only taken if
it refers to the current version, so a hint from before a truncate cannot bring truncated data back, and an
exact length measured on storage is only stored if no truncate happened while it was being measured.
"""

from __future__ import annotations

import stat as st
from collections.abc import Callable
from typing import NamedTuple

from threefs.common import limits
from threefs.common.ids import CHUNK_INDEX_MAX, ROOT_INODE
from threefs.common.layout import Layout
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.ops_create import Replan, derive_layout, set_length
from threefs.meta.ops_resolve import Entry, Walker, put_inode
from threefs.meta.paths import ParsedPath, decode_name, display, encode_name
from threefs.meta.schema import DIRECTORY, FILE, SYMLINK, Inode
from threefs.meta.users import R, W, in_group, privileged, require, require_owner
from threefs.rpc.schemas.meta import UTIME_NOW, DirEntry, InodeAttr, UserCred

SESSION_ID_CHARS_MAX = 64


class TruncatePlan(NamedTuple):
    """What a truncate will act on, read before the service removes chunks on storage."""

    inode: int
    layout: Layout
    length: int
    truncate_ver: int
    has_sessions: bool  # writers may have data past the recorded length

    def needs_job(self, new_length: int) -> bool:
        """Whether chunks past `new_length` may exist: the file shrinks, or a writer's unreported data
        may lie beyond the recorded length."""
        return new_length < self.length or self.has_sessions

    @property
    def key(self) -> tuple[int, int]:
        return self.inode, self.truncate_ver


class Changes(NamedTuple):
    """setattr's fields; None leaves one alone. The layout fields set a directory's default layout for
    files created in it later (a file's own layout is fixed at its creation)."""

    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    chunk_size: int | None = None
    stripe: int | None = None
    table_id: int | None = None

    @property
    def layout(self) -> bool:
        return any(v is not None for v in (self.chunk_size, self.stripe, self.table_id))


async def resolve_existing(walker: Walker, parsed: ParsedPath, follow: bool) -> tuple[Entry, Inode]:
    """The inode a path names; ENOENT if missing, ENOTDIR if a trailing slash names a non-directory."""
    # A trailing slash makes Linux follow a final symlink even for lstat.
    entry = await walker.resolve(parsed, follow=follow or parsed.trailing_slash)
    if entry.dentry is None:
        raise walker.not_found(entry.display)
    if parsed.trailing_slash and entry.dentry.type != DIRECTORY:
        raise walker.not_a_directory(entry.display)
    return entry, await walker.load(entry.dentry.inode)


async def stat(tr: Transaction, parsed: ParsedPath, follow: bool, user: UserCred,
               missing_ok: bool = False) -> InodeAttr | None:
    """`missing_ok`: None when the last name does not exist (no error raised: the FUSE daemon's lookup of
    a new name before it creates it); a missing directory on the way is NOT_FOUND all the same."""
    walker = Walker(tr, display(parsed), snapshot=True, user=user)
    if missing_ok and not parsed.trailing_slash:
        entry = await walker.resolve(parsed, follow=follow)
        if entry.dentry is None:
            return None
        return schema.to_attr(entry.dentry.inode, await walker.load(entry.dentry.inode))
    entry, inode = await resolve_existing(walker, parsed, follow)
    return schema.to_attr(entry.dentry.inode, inode)


async def batch_stat(
    tr: Transaction, items: list[ParsedPath | ThreeFSError], follow: bool, user: UserCred
) -> list[InodeAttr | ThreeFSError]:
    """stat of many paths / inodes in one snapshot; each item gets its attributes or its error."""
    if len(items) > limits.BATCH_STAT_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"batch stat of {len(items)} items exceeds "
                           f"{limits.BATCH_STAT_MAX}")
    results: list[InodeAttr | ThreeFSError] = []
    for item in items:
        if isinstance(item, ThreeFSError):
            results.append(item)
            continue
        try:
            results.append(await stat(tr, item, follow, user))
        except ThreeFSError as exc:
            results.append(exc)
    return results


async def readdir(
    tr: Transaction, parsed: ParsedPath, start_after: str, limit: int, user: UserCred
) -> tuple[list[DirEntry], bool]:
    """One page of a directory, in name (byte) order, after `start_after`. Never reads more than limit + 1
    entries: the extra one only tells whether there are more."""
    if limit < 1:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"readdir limit must be >= 1, not {limit}")
    if "\x00" in start_after:
        raise status_error(StatusCode.INVALID_ARGUMENT, "readdir start_after contains a NUL byte")
    limit = min(limit, limits.READDIR_PAGE_MAX)
    walker = Walker(tr, display(parsed), snapshot=True, user=user)
    entry, inode = await resolve_existing(walker, parsed, True)
    if inode.type != DIRECTORY:
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {walker.path} (cannot list it)")
    require(user, schema.acl_of(inode), R, f"list {walker.path}")
    prefix, end = schema.dentry_range(entry.dentry.inode)
    # Names hold no NUL, so name + b"\0" is the first key after `start_after`.
    begin = prefix + encode_name(start_after) + b"\x00" if start_after else prefix
    rows = await tr.get_range(begin, end, limit=limit + 1, snapshot=True)
    entries = []
    for key, raw in rows[:limit]:
        dentry = schema.decode_dentry(raw)
        entries.append(DirEntry(name=decode_name(key[len(prefix):]), inode=dentry.inode, type=dentry.type))
    return entries, len(rows) > limit


async def readlink(tr: Transaction, parsed: ParsedPath, user: UserCred) -> str:
    walker = Walker(tr, display(parsed), snapshot=True, user=user)
    _, inode = await resolve_existing(walker, parsed, False)
    if inode.type != SYMLINK:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{walker.path} is not a symbolic link")
    return inode.symlink_target


# -- setattr -----------------------------------------------------------------------------------------------


async def setattr(
    tr: Transaction, parsed: ParsedPath, follow: bool, changes: Changes, user: UserCred, now_ns: int,
    tables: Callable[[int], tuple[int, int, int]] | None = None,
) -> InodeAttr:
    """chmod / chown / utimens with Linux's permission rules, and a directory's default layout (checked
    against `tables`: table id -> (id, version, chains)); ctime moves on any change."""
    walker = Walker(tr, display(parsed), snapshot=False, user=user)
    entry, inode = await resolve_existing(walker, parsed, follow)
    inode_id, what = entry.dentry.inode, walker.path
    if changes.mode is not None:
        _chmod(inode, changes.mode, user, what)
    if changes.uid is not None or changes.gid is not None:
        _chown(inode, changes.uid, changes.gid, user, what)
    if changes.atime_ns is not None or changes.mtime_ns is not None:
        _utimes(inode, changes.atime_ns, changes.mtime_ns, user, now_ns, what)
    if changes.layout:
        _set_default_layout(inode, changes, user, tables, what)
    inode.ctime_ns = max(inode.ctime_ns, now_ns)
    put_inode(tr, inode_id, inode)
    if inode.type == DIRECTORY and inode_id != ROOT_INODE:  # the acl copy, and the concurrency rule
        tr.set(schema.dentry_key(inode.parent, inode.name), schema.encode(schema.dir_dentry(inode_id, inode)))
    return schema.to_attr(inode_id, inode)


def _chmod(inode: Inode, mode: int, user: UserCred, what: str) -> None:
    require_owner(user, schema.acl_of(inode), f"chmod {what}")
    mode &= 0o7777
    if not privileged(user) and not in_group(user, inode.gid):  # Linux drops setgid silently here
        mode &= ~st.S_ISGID
    inode.mode = mode


def _chown(inode: Inode, uid: int | None, gid: int | None, user: UserCred, what: str) -> None:
    """Only root gives a file away; the owner may move it into one of their own groups."""
    for value in (uid, gid):
        if value is not None and not 0 <= value < (1 << 32) - 1:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"chown {what}: id {value} is out of range")
    if not privileged(user):
        if uid is not None and uid != inode.uid or user.uid != inode.uid:
            raise status_error(StatusCode.NOT_PERMITTED, f"operation not permitted: chown {what} (only root "
                               f"gives files away; uid {user.uid} owns it: {user.uid == inode.uid})")
        if gid is not None and gid != inode.gid and not in_group(user, gid):
            raise status_error(StatusCode.NOT_PERMITTED, f"operation not permitted: chgrp {what} to {gid} "
                               f"(uid {user.uid} is not in that group)")
    if inode.type == FILE:  # a changed owner must not inherit set-id powers
        inode.mode &= ~st.S_ISUID
        if inode.mode & st.S_IXGRP:
            inode.mode &= ~st.S_ISGID
    inode.uid = inode.uid if uid is None else uid
    inode.gid = inode.gid if gid is None else gid


def _utimes(inode: Inode, atime_ns: int | None, mtime_ns: int | None, user: UserCred, now_ns: int,
            what: str) -> None:
    """Explicit times need ownership (EPERM); "now" needs ownership or write permission (EACCES)."""
    explicit = [t for t in (atime_ns, mtime_ns) if t is not None and t != UTIME_NOW]
    if explicit:
        require_owner(user, schema.acl_of(inode), f"set times of {what}")
    elif user.uid != inode.uid:
        require(user, schema.acl_of(inode), W, f"touch {what}")
    if any(t < 0 for t in explicit):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"set times of {what}: negative time")
    if atime_ns is not None:
        inode.atime_ns = now_ns if atime_ns == UTIME_NOW else atime_ns
    if mtime_ns is not None:
        inode.mtime_ns = now_ns if mtime_ns == UTIME_NOW else mtime_ns


def _set_default_layout(inode: Inode, changes: Changes, user: UserCred,
                        tables: Callable[[int], tuple[int, int, int]] | None, what: str) -> None:
    if inode.type != DIRECTORY:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{what}: a file's layout is fixed when it is "
                           "created (set its directory's default layout before creating it)")
    require_owner(user, schema.acl_of(inode), f"set the layout of {what}")
    assert inode.layout is not None
    base = inode.layout
    table_id = base.table_id if changes.table_id is None else changes.table_id
    table_version, n_chains = (tables(table_id)[1:] if tables is not None else (base.table_version, 0))
    layout = derive_layout(Layout(table_id, table_version, base.chunk_size, base.stripe),
                           changes.chunk_size or 0, changes.stripe or 0, n_chains)
    inode.layout = layout


# -- file length -------------------------------------------------------------------------------------------


def check_length(length: int, inode_id: int, inode: Inode, what: str) -> None:
    """A file cannot be longer than its layout can address (chunk index is a u32)."""
    assert inode.layout is not None
    length_max = inode.layout.chunk_size * (CHUNK_INDEX_MAX + 1)
    if length > length_max:
        raise status_error(
            StatusCode.FILE_TOO_LARGE,
            f"{what} {length} of inode {inode_id} exceeds {length_max}, the most its layout addresses "
            f"(chunk size {inode.layout.chunk_size})",
        )


async def load_file(tr: Transaction, inode_id: int, snapshot: bool = False) -> Inode:
    raw = await tr.get(schema.inode_key(inode_id), snapshot=snapshot)
    if raw is None:
        raise status_error(StatusCode.NOT_FOUND, f"inode {inode_id} does not exist (removed and collected)")
    return schema.decode_inode(raw)


class LengthUpdate(NamedTuple):
    """What a sync or close brings: a writer's hint, and/or an exact end measured on storage."""

    hint: int = -1  # end of the highest byte the writer wrote; -1 = nothing written
    hint_ver: int = -1  # the truncate version the hint refers to; -1 = its session's
    exact_end: int | None = None  # measured on storage while the file had truncate version `exact_ver`
    exact_ver: int = -1


async def update_length(
    tr: Transaction, inode_id: int, session: str, client_id: str, update: LengthUpdate, now_ns: int,
    end_session: bool,
) -> InodeAttr:
    """sync / fsync / close: raise the length (never lower it: only truncate does), move mtime/ctime if
    the writer wrote, and with `end_session` drop the write session. A missing session is no error: a
    close retried after a lost reply must succeed again."""
    if update.hint < -1:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"length_hint {update.hint} must be >= -1")
    if len(session) > SESSION_ID_CHARS_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"session id is over {SESSION_ID_CHARS_MAX} chars")
    inode = await load_file(tr, inode_id)
    record = await _session(tr, inode_id, session, client_id) if session else None
    if inode.type != FILE:
        return schema.to_attr(inode_id, inode)
    length = _new_length(inode, record, update, inode_id)
    if length != inode.length or update.hint >= 0:
        inode.length = length
        if update.hint >= 0:
            inode.mtime_ns = max(inode.mtime_ns, now_ns)
            inode.ctime_ns = max(inode.ctime_ns, now_ns)
        put_inode(tr, inode_id, inode)
    if record is not None and end_session:
        tr.clear(schema.session_key(inode_id, session))
    return schema.to_attr(inode_id, inode)


async def end_sessions(tr: Transaction, items: list[tuple[int, str]], client_id: str) -> int:
    """End write sessions nothing was written through (close with no length hint): only the session
    records go; the inodes are neither read nor changed. A session of another client, or one already
    gone, is skipped. Returns the number ended."""
    ended = 0
    for inode_id, session in items:
        if len(session) > SESSION_ID_CHARS_MAX or not session:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"session id {session[:80]!r} must be 1 to "
                               f"{SESSION_ID_CHARS_MAX} chars")
        key = schema.session_key(inode_id, session)
        raw = await tr.get(key)
        if raw is None:
            continue
        record = schema.decode_session(raw)
        if client_id and record.client_id and record.client_id != client_id:
            continue
        tr.clear(key)
        ended += 1
    return ended


def _new_length(inode: Inode, record: schema.WriteSession | None, update: LengthUpdate, inode_id: int) -> int:
    length = inode.length
    if update.exact_end is not None:
        if update.exact_ver != inode.truncate_ver:
            raise Replan(f"inode {inode_id} was truncated while its length was measured")
        length = max(length, update.exact_end)
    if update.hint >= 0:
        check_length(update.hint, inode_id, inode, "length hint")
        hint_ver = update.hint_ver if update.hint_ver >= 0 else (record.truncate_ver if record else -1)
        if hint_ver == inode.truncate_ver:
            length = max(length, update.hint)
    return length


async def _session(tr: Transaction, inode_id: int, session: str,
                   client_id: str) -> schema.WriteSession | None:
    raw = await tr.get(schema.session_key(inode_id, session))
    if raw is None:
        return None
    record = schema.decode_session(raw)
    if client_id and record.client_id and record.client_id != client_id:
        raise status_error(
            StatusCode.BAD_FILE_HANDLE,
            f"write session {session} of inode {inode_id} belongs to client {record.client_id!r}, not "
            f"{client_id!r}",
        )
    return record


async def truncate_plan(tr: Transaction, parsed: ParsedPath, length: int, user: UserCred) -> TruncatePlan:
    """Check a truncate and report what it acts on (snapshot reads; the commit re-checks)."""
    walker = Walker(tr, display(parsed), snapshot=True, user=user)
    inode_id, inode = await _truncatable(walker, parsed, length)
    begin, end = schema.session_range(inode_id)
    has_sessions = bool(await tr.get_range(begin, end, limit=1, snapshot=True))
    assert inode.layout is not None
    return TruncatePlan(inode_id, inode.layout, inode.length, inode.truncate_ver, has_sessions)


async def truncate_commit(
    tr: Transaction, parsed: ParsedPath, length: int, user: UserCred, now_ns: int,
    plan_key: tuple[int, int] | None,
) -> InodeAttr:
    """truncate(2)'s metadata, after the service removed the chunks past `length` for `plan_key`
    (None: no storage behind this store). Raises Replan if the file changed since the plan."""
    walker = Walker(tr, display(parsed), snapshot=False, user=user)
    inode_id, inode = await _truncatable(walker, parsed, length)
    if plan_key is not None and plan_key != (inode_id, inode.truncate_ver):
        raise Replan(walker.path)
    # Linux moves mtime/ctime on every truncate, also to the same length (POSIX asks only on a change)
    set_length(tr, inode_id, inode, length, now_ns, touch=True)
    return schema.to_attr(inode_id, inode)


async def _truncatable(walker: Walker, parsed: ParsedPath, length: int) -> tuple[int, Inode]:
    if length < 0:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"truncate {walker.path}: negative length {length}")
    entry, inode = await resolve_existing(walker, parsed, True)
    if inode.type == DIRECTORY:
        raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {walker.path} (cannot truncate it)")
    if inode.type != FILE:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{walker.path} is not a regular file")
    require(walker.user, schema.acl_of(inode), W, f"truncate {walker.path}")
    check_length(length, entry.dentry.inode, inode, "length")
    return entry.dentry.inode, inode
