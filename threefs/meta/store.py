"""MetaStore: the meta service's namespace, as one KV transaction per operation.

The operations themselves live in `ops_create`, `ops_attr` and `ops_remove` as functions over a transaction;
this class supplies what they need from outside the KV (time, the chain table, ids handed out in blocks,
random session ids) and runs each in `kv.run`, which retries it on conflict. Nothing is cached between
operations except the unused rest of the id blocks, so any number of MetaStores (in one process or many) may
serve one KV at the same time.

    store = MetaStore(kv, table_info=lambda table_id: (table_id, 1, 16))
    await store.init()
    rsp = await store.open("/data/x", os.O_CREAT | os.O_WRONLY, caller=Caller(client_id="c1"))
    await store.close(rsp.attr.inode, rsp.session, length_hint=4096, client_id="c1")

Every namespace method takes the path as 3FS's "path at": `path`, and `parent` (an inode) when the path is
relative (see rpc/schemas/meta.py). `caller` says who acts (permissions) and, for mutations, which request
this is: a retried request (same client id and request id) gets the first reply again. Creates recognise
their own entry (the dentry keeps the request's fingerprint, and a write session's id is derived from the
request); removals and renames keep their reply in an IDEM record.

The calls that change a directory's entries (mkdir, open with O_CREAT, symlink, mknod, link, unlink, rmdir,
remove, rename) take an optional `dirs` list, which they fill with the attributes of the directories whose
records their transaction wrote, as it committed them (empty when it wrote none, e.g. a create that found the
file, or a retried request answered from its first reply): the FUSE daemon answers the kernel's next getattr
of the directory with them.

Storage is not reached from here: truncates and O_TRUNC take a `plan` (the file whose chunks the service
removed first) and raise Replan when the file changed; the service then runs them again (service.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple, TypeVar

import msgspec

from threefs.common import limits
from threefs.common.health import Problems
from threefs.common.ids import FIRST_USER_INODE, INODE_MAX
from threefs.common.layout import Layout
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.kv import KVEngine, Transaction
from threefs.meta import ops_attr, ops_create, ops_gc, ops_remove, ops_resolve, ops_xattr, schema
from threefs.meta.ops_attr import Changes, LengthUpdate, TruncatePlan
from threefs.meta.ops_create import CreateEnv
from threefs.meta.paths import ParsedPath, parse_path
from threefs.meta.schema import GcEntry, Inode
from threefs.meta.users import ROOT
from threefs.rpc.schemas.meta import CLOSE_MANY_MAX, NO_PARENT, DirEntry, InodeAttr, OpenRsp, UserCred

T = TypeVar("T")

INODE_BLOCK = 256  # inode ids reserved per KV round trip (3FS: batches from sharded counters)
CHAIN_SLOT_BLOCK = 256  # round-robin chain slots reserved per KV round trip, per (table, stripe)
DEFAULT_TABLE_ID = 1  # the chain table of the root's default layout (`threefs up` creates it)
STRIPE_DEFAULT_MAX = 16  # the root's default stripe is min(chains, this), as in 3FS's deploy example
REFILL_ROUNDS_MAX = 8  # an operation needs at most one inode block and one slot block per attempt
CLIENT_ID_CHARS_MAX = 64
GC_DONE_PER_TXN = 16  # collected files forgotten per transaction (about 5 keys each; etcd's default Txn cap is 128 ops)


class Caller(NamedTuple):
    """Who makes a call, and which request it is (request_id 0: not tracked for idempotent retries)."""

    user: UserCred = ROOT
    client_id: str = ""
    request_id: int = 0


ANONYMOUS = Caller()


def _token(caller: Caller) -> bytes:
    """The request's fingerprint, b"" without a request id."""
    if not caller.request_id:
        return b""
    if not 0 < caller.request_id < 1 << 63:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"request id {caller.request_id} is out of range")
    check_client_id(caller.client_id, required=True)
    return schema.request_token(caller.client_id, caller.request_id)


def check_client_id(client_id: str, required: bool = False) -> None:
    """Client ids name KV keys: bounded, and present where a request id refers to them."""
    if len(client_id.encode()) > CLIENT_ID_CHARS_MAX or (required and not client_id):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"client id {client_id[:80]!r} must be 1 to "
                           f"{CLIENT_ID_CHARS_MAX} bytes")


