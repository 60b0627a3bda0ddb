"""Storage service: hosts targets, runs the CRAQ write path and serves batch reads.

Write path (3FS §3): client -> head; the head takes the per-chunk lock, assigns the version, writes a
pending version, forwards to its successor (next SERVING or SYNCING target), and commits when the
successor answers; the tail commits first, so the ack is the nested RPC response.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

from threefs.cluster.mgmtd_client import MgmtdClient
from threefs.cluster.routing import Routing
from threefs.common import crc32c
from threefs.common.buffers import IO_BUFFER_ALIGN, BufferPool, Lease, align_up
from threefs.common.config import ServiceConfig
from threefs.common.health import Problems
from threefs.common.locks import KeyedLocks, outlast
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.cluster.heartbeat import heartbeat_loop
from threefs.storage.fence import HeartbeatFence, heartbeat_every_mgmtd, sync_reports
from threefs.rpc.client import RpcClient
from threefs.rpc.frame import FilePayload
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.rpc.schemas.common import Empty
from threefs.rpc.server import CallContext, rpc
from threefs.storage.chunk_engine import ChunkEngine
from threefs.storage.chunk_engine_v2 import DIRECT_ALIGN
from threefs.storage.engines import open_chunk_engine, target_space
from threefs.storage import craq

log = logging.getLogger(__name__)

DISK_THREADS = 4  # threads per storage service for disk IO that may block (misses, writes, fsync)
# Updates run on the event loop when they only write into the page cache (ChunkEngineV2.inline): writes of
# at most this many bytes, and commits. A hop to a disk thread and back cost more than the update itself
# (4 KiB writes, R=3: 533-650 -> 333-367 us of CPU per replica, docs/storage.md "Small updates inline").
INLINE_UPDATE_BYTES_MAX = 64 * 1024
# An inline update that took longer than this (page-cache writeback throttling the writer, a slow journal
# append) turns inline updates off for INLINE_PAUSE_S: the loop serves every other request meanwhile.
INLINE_SLOW_S = 0.005
INLINE_PAUSE_S = 2.0
RTS_TIMEOUT_S = 5.0  # request-to-send: send anyway when no grant comes (3FS does the same)
# A partial read of a chunk of at most this size checks the whole chunk against its checksum the first
# time that version is read here (larger chunks rely on the scrub); VERIFIED_ENTRIES_MAX versions are
# remembered as checked (see VerifiedChunks).
VERIFY_WHOLE_BYTES_MAX = 8 << 20
# Parts of chunks at least this long are sent from the data file in a zero-copy request (_serve_regions); a
# smaller one costs less copied into the payload than a sendfile of its own
REGION_BYTES_MIN = 16 << 10
VERIFIED_ENTRIES_MAX = 65536
PARTIAL_CHECK_ATTEMPTS = 4  # whole reads of a chunk whose committed length keeps changing, then CHUNK_LOCKED
REMOVE_PARALLEL = 16  # chunks of one remove_range(s) request removed through the chain at once
# A read_packed of one IO covering a whole committed chunk of at least this size is sent straight from the
# data file (os.sendfile) when the client asks for zero_copy; smaller ones are cheaper copied.
ZERO_COPY_BYTES_MIN = 128 * 1024


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


_SYS_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(os.uname().machine)  # Linux 6.5+
_cachestat = None


def page_cache_holds(fd: int, offset: int, length: int) -> bool | None:
    """Whether every page of bytes [offset, offset+length) of file `fd` is in the page cache (cachestat(2):
    one syscall, no IO), or None where cachestat is not available (then callers probe with RWF_NOWAIT reads,
    which start a readahead when they miss: pages read twice, once by it and once by the O_DIRECT read)."""
    global _cachestat
    if _cachestat is None:
        if _SYS_CACHESTAT is None:
            _cachestat = False
        else:
            libc = ctypes.CDLL(None, use_errno=True)  # (ctypes calls release the GIL)
            _cachestat = libc.syscall
    if _cachestat is False:
        return None
    first = offset & ~4095
    rng, st = _CacheRange(first, offset + length - first), _CacheStat()
    if _cachestat(_SYS_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
            _cachestat = False
        return None
    return st.cache >= (offset + length - first + 4095) // 4096


class FileLease(Lease):
    """A response payload of a file's bytes (rpc/frame.FilePayload) with what to do once it is sent: the RPC
    server releases a Lease after the send (here: end the chunk engine's read epoch)."""

    __slots__ = ("_done",)

    def __init__(self, payload: FilePayload, done):
        self.view = payload
        self._done = done

    def release(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()


class _EpochHold:
    """A chunk engine's read epoch held by a send (released with the send's other holds)."""

    __slots__ = ("engine", "epoch")

    def __init__(self, engine, epoch: int):
        self.engine, self.epoch = engine, epoch

    def release(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.end_reads(self.epoch)


class VerifiedChunks:
    """Chunk versions whose bytes this process has read whole and found to match their checksum, so
    later partial reads of them need not read the whole chunk again. What it protects: damage on disk
    (or between the disk and this process) before the first read of a version is never served; damage
    arriving later in a version already checked is the scrub's to find. Bounded (oldest checks forgotten
    first), thread-safe (the read path runs in the loop and in the disk threads)."""

    def __init__(self, entries_max: int = VERIFIED_ENTRIES_MAX):
        import collections
        import threading

        self._seen: collections.OrderedDict = collections.OrderedDict()
        self.seen = self._seen  # read-only use: `key in seen` (batched reads skip the method call)
        self._lock = threading.Lock()
        self._max = entries_max

    def __contains__(self, key) -> bool:
        # no lock and no LRU touch: a dict lookup is atomic, and this runs once per partial read. Eviction
        # is thus in insertion order: a version checked long ago is checked once more (a whole-chunk read).
        return key in self._seen

    def add(self, key) -> None:
        with self._lock:
            self._seen[key] = None
            if len(self._seen) > self._max:
                self._seen.popitem(last=False)


def check_read_ios(ios: list[ss.ReadIO]) -> None:
    """Bound what one batch read makes us allocate: a hostile length must not become a huge buffer."""
    from threefs.common import limits

    total = 0
    for io in ios:
        if io.offset < 0 or not 0 <= io.length <= limits.CHUNK_SIZE_BYTES_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"read of chunk {io.chunk_id.hex()}: offset "
                               f"{io.offset} / length {io.length} out of range (length <= "
                               f"{limits.CHUNK_SIZE_BYTES_MAX})")
        total += align_up(io.length)
    if total > limits.FRAME_PAYLOAD_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"batch read of {len(ios)} IOs asks for {total} "
                           f"bytes, over the {limits.FRAME_PAYLOAD_BYTES_MAX} one response carries; split it")


_RESULT = struct.Struct(ss.READ_RESULT_FORMAT)
_IO = struct.Struct(ss.READ_IO_FORMAT)
_RESULT_BYTES = ss.READ_RESULT_BYTES


_ALIGN = IO_BUFFER_ALIGN
_ALIGN_MASK = _ALIGN - 1


def _zero_slots(out: memoryview, arr, ends, ks) -> None:
    """Zero the payload slots of IOs `ks` that failed as a group: the response carries every slot up to the
    last one read, and a pooled buffer holds bytes of earlier requests (other files' data)."""
    for k in ks:
        start = ends[k] - align_up(arr[k][4])
        out[start:ends[k]] = bytes(ends[k] - start)


def unpack_read_ios(packed: bytes) -> list[tuple[int, int, bytes, int, int]]:
    """(chain_id, target_id, chunk_id, offset, length) per IO record of a PackedReadReq."""
    if len(packed) % ss.READ_IO_BYTES:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"packed read of {len(packed)} bytes is not a whole "
                           f"number of {ss.READ_IO_BYTES}-byte IO records")
    return list(_IO.iter_unpack(packed))


