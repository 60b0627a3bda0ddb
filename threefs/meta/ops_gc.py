"""Background work on the KV: the GC queue, pruning the write sessions of vanished clients, and pruning
the replies kept for idempotent retries. Each function is the body of one KV transaction (see ops_create).

GC queue (GCQU, oldest first; directories first of all). A FILE entry is a file without names: once no
write session holds it and it has waited the configured delay, the service removes its chunks on storage
and `gc_done` drops the entry and the inode together. A DIRECTORY entry is a tree handed over by a recursive remove: `gc_dir_step`
takes one page of its entries at a time — files and symlinks lose a name (a file's last name queues it as
above), subdirectories become DIRECTORY entries of their own — and drops the directory once it is empty.
So a tree of any size is removed in bounded transactions, and no recursion is needed.
"""

from __future__ import annotations

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.kv import Transaction
from threefs.meta import schema
from threefs.meta.ops_remove import hand_to_gc, release_inode
from threefs.meta.ops_resolve import drop_inode
from threefs.meta.schema import DIRECTORY, ClientRecord, GcEntry

GC_SCAN_PAGE = 256
GC_SCAN_ENTRIES_MAX = 4096  # entries one gc_pending call may look at (skipped ones included)
GC_PENDING_MAX = 1024
GC_DIR_PAGE = 256  # entries of a removed tree one gc_dir_step moves (a transaction's size)
CLIENT_SCAN_MAX = 1024  # client records one stale_clients call looks at
SESSION_SCAN_PAGE = 1024  # write sessions one sessions_of call looks at
IDEM_SCAN_MAX = 4096  # idempotency records one prune_idem call looks at