def check_inode_id(inode: int) -> None:
    if not 0 <= inode <= INODE_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"inode {inode} is out of range")


class _BlockEmpty(Exception):
    """Raised inside a transaction when an id block is used up; the store refills it outside and reruns."""

    def __init__(self, pool: "_BlockPool", key: bytes):
        super().__init__(key)
        self.pool, self.key = pool, key


class _BlockPool:
    """Counters in the KV handed out in blocks: one transaction per block, not one per id.

    An id taken by an attempt that did not commit is never used again; ids are plentiful, and reusing one
    whose commit outcome is unknown could give two files one inode.
    """

    def __init__(self, kv: KVEngine, block: int, first: int):
        self._kv, self._block, self._first = kv, block, first
        self._ranges: dict[bytes, tuple[int, int]] = {}  # counter key -> [next, end)
        self._lock = asyncio.Lock()

    def take(self, key: bytes) -> int:
        next_id, end = self._ranges.get(key, (0, 0))
        if next_id >= end:
            raise _BlockEmpty(self, key)
        self._ranges[key] = (next_id + 1, end)
        return next_id

    async def refill(self, key: bytes) -> None:
        async with self._lock:  # one refill per empty block, however many operations found it empty
            next_id, end = self._ranges.get(key, (0, 0))
            if next_id < end:
                return

            async def reserve(tr: Transaction) -> int:
                raw = await tr.get(key)
                start = self._first if raw is None else schema.decode_counter(raw)
                tr.set(key, schema.encode_counter(start + self._block))
                return start

            start = await self._kv.run(reserve)
            self._ranges[key] = (start, start + self._block)