def check_packed_ios(ios: list) -> list[int]:
    """check_read_ios for packed IOs; returns each IO's slot end in the payload (see PackedReadRsp).

    Plain Python, not numpy: a batch is at most a few hundred IOs, and on this machine each small numpy call
    cost 15-70 us under load (a request's dozen of them were the biggest fixed cost of a batch)."""
    from threefs.common import limits

    ends, total = [], 0
    top = limits.CHUNK_SIZE_BYTES_MAX
    append = ends.append
    for _, _, chunk_id, offset, length in ios:
        if length > top or offset > top:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"read of chunk {chunk_id.hex()}: offset "
                               f"{offset} / length {length} out of range (length <= "
                               f"{limits.CHUNK_SIZE_BYTES_MAX})")
        total += (length + _ALIGN - 1) // _ALIGN * _ALIGN
        append(total)
    if total > limits.FRAME_PAYLOAD_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"batch read of {len(ios)} IOs asks for {total} "
                           f"bytes, over the {limits.FRAME_PAYLOAD_BYTES_MAX} one response carries; split it")
    return ends


def fs_space(path: str) -> tuple[int, str]:
    """(free bytes, file system id) of the file system holding `path`, for capacity reports (meta.statfs);
    (0, "") if it cannot be read."""
    try:
        vfs, dev = os.statvfs(path), os.stat(path).st_dev
    except OSError:
        return 0, ""
    return vfs.f_bavail * vfs.f_frsize, str(dev)


