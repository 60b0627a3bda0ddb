"""Operations on attributes and listings: stat, readdir, close (length and write session), truncate.

Each function is the body of one KV transaction (see ops_create). Read-only operations use snapshot reads:
they commit nothing, so there is nothing to conflict with.
"""

from __future__ import annotations

from threefs.common import limits
from threefs.common.ids import CHUNK_INDEX_MAX
from threefs.common.status import StatusCode, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.ops_create import truncate_inode
from threefs.meta.ops_resolve import Entry, Walker, put_inode
from threefs.meta.paths import ParsedPath, decode_name, encode_name
from threefs.meta.schema import DIRECTORY, FILE, Inode, TruncateJob
from threefs.rpc.schemas.meta import DirEntry, InodeAttr

SESSION_ID_CHARS_MAX = 64


async def resolve_existing(walker: Walker, parsed: ParsedPath, follow: bool) -> tuple[Entry, Inode]:
    """The inode a path names; ENOENT if missing, ENOTDIR if a trailing slash names a non-directory."""
    # A trailing slash makes Linux follow a final symlink even for lstat.
    entry = await walker.resolve(parsed, follow=follow or parsed.trailing_slash)
    if entry.dentry is None:
        raise walker.not_found(entry.display)
    if parsed.trailing_slash and entry.dentry.type != DIRECTORY:
        raise walker.not_a_directory(entry.display)
    return entry, await walker.load(entry.dentry.inode)


async def stat(tr: Transaction, parsed: ParsedPath, follow: bool) -> InodeAttr:
    entry, inode = await resolve_existing(Walker(tr, parsed.text, snapshot=True), parsed, follow)
    return schema.to_attr(entry.dentry.inode, inode)


async def readdir(
    tr: Transaction, parsed: ParsedPath, start_after: str, limit: int
) -> tuple[list[DirEntry], bool]:
    """One page of a directory, in name (byte) order, after `start_after`. Never reads more than limit + 1
    entries: the extra one only tells whether there are more."""
    if limit < 1:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"readdir limit must be >= 1, not {limit}")
    if "\x00" in start_after:
        raise status_error(StatusCode.INVALID_ARGUMENT, "readdir start_after contains a NUL byte")
    limit = min(limit, limits.READDIR_PAGE_MAX)
    entry, inode = await resolve_existing(Walker(tr, parsed.text, snapshot=True), parsed, True)
    if inode.type != DIRECTORY:
        raise status_error(StatusCode.NOT_DIRECTORY, f"not a directory: {parsed.text} (cannot list it)")
    prefix, end = schema.dentry_range(entry.dentry.inode)
    # Names hold no NUL, so name + b"\0" is the first key after `start_after`.
    begin = prefix + encode_name(start_after) + b"\x00" if start_after else prefix
    rows = await tr.get_range(begin, end, limit=limit + 1, snapshot=True)
    entries = []
    for key, raw in rows[:limit]:
        dentry = schema.decode_dentry(raw)
        entries.append(DirEntry(name=decode_name(key[len(prefix):]), inode=dentry.inode, type=dentry.type))
    return entries, len(rows) > limit


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


async def close(
    tr: Transaction, inode_id: int, session: str, length_hint: int, client_id: str, now_ns: int
) -> InodeAttr:
    """End a write session and publish the length the client wrote up to.

    A missing session is not an error: a close retried after a lost reply must succeed again.
    """
    if length_hint < -1:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"length_hint {length_hint} must be >= -1")
    if len(session) > SESSION_ID_CHARS_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"session id is over {SESSION_ID_CHARS_MAX} chars")
    raw = await tr.get(schema.inode_key(inode_id))
    if raw is None:
        raise status_error(StatusCode.NOT_FOUND, f"inode {inode_id} does not exist (removed and collected)")
    inode = schema.decode_inode(raw)
    if session:
        await _end_session(tr, inode_id, session, client_id)
    if length_hint >= 0 and inode.type == FILE:
        check_length(length_hint, inode_id, inode, "length hint")
        inode.length = max(inode.length, length_hint)
        inode.mtime_ns = max(inode.mtime_ns, now_ns)
        inode.ctime_ns = max(inode.ctime_ns, now_ns)
        put_inode(tr, inode_id, inode)
    return schema.to_attr(inode_id, inode)


async def _end_session(tr: Transaction, inode_id: int, session: str, client_id: str) -> None:
    key = schema.session_key(inode_id, session)
    raw = await tr.get(key)
    if raw is None:
        return
    owner = schema.decode_session(raw).client_id
    if client_id and owner and owner != client_id:
        raise status_error(
            StatusCode.BAD_FILE_HANDLE,
            f"write session {session} of inode {inode_id} belongs to client {owner!r}, not {client_id!r}",
        )
    tr.clear(key)


async def truncate(
    tr: Transaction, parsed: ParsedPath, length: int, now_ns: int
) -> tuple[InodeAttr, TruncateJob | None]:
    """truncate(2): set the length; a shrink returns the storage job that removes the data past it."""
    if length < 0:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"truncate {parsed.text}: negative length {length}")
    entry, inode = await resolve_existing(Walker(tr, parsed.text, snapshot=False), parsed, True)
    if inode.type == DIRECTORY:
        raise status_error(StatusCode.IS_DIRECTORY, f"is a directory: {parsed.text} (cannot truncate it)")
    if inode.type != FILE:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{parsed.text} is not a regular file")
    inode_id = entry.dentry.inode
    check_length(length, inode_id, inode, "length")
    job = truncate_inode(tr, inode_id, inode, length, now_ns)
    return schema.to_attr(inode_id, inode), job