class MetaStore:
    """The POSIX namespace over a transactional KV (see module docstring)."""

    def __init__(
        self,
        kv: KVEngine,
        *,
        table_info: Callable[[int], tuple[int, int, int]],
        clock_ns: Callable[[], int] = time.time_ns,
        default_chunk_size: int = limits.CHUNK_SIZE_BYTES_DEFAULT,
        default_stripe: int | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ):
        """`table_info(table id)` -> (chain table id, table version, number of chains), from mgmtd's routing.
        `default_stripe` None means min(number of chains, 16). `random_bytes` makes session ids."""
        self._kv = kv
        self.problems = Problems()  # reported in the service's heartbeats (`threefs status`)
        self._table_info = table_info
        self._clock_ns = clock_ns
        self._default_chunk_size = default_chunk_size
        self._default_stripe = default_stripe
        self._random_bytes = random_bytes
        self._inodes = _BlockPool(kv, INODE_BLOCK, FIRST_USER_INODE)
        self._chain_slots = _BlockPool(kv, CHAIN_SLOT_BLOCK, 0)

    # -- plumbing ----------------------------------------------------------------------------------------

    async def _run(self, fn: Callable[[Transaction], Awaitable[T]],
                   dirs: list[InodeAttr] | None = None) -> T:
        """kv.run, plus refilling an id block that an attempt found empty (then the operation runs again).
        `dirs`: filled with the directories the committed attempt wrote (ops_resolve.dirs_written)."""
        if dirs is not None:
            inner = fn

            async def fn(tr: Transaction) -> T:
                result = await inner(tr)
                dirs[:] = ops_resolve.dirs_written(tr)
                return result

        for _ in range(REFILL_ROUNDS_MAX):
            try:
                result = await self._kv.run(fn)
            except _BlockEmpty as empty:
                await empty.pool.refill(empty.key)
                continue
            except ThreeFSError as e:
                if e.code == StatusCode.KV_ERROR:  # the KV itself fails (disk full, read-only, down)
                    self.problems.record("kv", f"its KV fails: {e.message}")
                raise
            self.problems.clear("kv")
            return result
        raise status_error(StatusCode.INTERNAL, f"id blocks ran out {REFILL_ROUNDS_MAX} times in one call")

    async def _mutate(self, caller: Caller, result_type: type,
                      fn: Callable[[Transaction], Awaitable[T]], dirs: list[InodeAttr] | None = None) -> T:
        """Run a removal or rename; with a request id, record its reply in the same transaction, and answer a
        retry of the same request with that reply instead of running it again (3FS's IDEM keys; `dirs`
        stays empty then: the directories may have changed since)."""
        if not _token(caller):
            return await self._run(fn, dirs)
        key = schema.idem_key(caller.client_id, caller.request_id)
        now_ns = self._clock_ns()

        async def once(tr: Transaction):
            raw = await tr.get(key)
            if raw is not None:
                return msgspec.msgpack.decode(schema.decode_idem(raw).reply, type=result_type)
            result = await fn(tr)
            tr.set(key, schema.encode(schema.IdemRecord(now_ns, msgspec.msgpack.encode(result))))
            return result

        return await self._run(once, dirs)

    def _env(self, now_ns: int, caller: Caller = ANONYMOUS) -> CreateEnv:
        return CreateEnv(
            now_ns=now_ns,
            table=self._table_info,
            user=caller.user,
            token=_token(caller),
            take_inode=lambda: self._inodes.take(schema.INODE_COUNTER_KEY),
            take_chain_slot=lambda table_id, stripe: self._chain_slots.take(
                schema.chain_counter_key(table_id, stripe)
            ),
        )

    def default_layout(self) -> Layout:
        """The root's default layout: the current chain table, the configured chunk size and stripe."""
        table_id, table_version, n_chains = self._table_info(DEFAULT_TABLE_ID)
        stripe = self._default_stripe or max(1, min(n_chains, STRIPE_DEFAULT_MAX))
        return Layout(table_id, table_version, self._default_chunk_size, stripe).validate()

    # -- namespace ---------------------------------------------------------------------------------------

    async def init(self) -> None:
        """Create the root directory (inode 0, mode 0o755, the default layout) if missing. Idempotent, and
        safe when several servers start at once: the KV lets exactly one of them create it."""
        layout, now_ns = self.default_layout(), self._clock_ns()
        await self._run(lambda tr: ops_create.init_root(tr, layout, now_ns))

    async def stat(self, path: str, follow: bool = True, *, parent: int = NO_PARENT,
                   user: UserCred = ROOT, missing_ok: bool = False) -> InodeAttr | None:
        """Attributes of `path`; with follow=False a final symlink itself (lstat). ("", parent=inode) is
        getattr(inode); ("name", parent=dir inode) is FUSE's lookup. `missing_ok`: None when the last name
        does not exist, instead of NOT_FOUND."""
        parsed = parse_path(path, parent)
        return await self._run(lambda tr: ops_attr.stat(tr, parsed, follow, user, missing_ok))

    async def batch_stat(self, items: list[tuple[int, str]], follow: bool = True,
                         user: UserCred = ROOT) -> list[InodeAttr | ThreeFSError]:
        """stat of many (parent, path) items in one snapshot; each gets its attributes or its error."""
        if len(items) > limits.BATCH_STAT_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"batch stat of {len(items)} items exceeds "
                               f"{limits.BATCH_STAT_MAX}")
        parsed: list[ParsedPath | ThreeFSError] = []
        for parent, path in items:
            try:
                parsed.append(parse_path(path, parent))
            except ThreeFSError as exc:
                parsed.append(exc)
        return await self._run(lambda tr: ops_attr.batch_stat(tr, parsed, follow, user))

    async def mkdir(
        self, path: str, mode: int = 0o755, parents: bool = False, chunk_size: int = 0, stripe: int = 0,
        *, parent: int = NO_PARENT, caller: Caller = ANONYMOUS, dirs: list[InodeAttr] | None = None,
    ) -> InodeAttr:
        """Create a directory. chunk_size/stripe 0 inherit the parent's default layout; others are validated
        and become this directory's default for new files. parents=True acts as `mkdir -p`."""
        parsed, now_ns = parse_path(path, parent), self._clock_ns()
        env = self._env(now_ns, caller)
        return await self._run(lambda tr: ops_create.mkdir(tr, parsed, mode, parents, chunk_size, stripe,
                                                           env), dirs)

    async def open(
        self, path: str, flags: int, mode: int = 0o644, chunk_size: int = 0, stripe: int = 0,
        *, parent: int = NO_PARENT, caller: Caller = ANONYMOUS, trunc_plan: tuple[int, int] | None = None,
        stamp_client: bool = True, dirs: list[InodeAttr] | None = None,
    ) -> OpenRsp:
        """open(2) with os.O_* flags. Write opens return a new write session id to pass to close().
        O_TRUNC sets the length to 0 here; removing the data on storage is the service's job, done before
        (`trunc_plan` = the (inode, truncate version) it was done for). `stamp_client` False skips marking
        the client as seen (the service does when it did so recently)."""
        parsed, now_ns = parse_path(path, parent), self._clock_ns()
        env = self._env(now_ns, caller)
        # A request's retry reuses its session id; without a request id one is drawn (once: retries of
        # the transaction reuse it).
        session = env.token.hex() if env.token else self._random_bytes(8).hex()

        async def fn(tr: Transaction) -> OpenRsp:
            return await ops_create.open_file(tr, parsed, flags, mode, chunk_size, stripe, session,
                                              caller.client_id, env, trunc_plan, stamp_client)

        return await self._run(fn, dirs)

    async def symlink(self, path: str, target: str, *, parent: int = NO_PARENT,
                      caller: Caller = ANONYMOUS, dirs: list[InodeAttr] | None = None) -> InodeAttr:
        """symlink(2): a new name `path` holding `target`."""
        parsed, now_ns = parse_path(path, parent), self._clock_ns()
        env = self._env(now_ns, caller)
        return await self._run(lambda tr: ops_create.symlink(tr, parsed, target, env), dirs)

    async def mknod(self, path: str, kind: int, mode: int, rdev: int = 0, *, parent: int = NO_PARENT,
                    caller: Caller = ANONYMOUS, dirs: list[InodeAttr] | None = None) -> InodeAttr:
        """mknod(2) of a special file (schema.SPECIAL_TYPES)."""
        parsed, now_ns = parse_path(path, parent), self._clock_ns()
        env = self._env(now_ns, caller)
        return await self._run(lambda tr: ops_create.mknod(tr, parsed, kind, mode, rdev, env), dirs)

    async def xattr(self, req, caller: Caller = ANONYMOUS):
        """get / set / list / remove an extended attribute (rpc.schemas.meta.XattrReq)."""
        parsed, now_ns = parse_path(req.path, req.parent), self._clock_ns()
        return await self._run(lambda tr: ops_xattr.xattr(tr, parsed, req, caller.user, now_ns))

    async def link(self, src: str, dst: str, *, src_parent: int = NO_PARENT, dst_parent: int = NO_PARENT,
                   caller: Caller = ANONYMOUS, dirs: list[InodeAttr] | None = None) -> InodeAttr:
        """link(2): another name for a file or symlink (not followed)."""
        src_parsed, dst_parsed, now_ns = parse_path(src, src_parent), parse_path(dst, dst_parent), \
            self._clock_ns()
        env = self._env(now_ns, caller)
        return await self._run(lambda tr: ops_create.link(tr, src_parsed, dst_parsed, env), dirs)

    async def readlink(self, path: str, *, parent: int = NO_PARENT, user: UserCred = ROOT) -> str:
        parsed = parse_path(path, parent)
        return await self._run(lambda tr: ops_attr.readlink(tr, parsed, user))

    async def readdir(
        self, path: str, start_after: str = "", limit: int = 1024, *, parent: int = NO_PARENT,
        user: UserCred = ROOT,
    ) -> tuple[list[DirEntry], bool]:
        """One page of entries (name order) after `start_after`, at most min(limit, READDIR_PAGE_MAX), and
        whether more follow. '.' and '..' are not listed."""
        parsed = parse_path(path, parent)
        return await self._run(lambda tr: ops_attr.readdir(tr, parsed, start_after, limit, user))

    async def setattr(self, path: str, changes: Changes, follow: bool = True, *, parent: int = NO_PARENT,
                      caller: Caller = ANONYMOUS, publish: tuple[int, str, LengthUpdate] | None = None,
                      ) -> InodeAttr:
        """chmod / chown / utimens, a directory's default layout (see ops_attr.Changes); the length is
        truncate()'s. `publish` (inode, session, update): a writer's length published first, in the same
        transaction (as sync() does), so the times set here are not moved by it."""
        parsed, now_ns = parse_path(path, parent), self._clock_ns()
        if publish is not None:
            check_inode_id(publish[0])

        async def fn(tr: Transaction) -> InodeAttr:
            if publish is not None:
                inode, session, update = publish
                await ops_attr.update_length(tr, inode, session, caller.client_id, update, now_ns, False)
            return await ops_attr.setattr(tr, parsed, follow, changes, caller.user, now_ns, self._table_info)

        return await self._run(fn)

    async def unlink(self, path: str, *, parent: int = NO_PARENT, caller: Caller = ANONYMOUS,
                     dirs: list[InodeAttr] | None = None) -> None:
        """Remove a file or symlink name; a file left without names goes to the GC queue."""
        parsed, now_ns = parse_path(path, parent), self._clock_ns()
        await self._mutate(caller, type(None), lambda tr: ops_remove.unlink(tr, parsed, caller.user, now_ns),
                           dirs)

    async def rmdir(self, path: str, *, parent: int = NO_PARENT, caller: Caller = ANONYMOUS,
                    dirs: list[InodeAttr] | None = None) -> None:
        """Remove an empty directory."""
        parsed, now_ns = parse_path(path, parent), self._clock_ns()
        await self._mutate(caller, type(None), lambda tr: ops_remove.rmdir(tr, parsed, caller.user, now_ns),
                           dirs)

    async def remove(self, path: str, recursive: bool = False, *, parent: int = NO_PARENT,
                     caller: Caller = ANONYMOUS, dirs: list[InodeAttr] | None = None) -> bool:
        """Remove any entry; `recursive` hands a non-empty directory to GC in one transaction (returns True
        then). For a user other than root the whole tree is permission-checked first."""
        parsed, now_ns = parse_path(path, parent), self._clock_ns()
        if recursive and caller.user.uid != 0:
            await self._run(lambda tr: ops_remove.check_tree(tr, parsed, caller.user))
        return await self._mutate(caller, bool, lambda tr: ops_remove.remove(
            tr, parsed, recursive, caller.user, now_ns), dirs)

    async def rename(self, src: str, dst: str, noreplace: bool = False, *, src_parent: int = NO_PARENT,
                     dst_parent: int = NO_PARENT, caller: Caller = ANONYMOUS,
                     dirs: list[InodeAttr] | None = None) -> None:
        """rename(2), atomic, POSIX rules; noreplace is RENAME_NOREPLACE. A replaced file goes to GC."""
        src_parsed, dst_parsed = parse_path(src, src_parent), parse_path(dst, dst_parent)
        now_ns = self._clock_ns()
        await self._mutate(caller, type(None), lambda tr: ops_remove.rename(
            tr, src_parsed, dst_parsed, noreplace, caller.user, now_ns), dirs)

    # -- file length -------------------------------------------------------------------------------------

    async def close(self, inode: int, session: str, length_hint: int, client_id: str = "", *,
                    exact_end: int | None = None, exact_ver: int = -1) -> InodeAttr:
        """End a write session. length_hint (end of the highest byte written, -1 = nothing written) grows the
        length if no truncate happened since the session began, and a write moves mtime/ctime; `exact_end`
        (measured on storage at truncate version `exact_ver`) grows it too. Retrying a close is harmless."""
        update = LengthUpdate(length_hint, -1, exact_end, exact_ver)
        return await self.sync(inode, session, update, client_id, end_session=True)

    async def sync(self, inode: int, session: str, update: LengthUpdate, client_id: str = "",
                   end_session: bool = False) -> InodeAttr:
        """A writer's length hint and/or an exact length from storage (see ops_attr.update_length)."""
        check_inode_id(inode)
        now_ns = self._clock_ns()
        return await self._run(lambda tr: ops_attr.update_length(
            tr, inode, session, client_id, update, now_ns, end_session))

    async def end_sessions(self, items: list[tuple[int, str]], client_id: str = "") -> int:
        """The closes of files nothing was written to, in one transaction: their sessions end, nothing else
        changes (close() with length_hint -1 reads and keeps the inode as it is). Returns how many ended."""
        if len(items) > CLOSE_MANY_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{len(items)} sessions in one call exceed "
                               f"{CLOSE_MANY_MAX}")
        for inode, _ in items:
            check_inode_id(inode)
        return await self._run(lambda tr: ops_attr.end_sessions(tr, items, client_id))

    async def file_state(self, inode: int) -> Inode:
        """A file's record as of now (a snapshot): its layout and truncate version, to measure its length."""
        check_inode_id(inode)
        return await self._run(lambda tr: ops_attr.load_file(tr, inode, snapshot=True))

    async def truncate_plan(self, path: str, length: int, *, parent: int = NO_PARENT,
                            user: UserCred = ROOT) -> TruncatePlan:
        """Check a truncate and say which file it acts on, before the service removes chunks."""
        parsed = parse_path(path, parent)
        return await self._run(lambda tr: ops_attr.truncate_plan(tr, parsed, length, user))

    async def truncate(self, path: str, length: int, *, parent: int = NO_PARENT, user: UserCred = ROOT,
                       plan: tuple[int, int] | None = None) -> InodeAttr:
        """Set a file's length and bump its truncate version. The service removes the chunks past `length`
        first, for `plan` (see truncate_plan); Replan if the file changed since."""
        parsed, now_ns = parse_path(path, parent), self._clock_ns()
        return await self._run(lambda tr: ops_attr.truncate_commit(tr, parsed, length, user, now_ns, plan))

    # -- GC and housekeeping -----------------------------------------------------------------------------

    async def gc_pending(self, limit: int = 32, queued_before_ns: int | None = None) -> list[GcEntry]:
        """Entries GC may work on now (oldest first): removed trees always, files without a write session
        queued at or before `queued_before_ns` (None: any). For a file call gc_done(entry) after removing its
        chunks; for a directory call gc_dir_step(entry) until it returns True."""
        return await self._run(lambda tr: ops_gc.gc_pending(tr, limit, queued_before_ns))

    async def gc_done(self, entry: GcEntry) -> None:
        """Forget a collected file: its GC entry and inode record go in one transaction. Idempotent."""
        await self._run(lambda tr: ops_gc.gc_done(tr, entry))

    async def gc_done_many(self, entries: list[GcEntry]) -> tuple[int, list[tuple[GcEntry, str]]]:
        """gc_done for many files, GC_DONE_PER_TXN per transaction. Returns (entries dropped, [(entry, why)
        left queued]): an inode that has names again is a bug, reported, and keeps its entry."""
        dropped, left = 0, []
        for i in range(0, len(entries), GC_DONE_PER_TXN):
            part = entries[i:i + GC_DONE_PER_TXN]
            n, bad = await self._run(lambda tr, part=part: ops_gc.gc_done_many(tr, part))
            dropped += n
            left += bad
        return dropped, left

    async def gc_dir_step(self, entry: GcEntry) -> bool:
        """Move one page of entries out of a removed directory; True once the directory is gone."""
        now_ns = self._clock_ns()
        return await self._run(lambda tr: ops_gc.gc_dir_step(tr, entry, now_ns))

    async def touch_clients(self, seen: dict[str, int]) -> None:
        await self._run(lambda tr: ops_gc.touch_clients(tr, seen))

    async def stale_clients(self, silent_since_ns: int) -> list[str]:
        return await self._run(lambda tr: ops_gc.stale_clients(tr, silent_since_ns))

    async def sessions_of(self, clients: set[str], opened_before_ns: int,
                          pages_max: int = 64) -> tuple[list[tuple[int, str, str]], bool]:
        """(inode, session, client) of the write sessions of `clients` (and of clients with no record at all,
        opened before `opened_before_ns`), scanning at most `pages_max` pages; and whether the scan was
        complete."""
        found, cursor = [], b""
        for _ in range(pages_max):
            page, cursor = await self._run(
                lambda tr: ops_gc.sessions_of(tr, clients, opened_before_ns, cursor))
            found += page
            if not cursor:
                return found, True
        return found, False

    async def drop_sessions(self, client_id: str, sessions: list[tuple[int, str]], silent_since_ns: int,
                            forget: bool) -> bool:
        return await self._run(lambda tr: ops_gc.drop_sessions(tr, client_id, sessions, silent_since_ns,
                                                               forget))

    async def prune_idem(self, after: bytes, created_before_ns: int) -> tuple[bytes, int]:
        return await self._run(lambda tr: ops_gc.prune_idem(tr, after, created_before_ns))