class StorageService:
    def __init__(self, config: ServiceConfig, rpc_client: RpcClient, mgmtd: MgmtdClient):
        self.config = config
        self.rpc = rpc_client
        self.mgmtd = mgmtd
        self.engines: dict[int, ChunkEngine] = {}
        self.io_pool = ThreadPoolExecutor(max_workers=DISK_THREADS, thread_name_prefix="disk")
        self._locks = KeyedLocks()  # one lock per (target, chunk) while anyone holds or waits for it
        self.replica = craq.ReplicaState()  # exactly-once cache, update flows per target
        self.hb_version = 0
        self.problems = Problems()  # reported in heartbeats (`threefs status`)
        self.fence = HeartbeatFence(config.node_id, config.heartbeat_timeout_s, config.heartbeat_interval_s)
        self.resync = None  # set by the runner (storage.resync.Resyncer)
        self.scrubber = None  # set by the runner (storage.scrub.Scrubber)
        self.verified = VerifiedChunks()  # chunk versions read whole and checked (partial reads)
        self._probe = memoryview(bytearray(1))  # page-cache probes of zero-copy reads (see _zero_copy)
        self._scratch = memoryview(bytearray(256 << 10))  # parts read for their crc32c (_serve_regions)
        # whole cold chunks are read with O_DIRECT into these page-aligned buffers (_read_direct);
        # config.direct_reads = false (or THREEFS_DIRECT_READS=0 in the environment, to compare) reads them buffered
        # (reused, as the ordinary pool's: fresh memory costs a host fault per page)
        self.direct_pool = BufferPool(bytes_max=128 << 20, align=DIRECT_ALIGN)
        self.direct_reads = self.config.direct_reads and os.environ.get("THREEFS_DIRECT_READS", "1") != "0"
        self._tasks: set[asyncio.Task] = set()
        self._inline_paused_until = 0.0  # loop.time() until which updates go to the disk threads only
        self.inline_stats = {"inline": 0, "handed_over": 0, "slow": 0}
        self._flush_queued: set = set()  # engines whose owed journal flush is queued to a disk thread

    def open_targets(self) -> None:
        for t in self.config.targets:
            os.makedirs(t.path, exist_ok=True)
            self.engines[t.target_id] = open_chunk_engine(t.path, t.engine or self.config.chunk_engine,
                                                          fsync=self.config.fsync,
                                                          write_cache=self.config.write_cache)
        log.info("opened %d targets (chunk engines: %s)", len(self.engines),
                 ", ".join(sorted({type(e).__name__ for e in self.engines.values()})))

    def close(self) -> None:
        for task in list(self._tasks):  # background tasks it owns (scrub reports): they end with it
            task.cancel()
        for engine in self.engines.values():
            engine.close()
        self.io_pool.shutdown(wait=True)

    async def disk(self, fn, *args, **kwargs):
        """Run a chunk-engine call in the disk pool (it may block); disk failures are reported in heartbeats.
        A caller cancelled meanwhile (a request's deadline, its connection closed) returns only once the
        call has ended: the chunk lock it holds must cover the whole engine call (`locks.outlast`)."""
        try:
            result = await outlast(asyncio.get_running_loop().run_in_executor(self.io_pool,
                                                                              lambda: fn(*args, **kwargs)))
        except ThreeFSError as e:
            self._disk_failed(e)
            raise
        self.problems.clear("disk")
        return result

    def _disk_failed(self, e: ThreeFSError) -> None:
        """A chunk-engine call failed: reported in heartbeats when it is the disk, not the request."""
        if e.code in (StatusCode.NO_SPACE, StatusCode.IO_ERROR):
            self.problems.record("disk", f"disk operations fail: {e.message}")

    # -- membership ------------------------------------------------------------------------------
    def local_state(self, routing: Routing | None, target_id: int) -> str:
        """UPTODATE while mgmtd still counts this target as holding every acknowledged write; ONLINE
        otherwise (it must resync; mgmtd itself records when a resync finishes: sync_done)."""
        known = routing is not None and target_id in routing.info.targets
        return craq.local_state(routing.info.targets[target_id].public_state if known else None)

    async def register(self) -> None:
        req = ms.RegisterReq(self.config.node_id, ms.STORAGE, self.config.addr, socket.gethostname(),
                             self.config.failure_domain, sorted(self.engines))
        sent = self.fence.now()
        await self.mgmtd.call("register", req, ms.RegisterRsp)
        await self.mgmtd.refresh(force=True)
        self.fence.succeeded(sent)

    async def heartbeat_loop(self) -> None:
        """Runs for the service's lifetime; a missing mgmtd only delays the next beat."""
        await heartbeat_loop(self.config.name, self.config.heartbeat_interval_s, self.heartbeat_once,
                             self.register, on_failure=self.fence.note)

    async def heartbeat_once(self) -> None:
        routing = self.mgmtd.routing
        targets = [ms.LocalTarget(tid, self.local_state(routing, tid), *target_space(engine, fs_space))
                   for tid, engine in self.engines.items()]
        self.hb_version += 1
        syncs = sync_reports(self.resync, routing, self.engines)
        was_fenced = self.fence.fenced
        # routing_version: what we have seen. Our reads judge on this routing or newer, so once mgmtd
        # has it, a target it marked admin_offline serves no more reads here and may leave its chain.
        # Sent to every mgmtd at once (fence.heartbeat_every_mgmtd): a failover costs no call timeout.
        rsp, sent = await heartbeat_every_mgmtd(
            self.mgmtd, ms.HeartbeatReq(self.config.node_id, self.hb_version, targets, syncs,
                                        self.problems.current(), routing.version if routing else 0),
            ms.HeartbeatRsp, self.fence.call_timeout_s, clock=self.fence.now)
        if not was_fenced:
            self.fence.succeeded(sent)  # accepted: mgmtd counts us alive from now; the refresh may wait
        if was_fenced or routing is None or rsp.routing_version != routing.version:
            # unfence only with current routing: the view we were cut off with may name us wrongly
            await self.mgmtd.refresh()
        self.fence.succeeded(sent)

    # -- helpers ---------------------------------------------------------------------------------
    def _my_target(self, chain: ms.ChainInfo) -> int:
        return craq.local_target(chain, self.engines, f"node {self.config.node_id}")

    async def _chain_checked(self, chain_id: int, chain_ver: int) -> ms.ChainInfo:
        chain = await self._chain(chain_id)
        if chain_ver > chain.version:  # the caller saw a newer routing than ours
            chain = (await self.mgmtd.refresh()).chain(chain_id)
        craq.check_chain_version(chain, chain_ver)
        return chain

    async def _chain(self, chain_id: int) -> ms.ChainInfo:
        """The chain from our routing, refreshed once if we do not know it yet."""
        routing = await self.mgmtd.get()
        if chain_id not in routing.info.chains:
            routing = await self.mgmtd.refresh()
        return routing.chain(chain_id)

    def chunk_lock(self, target_id: int, chunk_id: bytes):
        """`async with svc.chunk_lock(t, c):` the per-chunk lock of target t (updates, resync, repair)."""
        return self._locks.hold((target_id, chunk_id))

    # -- write path ------------------------------------------------------------------------------
    @rpc(ss.UpdateReq)
    async def update(self, ctx: CallContext, req: ss.UpdateReq) -> ss.UpdateRsp:
        self.fence.check()
        payload = ctx.payload if ctx.payload is not None else memoryview(b"")
        if req.kind == ss.WRITE and crc32c.crc32c(payload) != req.crc:
            raise status_error(StatusCode.CHECKSUM_MISMATCH,
                               f"payload checksum mismatch for chunk {req.chunk_id.hex()} "
                               f"(corrupted in transit); retry")
        # the payload's crc32c, checked just now, goes to the engine with it (not computed a second time)
        return await self.run_flow(craq.serve_update_flow(self.engines, req, payload, self.replica,
                                                          req.crc if req.kind == ss.WRITE else None))

    async def run_flow(self, flow):
        """Drive a CRAQ flow (storage/craq.py) with this service's effects; the chunk lock it takes is
        released when it ends, however it ends."""
        held = contextlib.AsyncExitStack()
        store = None

        async def perform(e):
            nonlocal store
            if isinstance(e, craq.ChainView):
                chain = await self._chain(e.chain_id)
                if e.at_least > chain.version:  # the caller saw a newer routing than ours
                    chain = (await self.mgmtd.refresh()).chain(e.chain_id)
                return chain
            if isinstance(e, craq.LockChunk):
                await held.enter_async_context(self.chunk_lock(e.target_id, e.chunk_id))
                store = self._effects(e.target_id)
                return None
            if store is None:
                raise AssertionError(f"{e!r} before the flow took a chunk lock")
            return await store(e)

        async with held:
            return await craq.drive(flow, perform)

    async def quiet_below(self, me: int, chain_ver: int) -> None:
        """Wait until no update flow admitted under an older version of the chain runs at `me`."""
        flows = self.replica.tracker(me)
        done = asyncio.get_running_loop().create_future()
        flows.when_quiet_below(chain_ver, lambda: done.done() or done.set_result(None))
        # A flow ends within its forwarding window (it gives up after craq.FORWARD_RETRY_S) plus a
        # call's timeout; past that something is wrong, and the resync that waits here retries.
        limit = craq.FORWARD_RETRY_S + 2 * self.config.heartbeat_timeout_s
        try:
            async with asyncio.timeout(limit):
                await done
        except TimeoutError:
            raise status_error(StatusCode.TIMEOUT, f"update flows of target {me} admitted before chain "
                               f"v{chain_ver} still run after {limit:.0f} s") from None

    def _effects(self, me: int):
        """The real effects of the CRAQ flows at target `me` (see storage/craq.py)."""
        engine = self.engines[me]
        inline_capable = getattr(engine, "inline_capable", False)

        async def perform(e):
            if isinstance(e, craq.GetMeta):
                return engine.get_meta(e.chunk_id)
            if isinstance(e, (craq.Write, craq.Commit)) and inline_capable:
                if isinstance(e, craq.Commit) or len(e.data) <= INLINE_UPDATE_BYTES_MAX:
                    done, result = self._update_inline(engine, e)
                    if done:
                        return result
            if isinstance(e, craq.STORE_EFFECTS):
                return await self.disk(craq.apply_to_store, engine, e)
            if isinstance(e, craq.Forward):
                routing = await self.mgmtd.get()
                # a successor silent for a heartbeat timeout is being failed by mgmtd: give up on this
                # attempt and let the flow refresh routing (a cut link must not stall writes for 30 s)
                rsp, _ = await self.rpc.call(routing.target_addr(e.target_id), "storage.update", e.req,
                                             ss.UpdateRsp, payload=e.payload,
                                             timeout=self.config.heartbeat_timeout_s)
                return rsp
            if isinstance(e, craq.RefreshChain):
                return (await self.mgmtd.refresh()).chain(e.chain_id)
            if isinstance(e, craq.ReportDamage):
                if self.scrubber is not None:  # after this flow releases the chunk lock the repair takes
                    self._background(self.scrubber.report(e.target_id, e.chunk_id, e.found_by))
                return None
            if isinstance(e, craq.Sleep):
                return await asyncio.sleep(e.seconds)
            if isinstance(e, craq.Now):
                return asyncio.get_running_loop().time()
            raise AssertionError(f"unknown effect {e!r}")

        return perform

    def _update_inline(self, engine, e) -> tuple[bool, object]:
        """(True, result) of a write or commit run right here on the loop, or (False, None) when it would
        wait for the disk (the engine says so before waiting: ChunkEngineV2.inline) or inline updates are
        paused: the caller hands it to a disk thread then. Errors are the engine's, as from `disk`."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._inline_paused_until:
            return False, None
        started = time.perf_counter()
        try:
            with engine.inline():
                result = craq.apply_to_store(engine, e)
        except BlockingIOError:
            self.inline_stats["handed_over"] += 1
            return False, None
        except ThreeFSError as err:
            self._disk_failed(err)
            raise
        finally:
            took = time.perf_counter() - started
            if took > INLINE_SLOW_S:
                self.inline_stats["slow"] += 1
                self._inline_paused_until = loop.time() + INLINE_PAUSE_S
                log.info("an inline update took %.1f ms (page-cache writeback?): updates go to the disk threads "
                         "for %.0f s", took * 1e3, INLINE_PAUSE_S)
        self.inline_stats["inline"] += 1
        self.problems.clear("disk")
        if engine.flush_due and engine not in self._flush_queued:  # the journal's flush into SQLite: in a thread
            self._flush_queued.add(engine)
            try:
                self.io_pool.submit(self._flush_owed, engine)
            except RuntimeError:  # the pool is shut down (the service is closing): the next open replays
                self._flush_queued.discard(engine)
        return True, result

    def _flush_owed(self, engine) -> None:
        """In a disk thread: the journal flush that inline updates left owed (one queued per engine)."""
        try:
            engine.flush_owed()
        finally:
            self._flush_queued.discard(engine)

    # -- read path -------------------------------------------------------------------------------
    @rpc(ss.BatchReadReq)
    async def batch_read(self, ctx: CallContext, req: ss.BatchReadReq):
        self.fence.check()
        check_read_ios(req.ios)
        routing = await self.mgmtd.get()
        for io in req.ios:
            target = routing.info.targets.get(io.target_id)
            if io.target_id in self.engines and (target is None or target.public_state != ms.SERVING
                                                 or target.admin_offline):
                routing = await self.mgmtd.refresh()  # maybe we are behind; then judge again
                break
        lease = ctx.conn.server.pool.acquire(sum(align_up(io.length) for io in req.ios))
        try:
            try:  # page-cache hits are served inline; a miss goes to the disk threads
                results, used = self._read_batch(req, routing, lease.view, nowait=True)
            except BlockingIOError:
                results, used = await self.disk(self._read_batch, req, routing, lease.view)
        except BaseException:
            lease.release()
            raise
        lease.view = lease.view[:used]
        if req.request_to_send and used:  # receiver-paced: wait for the client's grant (or time out)
            await ctx.request_to_send(ctx.rid, RTS_TIMEOUT_S)
        for io, res in zip(req.ios, results):
            if res.status == StatusCode.CHECKSUM_MISMATCH and self.scrubber is not None:
                self._background(self.scrubber.report(io.target_id, io.chunk_id, "read"))
        return ss.BatchReadRsp(results), lease

    @rpc(ss.PackedReadReq)
    async def read_packed(self, ctx: CallContext, req: ss.PackedReadReq):
        """storage.read_packed: a batch of IOs as packed records (see PackedReadReq), served in one pass:
        page-cache hits inline, the misses in one hop to the disk threads. No Python object per IO on the
        common path (committed chunks of a v2 engine, see _serve_fast): the chunk locations of a target's IOs
        are looked up under one engine lock, each result packed in place."""
        self.fence.check()
        arr = unpack_read_ios(req.ios)
        ends = check_packed_ios(arr)
        n = len(arr)
        routing = await self.mgmtd.get()
        tids = list({io[1] for io in arr})
        for tid in tids:
            target = routing.info.targets.get(tid)
            if tid in self.engines and (target is None or target.public_state != ms.SERVING or target.admin_offline):
                routing = await self.mgmtd.refresh()  # maybe we are behind; then judge again
                break
        if req.zero_copy and n and not req.allow_uncommitted:
            if n == 1:
                sent = self._zero_copy(arr, routing, ctx)
                if sent is not None and len(sent) == 3:  # (engine, loc, epoch): not in the page cache: O_DIRECT
                    sent = await self._read_direct(*sent)
            else:
                sent = await self._zero_copy_many(ctx, arr, ends, routing)
            if sent is not None:
                if req.request_to_send and len(sent[1].view):
                    try:
                        await ctx.request_to_send(ctx.rid, RTS_TIMEOUT_S)
                    except BaseException:
                        sent[1].release()
                        raise
                return sent
        rsp, lease = await self._serve_ordinary(ctx, arr, tids, ends, routing, req.allow_uncommitted)
        if req.request_to_send and len(lease.view):  # receiver-paced: wait for the client's grant (or time out)
            try:
                await ctx.request_to_send(ctx.rid, RTS_TIMEOUT_S)
            except BaseException:
                lease.release()
                raise
        return rsp, lease

    async def _serve_ordinary(self, ctx: CallContext, arr, tids: list, ends, routing: Routing,
                              allow_uncommitted: bool) -> tuple[ss.PackedReadRsp, object]:
        """(response, Lease of a pooled buffer) of a packed batch read into one buffer: page-cache hits
        inline, the rest in one hop to the disk threads."""
        n = len(arr)
        lease = ctx.conn.server.pool.acquire(ends[-1] if n else 0)
        results = bytearray(n * ss.READ_RESULT_BYTES)
        messages: dict[int, str] = {}
        try:
            blocked = self._serve_packed(arr, tids, ends, routing, allow_uncommitted, lease.view, results,
                                         messages, True)
            if blocked:
                await self.disk(self._serve_blocked, arr, blocked, ends, routing, allow_uncommitted,
                                lease.view, results, messages)
        except BaseException:
            lease.release()
            raise
        used = 0
        for k in range(n - 1, -1, -1):  # trim the payload after the last byte sent
            length = _RESULT.unpack_from(results, k * _RESULT_BYTES)[1]
            if length:
                used = ends[k] - align_up(arr[k][4]) + length
                break
        lease.view = lease.view[:used]
        for k in messages:
            if _RESULT.unpack_from(results, k * _RESULT_BYTES)[0] == StatusCode.CHECKSUM_MISMATCH:
                if self.scrubber is not None:
                    self._background(self.scrubber.report(arr[k][1], arr[k][2], "read"))
        return ss.PackedReadRsp(bytes(results), messages), lease

    async def _zero_copy_many(self, ctx: CallContext, arr, ends, routing: Routing):
        """(response, FileLease) of a zero-copy packed read of several IOs (the client checks every IO on
        arrival), sent as one payload of file regions and buffers in slot order (FilePayload.of_parts, zeros
        where a slot is not filled, trimmed after the last byte sent):
        - an IO of a whole committed chunk is answered as a request of its own would be (_zero_copy: a
          region of its data file when it is in the page cache, else read with O_DIRECT, those at once);
        - a part of a chunk version already checked whole, in the page cache, is read once into a scratch
          buffer for its crc32c and sent from the data file (_serve_regions): no copy into a payload buffer
          and no send copy (at 64 KiB those two copies were half of a storage service's CPU);
        - anything else (a hole, a pending version, a first partial read of a version, a cold part, an
          error) takes the ordinary path, all of them in one pass.
        One request, one handler and one send for the whole batch (a sequential batch_read of 1 MiB chunks:
        the client's and the server's per-request Python was a third of their CPU)."""
        n = len(arr)
        answers: list = [None] * n  # per IO: (result record, message or None, parts, bytes sent)
        holds: list = []  # what the send holds (leases, read epochs): released once it is over
        try:
            cold = []  # (k, engine, loc, epoch): whole chunks not in the page cache
            partial: dict[int, list[int]] = {}  # target -> IOs that are parts of chunks
            for k in range(n):
                sent = self._zero_copy(arr[k:k + 1], routing, ctx) if arr[k][3] == 0 else None
                if sent is None:
                    partial.setdefault(arr[k][1], []).append(k)
                elif len(sent) == 3:
                    cold.append((k, *sent))
                else:
                    self._answer(answers, holds, k, sent)
            if cold:  # read with O_DIRECT, all at once (as they were when each was a request of its own)
                handed, cold, direct = cold, [], [None] * n
                await self._read_direct_many(handed, direct)  # (it ends their read epochs)
                for k, _, _, _ in handed:
                    if direct[k] is None:
                        partial.setdefault(arr[k][1], []).append(k)
                    else:
                        self._answer(answers, holds, k, direct[k])
            for tid, ks in partial.items():
                self._serve_regions(tid, arr, ks, routing, answers, holds)
            rest = [k for k in range(n) if answers[k] is None]
            if rest:  # the ordinary path, in one pass
                sub = [arr[k] for k in rest]
                sub_ends = check_packed_ios(sub)
                rsp, lease = await self._serve_ordinary(ctx, sub, list({io[1] for io in sub}), sub_ends, routing,
                                                        False)
                holds.append(lease)
                for j, k in enumerate(rest):
                    record = rsp.results[j * _RESULT_BYTES:(j + 1) * _RESULT_BYTES]
                    got = _RESULT.unpack_from(record, 0)[1]
                    start = sub_ends[j] - align_up(sub[j][4])
                    answers[k] = (record, rsp.messages.get(j), [lease.view[start:start + got]] if got else [], got)
        except BaseException:
            for _, engine, _, epoch in cold:
                engine.end_reads(epoch)
            for one in holds:
                one.release()
            raise
        results, messages, parts, cached = [], {}, [], True
        last = max((k for k in range(n) if answers[k][3]), default=-1)
        for k, (record, message, mine, got) in enumerate(answers):
            results.append(record)
            if message is not None:
                messages[k] = message
            if k > last:
                continue
            parts += mine
            fill = (0 if k == last else align_up(arr[k][4])) - got
            if fill > 0:
                parts.append(bytes(fill))
        for one in holds:
            view = getattr(one, "view", None)
            if type(view) is FilePayload and not view.cached:
                cached = False  # (regions of _serve_regions were read just now: in the page cache)

        def done() -> None:
            for one in holds:
                one.release()

        payload = FilePayload.of_parts(parts, max(1.0, ctx.remaining()), cached)
        return ss.PackedReadRsp(b"".join(results), messages), FileLease(payload, done)

    @staticmethod
    def _answer(answers: list, holds: list, k: int, sent: tuple) -> None:
        """IO k's answer from a (response, lease) of one IO (_zero_copy, _read_direct)."""
        rsp, lease = sent
        holds.append(lease)
        view = lease.view
        got = _RESULT.unpack_from(rsp.results, 0)[1]
        answers[k] = (rsp.results, rsp.messages.get(0), list(view.parts) if type(view) is FilePayload
                      else ([view] if len(view) else []), got)

    def _serve_regions(self, tid: int, arr, ks: list[int], routing: Routing, answers: list, holds: list) -> None:
        """Parts of committed chunks of target `tid` (IOs `ks`) answered as regions of the data file: each
        read once into a scratch buffer for its crc32c (RWF_NOWAIT: page-cache hits only), the region sent
        later with sendfile. The chunk's blocks stay owned by the read until the send is over (the read epoch
        is held). The same choices as _serve_fast; what it does not serve (a hole, a pending version, a first
        partial read of a version, past the end, a miss, a fold meanwhile) it leaves to the ordinary path.
        The bytes sent may differ from those checksummed only if a fold wrote into the block meanwhile: the
        client checks every IO of a zero-copy request on arrival (and reads another replica then)."""
        engine = self.engines.get(tid)
        if engine is None or not hasattr(engine, "read_locations"):
            return
        target = routing.info.targets.get(tid)
        try:
            craq.read_check(tid, target.public_state if target else None, None, False,
                            target is not None and target.admin_offline)
        except ThreeFSError:
            return  # the ordinary path answers with the reason
        locs, epoch, folds = engine.read_locations([arr[k][2] for k in ks], with_folds=True)
        preadv, crc, pack, seen = os.preadv, crc32c.crc32c, _RESULT.pack, self.verified.seen
        scratch = self._scratch
        served = []
        try:
            for k, loc in zip(ks, locs):
                if not loc:
                    continue
                _, _, cid, off, ln = arr[k]
                fd, base, size, ver, ccrc = loc
                count = size - off
                if count > ln:
                    count = ln
                if count < REGION_BYTES_MIN or (off == 0 and ln >= size) or (size <= VERIFY_WHOLE_BYTES_MAX
                                                                         and (tid, cid, ver, ccrc) not in seen):
                    continue  # small (or past the end), a whole chunk, a first partial read of this version
                if len(scratch) < count:
                    scratch = self._scratch = memoryview(bytearray(count))
                view = scratch[:count]
                try:
                    if preadv(fd, (view,), base + off, os.RWF_NOWAIT) != count:
                        continue
                except OSError:  # BlockingIOError: not in the page cache; EOPNOTSUPP: no RWF_NOWAIT
                    continue
                answers[k] = (pack(0, count, ver, ccrc, crc(view)), None, [(fd, base + off, count)], count)
                served.append(k)
            if engine.folds != folds:  # a fold may have written into a block being read: the ordinary path
                for k in served:
                    answers[k] = None
                served = []
        finally:
            if served:
                holds.append(_EpochHold(engine, epoch))
            else:
                engine.end_reads(epoch)

    def _zero_copy(self, arr, routing: Routing, ctx: CallContext):
        """(response, FileLease) sending one IO that covers a whole committed chunk of a v2 engine straight
        from its data file (os.sendfile: no read into a buffer, no send copy), or None when this IO takes the
        ordinary path (not a whole committed chunk, a small one, a target that refuses, another engine).

        The bytes are not checked against the chunk's write-time checksum here: the result's data_crc is that
        checksum, and the client checks what arrives against it (or verifies the bytes end to end itself),
        and reports a damaged copy back (report_damage). The chunk's blocks stay owned by this read until the
        send is over (FileLease.release ends the engine's read epoch)."""
        _, tid, cid, off, ln = arr[0]
        engine = self.engines.get(tid)
        if off or ln < ZERO_COPY_BYTES_MIN or engine is None or not hasattr(engine, "read_locations"):
            return None
        target = routing.info.targets.get(tid)
        try:
            craq.read_check(tid, target.public_state if target else None, None, False,
                            target is not None and target.admin_offline)
        except ThreeFSError:
            return None  # the ordinary path answers with the reason
        locs, epoch = engine.read_locations([cid])
        loc = locs[0]
        if not loc or ln < loc[2]:
            engine.end_reads(epoch)
            return None
        fd, base, size, ver, crc = loc
        # Only chunks wholly in the page cache (page_cache_holds): a cold chunk read by sendfile comes off the
        # disk in 64 KiB splices behind the socket, which made cold checkpoint loads slower (0.52-0.54x
        # against 0.64-0.66x safetensors in alternating runs). A cold chunk is read with O_DIRECT into a
        # pooled buffer instead (see _read_direct): the caller gets (engine, loc, epoch).
        try:
            cached = page_cache_holds(fd, base, size)
            if cached is None:  # no cachestat: probe both ends and the middle (they may start a readahead)
                probe = self._probe
                for at in (base, base + size // 2, base + size - 1):
                    if os.preadv(fd, (probe,), at, os.RWF_NOWAIT) != 1:
                        raise BlockingIOError
            elif not cached:
                raise BlockingIOError
        except BlockingIOError:
            if self.direct_reads and base % DIRECT_ALIGN == 0 and hasattr(engine, "read_direct"):
                return engine, loc, epoch
            engine.end_reads(epoch)
            return None
        except OSError:  # EOPNOTSUPP: no RWF_NOWAIT here
            engine.end_reads(epoch)
            return None
        results = _RESULT.pack(0, size, ver, crc, crc)
        # cached None: found by probes, not known for every page (the send then goes to the thread)
        payload = FilePayload(fd, base, size, max(1.0, ctx.remaining()), cached=bool(cached))
        return ss.PackedReadRsp(results, {}), FileLease(payload, lambda: engine.end_reads(epoch))

    async def _read_direct_many(self, cold: list, answers: list) -> None:
        """Whole committed chunks (k, engine, loc, epoch) not in the page cache, read with O_DIRECT at once, each
        in a disk thread into a page-aligned pooled buffer (engine.read_direct): answers[k] becomes (response,
        Lease), or stays None (O_DIRECT unavailable, a short read: the ordinary path then reads it). Every
        epoch is ended here, and on an error every buffer goes back (see _read_direct for why, and what the
        result's data_crc is)."""
        leases: list = [None] * len(cold)

        async def one(i: int, engine, loc) -> int:
            leases[i] = self.direct_pool.acquire(align_up(loc[2], DIRECT_ALIGN))
            return await self.disk(engine.read_direct, loc[0], loc[1], leases[i].view)

        try:
            got = await asyncio.gather(*(one(i, engine, loc) for i, (_, engine, loc, _) in enumerate(cold)),
                                       return_exceptions=True)
            failed = next((g for g in got if isinstance(g, BaseException)), None)
            if failed is not None:
                raise failed
        except BaseException:
            for lease in leases:
                if lease is not None:
                    lease.release()
            raise
        finally:
            for _, engine, _, epoch in cold:
                engine.end_reads(epoch)
        for (k, _, loc, _), lease, g in zip(cold, leases, got):
            _, _, size, ver, crc = loc
            if g < size:  # -1: no O_DIRECT; short: the data file ends early (the ordinary path says so)
                lease.release()
                continue
            lease.view = lease.view[:size]
            answers[k] = (ss.PackedReadRsp(_RESULT.pack(0, size, ver, crc, crc), {}), lease)

    async def _read_direct(self, engine, loc, epoch):
        """(response, Lease) of a whole committed chunk not in the page cache, read with O_DIRECT in a disk
        thread into a page-aligned pooled buffer (engine.read_direct), or None (then the ordinary path reads
        it: O_DIRECT unavailable, a short read).

        Why: on this kind of VM a buffered read of cold data costs 1.5-1.9 CPU-s per GB, nearly all of it in
        the copy out of the page-cache pages the read just filled (fresh memory: the first touch of each
        page faults in the host); O_DIRECT into a buffer used before costs 0.08-0.11 (docs/chunk-engine.md
        "Cold reads"). The chunk does not stay in the page cache (a second read goes to the disk again).

        As with sendfile, the bytes are not checked here: the result's data_crc is the chunk's write-time
        checksum and the client checks what arrives against it (and reports a damaged copy: report_damage)."""
        answers = [None]
        await self._read_direct_many([(0, engine, loc, epoch)], answers)
        return answers[0]

    @rpc(ss.ReportDamageReq)
    async def report_damage(self, ctx: CallContext, req: ss.ReportDamageReq) -> ss.ReportDamageRsp:
        """A client found a chunk of a zero-copy read damaged on arrival: check our copy, repair it if bad
        (bytes damaged on the way are not the copy's fault: then nothing happens)."""
        engine = self.engines.get(req.target_id)
        if engine is None:
            raise status_error(StatusCode.TARGET_NOT_FOUND, f"target {req.target_id} is not on node "
                               f"{self.config.node_id}")
        try:
            good = await self.disk(engine.verify, req.chunk_id)
        except ThreeFSError as e:
            if e.code != StatusCode.CHUNK_NOT_FOUND:
                raise
            return ss.ReportDamageRsp(False)  # removed meanwhile
        if not good and self.scrubber is not None:
            self._background(self.scrubber.report(req.target_id, req.chunk_id, "read"))
        return ss.ReportDamageRsp(not good)

    def _serve_packed(self, arr, tids: list, ends, routing: Routing, allow_uncommitted: bool, out: memoryview,
                      results: bytearray, messages: dict, nowait: bool) -> list:
        """One pass over a packed batch: per target, refuse its IOs (target not here, not SERVING) or serve
        them. Returns [(target id, IO indices)] that would wait for the disk (nowait)."""
        blocked = []
        targets, node = routing.info.targets, self.config.node_id
        if len(tids) == 1:
            groups = {tids[0]: list(range(len(arr)))}
        else:
            groups = {}
            for k, io in enumerate(arr):
                groups.setdefault(io[1], []).append(k)
        pack = _RESULT.pack_into
        for tid, ks in groups.items():
            engine = self.engines.get(tid)
            if engine is None:
                for k in ks:
                    pack(results, k * _RESULT_BYTES, int(StatusCode.TARGET_NOT_FOUND), 0, 0, 0, 0)
                messages.update(dict.fromkeys(ks, f"target {tid} is not on node {node}"))
                _zero_slots(out, arr, ends, ks)
                continue
            target = targets.get(tid)
            try:
                craq.read_check(tid, target.public_state if target else None, None, allow_uncommitted,
                                target is not None and target.admin_offline)
            except ThreeFSError as e:
                for k in ks:
                    pack(results, k * _RESULT_BYTES, int(e.code), 0, 0, 0, 0)
                messages.update(dict.fromkeys(ks, e.message))
                _zero_slots(out, arr, ends, ks)
                continue
            if allow_uncommitted or not hasattr(engine, "read_locations"):
                left = self._read_packed(arr, ks, ends, routing, allow_uncommitted, out, results,
                                         messages, nowait)
            else:
                left = self._serve_fast(engine, tid, arr, ks, ends, out, results, messages, nowait)
            if left:
                blocked.append((tid, left))
        return blocked

    def _serve_blocked(self, arr, blocked: list, ends, routing: Routing, allow_uncommitted: bool, out: memoryview,
                       results: bytearray, messages: dict) -> None:
        """Runs in the disk pool: the IOs the inline pass left because they wait for the disk."""
        for tid, ks in blocked:
            engine = self.engines[tid]
            if allow_uncommitted or not hasattr(engine, "read_locations"):
                self._read_packed(arr, ks, ends, routing, allow_uncommitted, out, results, messages, False)
            else:
                self._serve_fast(engine, tid, arr, ks, ends, out, results, messages, False)

    def _serve_fast(self, engine, tid: int, arr, ks, ends, out: memoryview, results: bytearray, messages: dict,
                    nowait: bool) -> list[int]:
        """Committed reads of target `tid`'s IOs `ks` from a v2 engine: the chunk locations of all of them in
        one engine call, then one preadv per IO straight into its slot and a crc32c of what was read; the
        per-IO loop allocates nothing but the slot views. IOs it cannot serve this way (holes need no read;
        a pending version, an overlay, a short read, a partial read of a chunk version not yet checked here)
        go through _read_committed one by one. Same answers as _read_committed; returns the IOs that would
        wait for the disk (nowait). If a fold began meanwhile (a version committed over an overlay writes into
        its block: engine.folds), the IOs read here are read again through engine.read, which re-reads such a
        race until it did not happen: never a mix of two versions."""
        ios = [arr[k] for k in ks]
        locs, epoch, folds = engine.read_locations([io[2] for io in ios], with_folds=True)
        flags = os.RWF_NOWAIT if nowait else 0
        preadv, crc, pack = os.preadv, crc32c.crc32c, _RESULT.pack_into
        seen = self.verified.seen  # (VerifiedChunks.__contains__ without the call)
        slow, blocked, zero, read = [], [], [], []
        try:
            for k, (_, _, cid, off, ln), loc in zip(ks, ios, locs):
                s = ends[k] - (ln + _ALIGN - 1) // _ALIGN * _ALIGN
                if ln & _ALIGN_MASK:  # the slot's alignment pad is sent too: zeros, never stale pool bytes
                    zero.append((s + ln, ends[k] - s - ln))
                if not loc:
                    if loc is None:  # never written, or removed: a hole (the client fills zeros)
                        zero.append((s, ln))
                    else:
                        slow.append(k)
                    continue
                fd, base, size, ver, ccrc = loc
                count = size - off
                if count > ln:
                    count = ln
                if count <= 0 or (not (off == 0 and ln >= size) and size <= VERIFY_WHOLE_BYTES_MAX
                                  and (tid, cid, ver, ccrc) not in seen):
                    slow.append(k)  # past the end, or a first partial read of this version: checked whole
                    continue
                dest = out[s:s + count]
                try:
                    if preadv(fd, (dest,), base + off, flags) != count:
                        slow.append(k)
                        continue
                except BlockingIOError:
                    blocked.append(k)
                    continue
                except OSError as e:
                    if e.errno != errno.EOPNOTSUPP or not nowait:
                        raise
                    blocked.append(k)  # a file system without RWF_NOWAIT (tmpfs): the disk threads read it
                    continue
                dcrc = crc(dest)
                if off == 0 and ln >= size and dcrc != ccrc:  # a whole chunk: its write-time checksum
                    slow.append(k)  # (the general path answers CHECKSUM_MISMATCH with its message)
                    continue
                pack(results, k * _RESULT_BYTES, 0, count, ver, ccrc, dcrc)
                read.append(k)
                if count < ln:
                    zero.append((s + count, ln - count))
            if engine.folds != folds:  # a fold may have written into a block being read: read them again
                slow += read  # (engine.read: it looks up the committed version again)
        finally:
            engine.end_reads(epoch)
        for s, ln in zero:  # the slot's tail is sent: never stale pool bytes
            out[s:s + ln] = bytes(ln)
        if slow:
            blocked += self._read_packed(arr, slow, ends, None, False, out, results, messages, nowait)
        return blocked

    def _read_packed(self, arr, which, ends, routing: Routing | None, allow_uncommitted: bool,
                     out: memoryview, results: bytearray, messages: dict, nowait: bool) -> list[int]:
        """Serve IOs `which` of a packed batch (`arr`, slot ends `ends`) one by one into their slots of
        `out`, their results into `results`: the general path (uncommitted reads, v1 engines, and what
        _serve_fast leaves). With nowait, IOs that would wait for the disk are skipped and returned (the
        caller sends them to the disk threads in one hop). routing None: the targets were judged already.

        Same checks as _read_one, in the order that costs least for the common IO (a committed chunk read
        in part): read first, then judge the metadata the read returned (one engine lookup per IO)."""
        blocked = []
        engines, node, verified = self.engines, self.config.node_id, self.verified
        targets = routing.info.targets if routing is not None else {}
        pack = _RESULT.pack_into
        refused: dict[int, ThreeFSError | None] = {}  # per target: why it serves no reads, or None
        for k in which:
            chain_id, target_id, chunk_id, offset, length = io = arr[k]
            at = k * ss.READ_RESULT_BYTES
            engine = engines.get(target_id)
            start = ends[k] - align_up(length)
            if engine is None:
                pack(results, at, int(StatusCode.TARGET_NOT_FOUND), 0, 0, 0, 0)
                messages[k] = f"target {target_id} is not on node {node}"
                out[start:ends[k]] = bytes(ends[k] - start)
                continue
            if routing is None:
                refused[target_id] = None
            if target_id not in refused:
                target = targets.get(target_id)
                try:
                    craq.read_check(target_id, target.public_state if target else None, None, allow_uncommitted,
                                    target is not None and target.admin_offline)
                    refused[target_id] = None
                except ThreeFSError as e:
                    refused[target_id] = e
            why = refused[target_id]
            if why is not None:
                pack(results, at, int(why.code), 0, 0, 0, 0)
                messages[k] = why.message
                out[start:ends[k]] = bytes(ends[k] - start)
                continue
            dest = out[start:start + length]
            try:
                if allow_uncommitted:
                    target = targets.get(target_id)
                    res = self._read_one(engine, ss.ReadIO(*io), target.public_state if target else None, True,
                                         dest, nowait, False, verified)
                    status, got, commit_ver, chunk_crc, data_crc, message = (
                        res.status, res.length, res.commit_ver, res.chunk_crc, res.data_crc, res.message)
                else:
                    status, got, commit_ver, chunk_crc, data_crc, message = self._read_committed(
                        engine, target_id, chunk_id, offset, length, dest, nowait, verified)
            except BlockingIOError:
                blocked.append(k)
                continue
            except OSError as e:
                if not nowait or e.errno != errno.EOPNOTSUPP:
                    raise
                blocked.append(k)  # a file system without RWF_NOWAIT (tmpfs): the disk threads read it
                continue
            pack(results, at, status, got, commit_ver, chunk_crc, data_crc)
            if status:
                messages[k] = message
                got = 0  # what an error left in the slot is not sent as data either
            if got < ends[k] - start:  # the slot's tail and pad are sent: zeros, never stale pool bytes
                out[start + got:ends[k]] = bytes(ends[k] - start - got)
        return blocked

    @staticmethod
    def _read_committed(engine, target_id: int, chunk_id: bytes, offset: int, length: int, dest: memoryview,
                        nowait: bool, verified: VerifiedChunks) -> tuple:
        """(status, length, commit_ver, chunk_crc, data_crc, message) of a read of the committed version
        by a reader that may not see uncommitted data; the target already judged SERVING."""
        try:
            data, meta = engine.read(chunk_id, offset, length, dest, nowait=nowait)
        except ThreeFSError as e:
            if e.code == StatusCode.CHUNK_NOT_FOUND:  # never written, or removed: a hole
                return 0, 0, 0, 0, 0, ""
            return int(e.code), 0, 0, 0, 0, e.message
        if meta.update_ver != meta.commit_ver:  # a pending version: the client reads another replica
            return (int(StatusCode.CHUNK_NOT_COMMIT), 0, 0, 0, 0,
                    f"chunk {chunk_id.hex()} has a pending update")
        data_crc = crc32c.crc32c(data)
        if offset == 0 and length >= meta.length:  # a whole chunk: checked against its write-time checksum
            if data_crc != meta.crc:
                return (int(StatusCode.CHECKSUM_MISMATCH), 0, 0, 0, 0,
                        f"chunk {chunk_id.hex()} on target {target_id} fails its checksum; read another "
                        "replica (repair started)")
        elif (0 < meta.length <= VERIFY_WHOLE_BYTES_MAX
              and (target_id, chunk_id, meta.commit_ver, meta.crc) not in verified):
            res = StorageService._read_part_checked(engine, ss.ReadIO(0, target_id, chunk_id, offset, length),
                                                    dest, nowait, verified)
            return res.status, res.length, res.commit_ver, res.chunk_crc, res.data_crc, res.message
        return 0, len(data), meta.commit_ver, meta.crc, data_crc, ""

    def _background(self, coro) -> None:
        """Run a task owned by the service (kept referenced; errors are logged by the task itself)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _read_batch(self, req: ss.BatchReadReq, routing: Routing, out: memoryview, nowait: bool = False):
        """Runs in the disk pool: IO k's bytes land in `out` at its slot, aligned (see BatchReadRsp)."""
        results, pos, end = [], 0, 0
        for io in req.ios:
            engine = self.engines.get(io.target_id)
            target = routing.info.targets.get(io.target_id)
            if engine is None:
                results.append(ss.ReadResult(int(StatusCode.TARGET_NOT_FOUND), 0,
                                             f"target {io.target_id} is not on node {self.config.node_id}"))
                continue
            results.append(self._read_one(engine, io, target.public_state if target else None,
                                          req.allow_uncommitted, out[pos:pos + io.length], nowait,
                                          target is not None and target.admin_offline, self.verified))
            if pos > end:  # the pad before this IO's bytes is sent: zeros, never stale pool bytes
                out[end:pos] = bytes(pos - end)
            end = pos + results[-1].length
            pos = align_up(end)
        return results, end

    @staticmethod
    def _read_one(engine: ChunkEngine, io: ss.ReadIO, public_state: str | None, allow_uncommitted: bool,
                  out: memoryview, nowait: bool = False, admin_offline: bool = False,
                  verified: VerifiedChunks | None = None):
        meta = engine.get_meta(io.chunk_id)
        try:
            craq.read_check(io.target_id, public_state, meta, allow_uncommitted, admin_offline)
        except ThreeFSError as e:
            return ss.ReadResult(int(e.code), 0, e.message)
        if meta is None:
            return ss.ReadResult(0, 0)  # a hole: the client fills zeros
        verify = io.offset == 0 and io.length >= meta.length and meta.update_ver == meta.commit_ver
        if (not verify and verified is not None and meta.update_ver == meta.commit_ver and not allow_uncommitted
                and 0 < meta.length <= VERIFY_WHOLE_BYTES_MAX
                and (io.target_id, io.chunk_id, meta.commit_ver, meta.crc) not in verified):
            return StorageService._read_part_checked(engine, io, out, nowait, verified)
        try:
            data, meta = engine.read(io.chunk_id, io.offset, io.length, out,
                                     pending=allow_uncommitted and meta.update_ver != meta.commit_ver,
                                     nowait=nowait)
        except ThreeFSError as e:
            if e.code == StatusCode.CHUNK_NOT_FOUND:  # removed meanwhile: a hole
                return ss.ReadResult(0, 0)
            return ss.ReadResult(int(e.code), 0, e.message)
        if verify and len(data) != meta.length and verified is not None:
            # committed anew (longer) between the two lookups: this is part of that version, checked whole
            # (whatever is pending by now: _read_part_checked checks the committed bytes)
            return StorageService._read_part_checked(engine, io, out, nowait, verified)
        data_crc = crc32c.crc32c(data)  # ~20 GB/s: cheap beside the rest of a read
        if verify and len(data) == meta.length and data_crc != meta.crc:  # checked against its write-time crc
            return ss.ReadResult(int(StatusCode.CHECKSUM_MISMATCH), 0,
                                 f"chunk {io.chunk_id.hex()} on target {io.target_id} fails its checksum; "
                                 "read another replica (repair started)")
        return ss.ReadResult(0, len(data), "", meta.commit_ver, meta.crc, data_crc)

    @staticmethod
    def _read_part_checked(engine: ChunkEngine, io: ss.ReadIO, out: memoryview, nowait: bool,
                           verified: VerifiedChunks):
        """A partial read of a chunk version not yet checked here: read it whole, check it against its
        write-time checksum, remember it as checked, and answer the part asked for. Never unchecked: a pending
        version (a write or a repair under way) changes nothing, since the committed bytes are read and checked
        against the committed checksum that the same lookup returned; a committed length that changed between
        the two lookups is read whole again."""
        for _ in range(PARTIAL_CHECK_ATTEMPTS):
            meta = engine.get_meta(io.chunk_id)
            if meta is None:
                return ss.ReadResult(0, 0)  # removed meanwhile: a hole
            whole = memoryview(bytearray(meta.length))
            try:
                data, meta = engine.read(io.chunk_id, 0, meta.length, whole, nowait=nowait)
            except ThreeFSError as e:
                if e.code == StatusCode.CHUNK_NOT_FOUND:
                    return ss.ReadResult(0, 0)
                return ss.ReadResult(int(e.code), 0, e.message)
            if len(data) == meta.length:  # (data and meta come from one lookup: the committed version)
                break
        else:
            return ss.ReadResult(int(StatusCode.CHUNK_LOCKED), 0,
                                 f"chunk {io.chunk_id.hex()} on target {io.target_id} was committed anew "
                                 f"{PARTIAL_CHECK_ATTEMPTS} times while a partial read checked it; read it again")
        if crc32c.crc32c(data) != meta.crc:
            return ss.ReadResult(int(StatusCode.CHECKSUM_MISMATCH), 0,
                                 f"chunk {io.chunk_id.hex()} on target {io.target_id} fails its checksum "
                                 "(a partial read checks the whole chunk once); read another replica "
                                 "(repair started)")
        verified.add((io.target_id, io.chunk_id, meta.commit_ver, meta.crc))  # versions restart after a removal
        part = data[io.offset:io.offset + io.length]
        out[:len(part)] = part
        return ss.ReadResult(0, len(part), "", meta.commit_ver, meta.crc, crc32c.crc32c(part))

    # -- range operations (GC, truncate) ---------------------------------------------------------
    @rpc(ss.RemoveRangeReq)
    async def remove_range(self, ctx: CallContext, req: ss.RemoveRangeReq) -> ss.RemoveRangeRsp:
        return await self._remove_ranges(ctx, req.chain_id, req.chain_ver, [(req.begin, req.end)],
                                         req.chunk_size)

    @rpc(ss.RemoveRangesReq)
    async def remove_ranges(self, ctx: CallContext, req: ss.RemoveRangesReq) -> ss.RemoveRangeRsp:
        """remove_range for many ranges at once (meta's GC of many files): the chunks found in all of them
        are looked up in one disk call, then each is removed through the chain as remove_range does."""
        if len(req.ranges) > ss.REMOVE_RANGES_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"remove_ranges got {len(req.ranges)} ranges; "
                               f"at most {ss.REMOVE_RANGES_MAX} per request (split the request)")
        for begin, end in req.ranges:
            if begin > end:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"remove_ranges: range begins after its end "
                                   f"({begin.hex()} > {end.hex()})")
        return await self._remove_ranges(ctx, req.chain_id, req.chain_ver, req.ranges, req.chunk_size)

    async def _remove_ranges(self, ctx: CallContext, chain_id: int, chain_ver: int,
                             ranges: list[tuple[bytes, bytes]], chunk_size: int) -> ss.RemoveRangeRsp:
        self.fence.check()
        chain = await self._chain_checked(chain_id, chain_ver)
        engine = self.engines[self._my_target(chain)]
        if not ranges:
            return ss.RemoveRangeRsp(0)
        metas = await self.disk(lambda: [m for b, e in ranges for m in engine.iter_metas(b, e)])
        # REMOVE_PARALLEL chunks at once through the chain (a GC pass of many large files brings thousands;
        # one at a time, such a request could outlast its timeout); the first failure is raised once all ended
        limit = asyncio.Semaphore(REMOVE_PARALLEL)

        async def remove(meta) -> None:
            async with limit:
                await self.update(ctx, ss.UpdateReq(chain_id, chain_ver, meta.chunk_id, ss.REMOVE,
                                                    chunk_size=chunk_size))

        results = await asyncio.gather(*(remove(meta) for meta in metas), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return ss.RemoveRangeRsp(len(metas))

    @rpc(ss.LastChunkReq)
    async def last_chunk(self, ctx: CallContext, req: ss.LastChunkReq) -> ss.LastChunkRsp:
        self.fence.check()
        me = self._my_target(await self._chain(req.chain_id))
        metas = await self.disk(self.engines[me].iter_metas, req.begin, req.end, reverse=True, limit=1)
        if not metas:
            return ss.LastChunkRsp(b"", 0)
        return ss.LastChunkRsp(metas[0].chunk_id, metas[0].length)

    @rpc(Empty)
    async def status(self, ctx: CallContext, req: Empty) -> ss.StatusRsp:
        routing = self.mgmtd.routing
        return ss.StatusRsp(self.config.node_id, [
            ss.TargetStat(tid, self.local_state(routing, tid), e.chunk_count(), e.used_bytes())
            for tid, e in sorted(self.engines.items())], dict(self.inline_stats))
