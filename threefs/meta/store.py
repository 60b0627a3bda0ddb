"""MetaStore: the meta service's namespace, as one KV transaction per operation.

The operations themselves live in `ops_create`, `ops_attr` and `ops_remove` as functions over a transaction;
this class supplies what they need from outside the KV (time, the chain table, ids handed out in blocks,
random session ids) and runs each in `kv.run`, which retries it on conflict. Nothing is cached between
operations except the unused rest of the id blocks, so any number of MetaStores (in one process or many) may
serve one KV at the same time.

    store = MetaStore(kv, table_info=lambda: (1, 1, 16))
    await store.init()
    rsp, job = await store.open("/data/x", os.O_CREAT | os.O_WRONLY, client_id="c1")
    await store.close(rsp.attr.inode, rsp.session, length_hint=4096)
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from threefs.common import limits
from threefs.common.ids import FIRST_USER_INODE
from threefs.common.layout import Layout
from threefs.common.status import StatusCode, status_error
from threefs.kv import KVEngine, Transaction
from threefs.meta import ops_attr, ops_create, ops_remove, schema
from threefs.meta.ops_create import CreateEnv
from threefs.meta.paths import parse_path
from threefs.meta.schema import GcEntry, TruncateJob
from threefs.rpc.schemas.meta import DirEntry, InodeAttr, OpenRsp

T = TypeVar("T")

INODE_BLOCK = 256  # inode ids reserved per KV round trip (3FS: batches from sharded counters)
CHAIN_SLOT_BLOCK = 256  # round-robin chain slots reserved per KV round trip, per (table, stripe)
STRIPE_DEFAULT_MAX = 16  # the root's default stripe is min(chains, this), as in 3FS's deploy example
REFILL_ROUNDS_MAX = 8  # an operation needs at most one inode block and one slot block per attempt


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
        table_info: Callable[[], tuple[int, int, int]],
        clock_ns: Callable[[], int] = time.time_ns,
        default_chunk_size: int = limits.CHUNK_SIZE_BYTES_DEFAULT,
        default_stripe: int | None = None,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ):
        """`table_info()` -> (chain table id, table version, number of chains), from mgmtd's routing.
        `default_stripe` None means min(number of chains, 16). `random_bytes` makes session ids."""
        self._kv = kv
        self._table_info = table_info
        self._clock_ns = clock_ns
        self._default_chunk_size = default_chunk_size
        self._default_stripe = default_stripe
        self._random_bytes = random_bytes
        self._inodes = _BlockPool(kv, INODE_BLOCK, FIRST_USER_INODE)
        self._chain_slots = _BlockPool(kv, CHAIN_SLOT_BLOCK, 0)

    # -- plumbing ----------------------------------------------------------------------------------------

    async def _run(self, fn: Callable[[Transaction], Awaitable[T]]) -> T:
        """kv.run, plus refilling an id block that an attempt found empty (then the operation runs again)."""
        for _ in range(REFILL_ROUNDS_MAX):
            try:
                return await self._kv.run(fn)
            except _BlockEmpty as empty:
                await empty.pool.refill(empty.key)
        raise status_error(StatusCode.INTERNAL, f"id blocks ran out {REFILL_ROUNDS_MAX} times in one call")

    def _env(self, now_ns: int) -> CreateEnv:
        table = self._table_info()
        return CreateEnv(
            now_ns=now_ns,
            table=table,
            take_inode=lambda: self._inodes.take(schema.INODE_COUNTER_KEY),
            take_chain_slot=lambda table_id, stripe: self._chain_slots.take(
                schema.chain_counter_key(table_id, stripe)
            ),
        )

    def default_layout(self) -> Layout:
        """The root's default layout: the current chain table, the configured chunk size and stripe."""
        table_id, table_version, n_chains = self._table_info()
        stripe = self._default_stripe or max(1, min(n_chains, STRIPE_DEFAULT_MAX))
        return Layout(table_id, table_version, self._default_chunk_size, stripe).validate()

    # -- namespace ---------------------------------------------------------------------------------------

    async def init(self) -> None:
        """Create the root directory (inode 0, mode 0o755, the default layout) if missing. Idempotent, and
        safe when several servers start at once: the KV lets exactly one of them create it."""
        layout, now_ns = self.default_layout(), self._clock_ns()
        await self._run(lambda tr: ops_create.init_root(tr, layout, now_ns))

    async def stat(self, path: str, follow: bool = True) -> InodeAttr:
        """Attributes of `path`; with follow=False a final symlink itself (lstat)."""
        parsed = parse_path(path)
        return await self._run(lambda tr: ops_attr.stat(tr, parsed, follow))

    async def mkdir(
        self, path: str, mode: int = 0o755, parents: bool = False, chunk_size: int = 0, stripe: int = 0
    ) -> InodeAttr:
        """Create a directory. chunk_size/stripe 0 inherit the parent's default layout; others are validated
        and become this directory's default for new files. parents=True acts as `mkdir -p`."""
        parsed, now_ns = parse_path(path), self._clock_ns()
        env = self._env(now_ns)
        return await self._run(
            lambda tr: ops_create.mkdir(tr, parsed, mode, parents, chunk_size, stripe, env)
        )

    async def open(
        self, path: str, flags: int, mode: int = 0o644, chunk_size: int = 0, stripe: int = 0,
        client_id: str = "",
    ) -> tuple[OpenRsp, TruncateJob | None]:
        """open(2) with os.O_* flags. Write opens return a new write session id to pass to close(). With
        O_TRUNC on a non-empty file the returned TruncateJob says which data the service must remove."""
        parsed, now_ns = parse_path(path), self._clock_ns()
        env = self._env(now_ns)
        session = self._random_bytes(8).hex()  # drawn once: retries of the transaction reuse it

        async def fn(tr: Transaction):
            return await ops_create.open_file(
                tr, parsed, flags, mode, chunk_size, stripe, session, client_id, env
            )

        return await self._run(fn)

    async def close(self, inode: int, session: str, length_hint: int, client_id: str = "") -> InodeAttr:
        """End a write session. length_hint (end of the highest byte written, -1 = nothing written) grows the
        length, and a write moves mtime/ctime. Retrying a close is harmless."""
        now_ns = self._clock_ns()
        return await self._run(lambda tr: ops_attr.close(tr, inode, session, length_hint, client_id, now_ns))

    async def truncate(self, path: str, length: int) -> tuple[InodeAttr, TruncateJob | None]:
        """Set a file's length; a shrink returns the TruncateJob the service runs on storage."""
        parsed, now_ns = parse_path(path), self._clock_ns()
        return await self._run(lambda tr: ops_attr.truncate(tr, parsed, length, now_ns))

    async def readdir(
        self, path: str, start_after: str = "", limit: int = 1024
    ) -> tuple[list[DirEntry], bool]:
        """One page of entries (name order) after `start_after`, at most min(limit, READDIR_PAGE_MAX), and
        whether more follow. '.' and '..' are not listed."""
        parsed = parse_path(path)
        return await self._run(lambda tr: ops_attr.readdir(tr, parsed, start_after, limit))

    async def unlink(self, path: str) -> None:
        """Remove a file or symlink name; a file left without names goes to the GC queue."""
        parsed, now_ns = parse_path(path), self._clock_ns()
        await self._run(lambda tr: ops_remove.unlink(tr, parsed, now_ns))

    async def rmdir(self, path: str) -> None:
        """Remove an empty directory."""
        parsed, now_ns = parse_path(path), self._clock_ns()
        await self._run(lambda tr: ops_remove.rmdir(tr, parsed, now_ns))

    async def rename(self, src: str, dst: str, noreplace: bool = False) -> None:
        """rename(2), atomic, POSIX rules; noreplace is RENAME_NOREPLACE. A replaced file goes to GC."""
        src_parsed, dst_parsed, now_ns = parse_path(src), parse_path(dst), self._clock_ns()
        await self._run(lambda tr: ops_remove.rename(tr, src_parsed, dst_parsed, noreplace, now_ns))

    # -- GC ----------------------------------------------------------------------------------------------

    async def gc_pending(self, limit: int = 32, queued_before_ns: int | None = None) -> list[GcEntry]:
        """Files whose chunks the service may remove now (lowest inode first; none with a write session;
        queued at or before `queued_before_ns` if given). Call gc_done(inode) after removing the chunks."""
        return await self._run(lambda tr: ops_remove.gc_pending(tr, limit, queued_before_ns))

    async def gc_done(self, inode: int) -> None:
        """Forget a collected file: its GC entry and inode record go in one transaction. Idempotent."""
        await self._run(lambda tr: ops_remove.gc_done(tr, inode))
