"""What the meta service does on storage: remove a file's chunks (truncate, GC), measure a file's exact
length from its last chunks (close, fsync, pruned sessions), and add up capacity for statfs.

Meta is off the data path; these are its only storage calls, and each touches at most one request per
chain of the file's stripe, all in flight together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from threefs.cluster.mgmtd_client import MgmtdClient
from threefs.cluster.routing import Routing
from threefs.cluster.storage_client import StorageClient
from threefs.common.ids import chunk_id, inode_chunk_range, parse_chunk_id
from threefs.common.layout import Layout, chain_of_chunk
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.meta.ops_attr import LengthUpdate
from threefs.meta.ops_create import Replan
from threefs.meta.schema import FILE
from threefs.meta.store import DEFAULT_TABLE_ID, MetaStore
from threefs.rpc.schemas.meta import InodeAttr, StatfsRsp

log = logging.getLogger(__name__)

STATFS_CACHE_S = 1.0
LENGTH_ROUNDS_MAX = 8  # measure-and-store attempts while truncates keep changing the file


class DataOps:
    def __init__(self, store: MetaStore, mgmtd: MgmtdClient, storage: StorageClient):
        self.store, self.mgmtd, self.storage = store, mgmtd, storage
        self._statfs: tuple[float, Routing] | None = None  # (when, routing fetched for statfs)

    async def _chains(self, layout: Layout) -> tuple[list[int], int]:
        """The distinct chains of a layout's stripe (and the table they come from)."""
        routing = await self.mgmtd.get()
        table = routing.table(layout.table_id).chains
        return sorted({chain_of_chunk(layout, i, table) for i in range(layout.stripe)}), len(table)

    async def remove_from(self, inode: int, layout: Layout, new_length: int) -> None:
        """Drop file data past `new_length` on every chain of the file's stripe (chunks wholly past it go,
        the chunk holding the new end is cut)."""
        routing = await self.mgmtd.get()
        table = routing.table(layout.table_id).chains
        cs = layout.chunk_size
        chains, _ = await self._chains(layout)
        _, end = inode_chunk_range(inode)
        begin = chunk_id(inode, -(-new_length // cs))
        await asyncio.gather(*(self.storage.remove_range(c, begin, end, cs) for c in chains))
        if new_length % cs:
            index = new_length // cs
            await self.storage.truncate_chunk(chain_of_chunk(layout, index, table), chunk_id(inode, index),
                                              new_length % cs, cs)

    async def remove_files(self, files: list[tuple[int, Layout]]) -> dict[int, ThreeFSError]:
        """Drop all data of many files (GC): one remove_ranges request per chain (and chunk size) for all of
        them, all chains in flight together, where one remove_from per file sent a request to every chain of
        its stripe. Returns the files (inodes) not removed because a chain's request failed, with the error."""
        if not files:
            return {}
        routing = await self.mgmtd.get()
        per_chain: dict[tuple[int, int], list[tuple[bytes, bytes]]] = {}
        inodes_of: dict[tuple[int, int], list[int]] = {}
        for inode, layout in files:
            table = routing.table(layout.table_id).chains
            rng = inode_chunk_range(inode)
            for c in {chain_of_chunk(layout, i, table) for i in range(layout.stripe)}:
                key = (c, layout.chunk_size)
                per_chain.setdefault(key, []).append(rng)
                inodes_of.setdefault(key, []).append(inode)
        keys = list(per_chain)
        results = await asyncio.gather(*(self.storage.remove_ranges(c, per_chain[(c, cs)], cs) for c, cs in keys),
                                       return_exceptions=True)
        failed: dict[int, ThreeFSError] = {}
        for key, r in zip(keys, results):
            if isinstance(r, BaseException):
                if not isinstance(r, ThreeFSError):
                    raise r
                for inode in inodes_of[key]:
                    failed.setdefault(inode, r)
        return failed

    async def file_end(self, inode: int, layout: Layout) -> int:
        """End of the file's data on storage: the highest (chunk index * chunk size + chunk length) over
        the last chunk of every chain of its stripe."""
        chains, _ = await self._chains(layout)
        begin, end = inode_chunk_range(inode)
        rsps = await asyncio.gather(*(self.storage.last_chunk(c, begin, end) for c in chains))
        ends = [parse_chunk_id(r.chunk_id)[3] * layout.chunk_size + r.length for r in rsps if r.chunk_id]
        return max(ends, default=0)

    async def sync_exact(self, inode: int, session: str, update: LengthUpdate, client_id: str,
                         end_session: bool) -> InodeAttr:
        """Store a length measured on storage (plus the writer's hint), measuring again if a truncate
        happened meanwhile. If storage cannot answer, the hint alone is used (logged)."""
        for _ in range(LENGTH_ROUNDS_MAX):
            state = await self.store.file_state(inode)
            exact = update
            if state.type == FILE and state.layout is not None:
                try:
                    end = await self.file_end(inode, state.layout)
                    exact = update._replace(exact_end=end, exact_ver=state.truncate_ver)
                except ThreeFSError as e:
                    log.warning("length of inode %d not measured (%s); using the writer's hint", inode, e)
            try:
                return await self.store.sync(inode, session, exact, client_id, end_session)
            except Replan:
                continue
        raise status_error(StatusCode.BUSY, f"inode {inode} was truncated {LENGTH_ROUNDS_MAX} times while "
                           "its length was measured; try again")

    async def statfs(self) -> StatfsRsp:
        """Capacity of the default chain table's targets, in file bytes (one replica's worth). Usage
        changes do not bump the routing version, so this fetches the whole routing info (at most once per
        STATFS_CACHE_S)."""
        now = time.monotonic()
        if self._statfs is None or now - self._statfs[0] > STATFS_CACHE_S:
            self._statfs = (now, await self.mgmtd.refresh(force=True))
        routing = self._statfs[1]
        table = routing.table(DEFAULT_TABLE_ID)
        target_ids = {t.target_id for c in table.chains for t in routing.chain(c).targets}
        return capacity(routing, target_ids, table.replicas or 1)


def capacity(routing: Routing, target_ids: set[int], replicas: int) -> StatfsRsp:
    """Used = the targets' data; free = the free space of the file systems they live on, each file system
    counted once (several targets, even several storage processes, often share one disk)."""
    infos = [routing.info.targets[t] for t in sorted(target_ids) if t in routing.info.targets]
    used = sum(t.used_bytes for t in infos)
    free_by_fs: dict[tuple[str, str], int] = {}
    reporting = 0
    for t in infos:
        if not t.fs_id:
            continue
        reporting += 1
        node = routing.info.nodes.get(t.node_id)
        free_by_fs[(node.hostname if node else str(t.node_id), t.fs_id)] = t.free_bytes
    used, free = used // replicas, sum(free_by_fs.values()) // replicas
    return StatfsRsp(capacity_bytes=used + free, used_bytes=used, free_bytes=free, replicas=replicas,
                     targets=len(infos), targets_reporting=reporting)


def meta_owner(routing: Routing | None, my_node_id: int, type_meta: str) -> Callable[[int], bool]:
    """Which work items (by number) this meta server owns: an even split over the live meta servers, so
    GC entries are not collected twice; a server that routing does not list yet owns everything."""
    ids = [n.node_id for n in routing.nodes_of_type(type_meta)] if routing is not None else []
    if my_node_id not in ids:
        return lambda _item: True
    mine = ids.index(my_node_id)
    return lambda item: item % len(ids) == mine