async def gc_pending(tr: Transaction, limit: int, queued_before_ns: int | None) -> list[GcEntry]:
    """Queued entries GC may work on now, oldest first: directories always; files queued at or before
    `queued_before_ns` (None: any) without a write session left (a writer of an unlinked file may still be
    adding chunks). Stops at the first file queued later; looks at GC_SCAN_ENTRIES_MAX entries at most."""
    if not 1 <= limit <= GC_PENDING_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"gc_pending limit {limit} is not in [1, "
                           f"{GC_PENDING_MAX}]")
    begin, end = schema.gc_range()
    ready: list[GcEntry] = []
    for _ in range(GC_SCAN_ENTRIES_MAX // GC_SCAN_PAGE):
        rows = await tr.get_range(begin, end, limit=GC_SCAN_PAGE, snapshot=True)
        for _key, raw in rows:
            entry = schema.decode_gc(raw)
            young = queued_before_ns is not None and entry.queued_ns > queued_before_ns
            if entry.type != DIRECTORY and young:
                return ready  # the rest is younger still
            if entry.type != DIRECTORY and not await _file_ready(tr, entry):
                continue
            ready.append(entry)
            if len(ready) == limit:
                return ready
        if len(rows) < GC_SCAN_PAGE:
            break
        begin = rows[-1][0] + b"\x00"
    return ready


async def _file_ready(tr: Transaction, entry: GcEntry) -> bool:
    session_begin, session_end = schema.session_range(entry.inode)
    return not await tr.get_range(session_begin, session_end, limit=1, snapshot=True)


async def gc_done(tr: Transaction, entry: GcEntry) -> bool:
    """Drop a collected file: its GC entry, inode record and any stale sessions, together. Idempotent;
    returns whether there was an entry."""
    inode_id = entry.inode
    if await tr.get(schema.gc_key(entry)) is None:
        return False
    raw = await tr.get(schema.inode_key(inode_id))
    if raw is not None and schema.decode_inode(raw).nlink != 0:
        raise status_error(StatusCode.INTERNAL, f"inode {inode_id} is queued for GC but has names again")
    tr.clear(schema.gc_key(entry))
    drop_inode(tr, inode_id)
    tr.clear_range(*schema.session_range(inode_id))
    return True


async def gc_done_many(tr: Transaction, entries: list[GcEntry]) -> tuple[int, list[tuple[GcEntry, str]]]:
    """gc_done for many collected files in one transaction. An entry whose inode has names again (which
    would be a bug) is left queued and reported, without failing the others. Returns (entries dropped,
    [(entry, why) left])."""
    dropped, left = 0, []
    for entry in entries:
        try:
            dropped += await gc_done(tr, entry)
        except ThreeFSError as e:
            if e.code != StatusCode.INTERNAL:
                raise
            left.append((entry, e.message))
    return dropped, left


async def gc_dir_step(tr: Transaction, entry: GcEntry, now_ns: int, page: int = GC_DIR_PAGE) -> bool:
    """Move up to `page` entries out of a removed directory; drop it when empty. Returns True when the
    directory is gone (or was already)."""
    dir_id = entry.inode
    if await tr.get(schema.gc_key(entry)) is None:
        return True
    begin, end = schema.dentry_range(dir_id)
    rows = await tr.get_range(begin, end, limit=page)
    for key, raw in rows:
        dentry = schema.decode_dentry(raw)
        tr.clear(key)
        inode_raw = await tr.get(schema.inode_key(dentry.inode))
        if inode_raw is None:
            raise status_error(StatusCode.INTERNAL, f"inode {dentry.inode} in removed directory {dir_id} "
                               "is missing")
        inode = schema.decode_inode(inode_raw)
        if dentry.type == DIRECTORY:
            hand_to_gc(tr, dentry.inode, inode, now_ns)
        else:
            release_inode(tr, dentry.inode, inode, now_ns)
    if len(rows) == page:
        return False
    tr.clear(schema.gc_key(entry))
    drop_inode(tr, dir_id)
    return True


# -- client sessions ---------------------------------------------------------------------------------------


async def touch_clients(tr: Transaction, seen: dict[str, int]) -> None:
    """Record when this server last heard from each client (never moving a record back in time)."""
    for client_id, last_seen_ns in seen.items():
        key = schema.client_record_key(client_id)
        raw = await tr.get(key, snapshot=True)
        if raw is not None and schema.decode_client(raw).last_seen_ns >= last_seen_ns:
            continue
        tr.set(key, schema.encode(ClientRecord(last_seen_ns)))


async def stale_clients(tr: Transaction, silent_since_ns: int) -> list[str]:
    """Clients not heard from since `silent_since_ns` (at most CLIENT_SCAN_MAX records looked at)."""
    begin, end = schema.client_records_range()
    rows = await tr.get_range(begin, end, limit=CLIENT_SCAN_MAX, snapshot=True)
    return [schema.client_of_record_key(key) for key, raw in rows
            if schema.decode_client(raw).last_seen_ns < silent_since_ns]


async def sessions_of(
    tr: Transaction, clients: set[str], opened_before_ns: int, after: bytes
) -> tuple[list[tuple[int, str, str]], bytes]:
    """(inode, session id, client) of the write sessions of `clients`, and of clients without any record
    whose sessions were opened before `opened_before_ns`; one page of the session table from key `after`.
    Returns the key to go on from (b"" = the end was reached)."""
    begin, end = schema.session_range_all()
    rows = await tr.get_range(max(begin, after), end, limit=SESSION_SCAN_PAGE, snapshot=True)
    found, unknown = [], {}
    for key, raw in rows:
        record = schema.decode_session(raw)
        inode, session = schema.parse_session_key(key)
        if record.client_id in clients:
            found.append((inode, session, record.client_id))
        elif record.client_id and record.opened_ns < opened_before_ns:
            unknown.setdefault(record.client_id, []).append((inode, session, record.client_id))
    for client_id, sessions in unknown.items():  # no record at all: gone before it was ever flushed
        if await tr.get(schema.client_record_key(client_id), snapshot=True) is None:
            found.extend(sessions)
    cursor = rows[-1][0] + b"\x00" if len(rows) == SESSION_SCAN_PAGE else b""
    return found, cursor


async def drop_sessions(
    tr: Transaction, client_id: str, sessions: list[tuple[int, str]], silent_since_ns: int, forget: bool
) -> bool:
    """Drop the listed sessions of a client still silent since `silent_since_ns` (a conflict-tracked read:
    a call from the client racing with this makes one side retry); with `forget` (all its sessions are in
    the list) its record goes too. Returns False if the client spoke up meanwhile."""
    key = schema.client_record_key(client_id)
    raw = await tr.get(key)
    if raw is not None and schema.decode_client(raw).last_seen_ns >= silent_since_ns:
        return False
    for inode, session in sessions:
        tr.clear(schema.session_key(inode, session))
    if forget:
        tr.clear(key)
    return True


async def prune_idem(tr: Transaction, after: bytes, created_before_ns: int) -> tuple[bytes, int]:
    """Drop idempotency records older than `created_before_ns`, scanning from key `after` on. Returns the
    key to continue from next time (b"" = wrapped around) and how many were dropped."""
    begin, end = schema.idem_range()
    rows = await tr.get_range(max(begin, after), end, limit=IDEM_SCAN_MAX, snapshot=True)
    dropped = 0
    for key, raw in rows:
        if schema.decode_idem(raw).created_ns < created_before_ns:
            tr.clear(key)
            dropped += 1
    cursor = rows[-1][0] + b"\x00" if len(rows) == IDEM_SCAN_MAX else b""
    return cursor, dropped
