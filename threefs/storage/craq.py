"""The CRAQ write path as sans-IO flows: generators that yield effects and receive their results.

The storage service runs a flow with real effects (the chunk engine, RPC to the successor, the routing
cache, asyncio.sleep); the seeded simulator (threefs/testing/sim/) runs the *same* flow with an
in-memory chunk store, a lossy reordering network, crashes and a clock it controls. A failed effect is
thrown back into the flow as its ThreeFSError, exactly where it was yielded.

    flow = update_flow(me, chain, req, payload)        # a generator
    rsp = await drive(flow, perform)                   # perform(effect) -> result, may raise

The decisions around the flows are here too, so the two drivers share them instead of each rewriting
the glue: `serve_update_flow` is the whole of an update request at a service (exactly-once lookup,
chain-version check, admission, the chunk lock via the `LockChunk` effect, the re-check under it, flow
tracking, the exactly-once store), `resync_job` picks which successor a service resyncs,
`resync_locked_flow` sends one chunk of a resync under its lock, and `local_state` is what a service
reports to mgmtd. A flow holds the per-chunk lock from `LockChunk` until it ends (3FS: writes to a
chunk serialize at the head; each replica applies a chunk's updates one at a time); the driver
releases it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Container, Generator

from threefs.common import crc32c
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.cluster.routing import write_targets
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.storage.replica import Decision, decide_at_successor, plan_at_head

FORWARD_RETRY_S = 10.0  # how long a replica keeps retrying its successor before failing the update
FORWARD_BACKOFF_S = (0.01, 0.5)  # first and largest delay between forwarding attempts
DEDUP_ENTRIES_MAX = 100_000  # exactly-once cache at a head: (client, request id) -> result


# -- effects ------------------------------------------------------------------------------------
@dataclass
class GetMeta:  # -> ChunkMeta | None
    chunk_id: bytes


@dataclass
class ReadNewest:  # -> bytes of the newest (pending if any) version, whole chunk
    chunk_id: bytes
    chunk_size: int


@dataclass
class Write:  # -> pending ChunkMeta
    chunk_id: bytes
    update_ver: int
    chain_ver: int
    offset: int
    data: Any
    chunk_size: int
    full_replace: bool
    tag: bytes
    crc: int | None = None  # crc32c of `data` when already checked against it (the request's), else None


@dataclass
class Truncate:  # -> pending ChunkMeta
    chunk_id: bytes
    update_ver: int
    chain_ver: int
    length: int
    chunk_size: int
    tag: bytes


@dataclass
class Remove:  # -> pending ChunkMeta | None
    chunk_id: bytes
    update_ver: int
    chain_ver: int
    tag: bytes


@dataclass
class Commit:  # -> committed ChunkMeta | None (None: removed)
    chunk_id: bytes
    update_ver: int
    chain_ver: int


@dataclass
class VerifyCommitted:  # -> bool: the committed bytes match their checksum (re-read from the store)
    chunk_id: bytes


@dataclass
class ReportDamage:  # -> None: a replica's copy fails its checksum; record it and repair it in the
    target_id: int  # background from a verified copy on another replica (storage/scrub.py)
    chunk_id: bytes
    found_by: str


@dataclass
class Forward:  # -> UpdateRsp of the successor (raises its error)
    target_id: int
    req: ss.UpdateReq
    payload: Any


@dataclass
class RefreshChain:  # -> ChainInfo (fresh from mgmtd)
    chain_id: int


@dataclass
class Sleep:  # -> None
    seconds: float


@dataclass
class Now:  # -> float, seconds on a monotonic clock
    pass


@dataclass
class ChainView:  # -> ChainInfo: this service's routing of the chain, refreshed first if older than at_least
    chain_id: int
    at_least: int = 0


@dataclass
class LockChunk:  # -> None once the flow holds target_id's lock of the chunk; the driver releases it when
    target_id: int  # the flow ends (returns, raises or is closed); store effects only run under it
    chunk_id: bytes


Flow = Generator[Any, Any, Any]
STORE_EFFECTS = (GetMeta, ReadNewest, Write, Truncate, Remove, Commit, VerifyCommitted)


def apply_to_store(store, e):
    """Perform a store effect on a chunk store with the ChunkEngine API: the real engine
    (storage/chunk_engine.py) or the simulator's SimStore, which answer alike
    (tests/storage/test_chunk_store_conformance.py)."""
    if isinstance(e, GetMeta):
        return store.get_meta(e.chunk_id)
    if isinstance(e, Write):
        return store.write(e.chunk_id, update_ver=e.update_ver, chain_ver=e.chain_ver, offset=e.offset,
                           data=e.data, chunk_size=e.chunk_size, full_replace=e.full_replace,
                           last_request=e.tag, data_crc=e.crc)
    if isinstance(e, Truncate):
        return store.truncate(e.chunk_id, update_ver=e.update_ver, chain_ver=e.chain_ver, length=e.length,
                              chunk_size=e.chunk_size, last_request=e.tag)
    if isinstance(e, Remove):
        return store.remove(e.chunk_id, update_ver=e.update_ver, chain_ver=e.chain_ver, last_request=e.tag)
    if isinstance(e, Commit):
        return store.commit(e.chunk_id, e.update_ver, chain_ver=e.chain_ver)
    if isinstance(e, VerifyCommitted):
        return store.verify(e.chunk_id)
    if isinstance(e, ReadNewest):
        try:
            return store.read(e.chunk_id, 0, e.chunk_size, pending=True)[0]
        except ThreeFSError as err:
            if err.code != StatusCode.CHUNK_NOT_FOUND:
                raise
            return b""  # no chunk, or a pending removal: the newest version is an empty chunk
    raise AssertionError(f"not a store effect: {e!r}")


async def drive(flow: Flow, perform: Callable[[Any], Awaitable[Any]]):
    """Run a flow with real effects (asyncio). Errors of an effect are thrown into the flow; any other
    exception (a cancellation) closes the flow at once, so its `finally` clauses run now, not at GC."""
    value, error = None, None
    try:
        while True:
            try:
                effect = flow.throw(error) if error is not None else flow.send(value)
            except StopIteration as stop:
                return stop.value
            try:
                value, error = await perform(effect), None
            except ThreeFSError as e:
                value, error = None, e
    finally:
        flow.close()


# -- flows --------------------------------------------------------------------------------------
def response(meta) -> ss.UpdateRsp:
    if meta is None:
        return ss.UpdateRsp(0, 0, 0, removed=True)
    return ss.UpdateRsp(meta.commit_ver, meta.length, meta.crc)


def tag_bytes(req: ss.UpdateReq) -> bytes:
    return b"" if req.tag is None else f"{req.tag.client_id}:{req.tag.request_id}".encode()


def update_flow(me: int, chain: ms.ChainInfo, req: ss.UpdateReq, payload, payload_crc: int | None = None) -> Flow:
    """One update at one replica: version decision, pending write, forward, commit. `payload_crc`: the
    payload's crc32c, when the caller checked it (the store then need not compute it again)."""
    meta = yield GetMeta(req.chunk_id)
    if req.sync and req.from_target:
        return response((yield from sync_apply_flow(req, payload, meta, chain.version, payload_crc)))
    if req.from_target == 0:
        plan = plan_at_head(meta)
        update_ver, full = plan.update_ver, plan.full_replace
    else:
        update_ver, full = req.update_ver, req.full_replace
        if req.kind != ss.REMOVE:
            decision = decide_at_successor(meta, update_ver, full)
            if decision is Decision.COMMITTED and stale_incarnation(me, chain, req, meta):
                return response((yield from sync_apply_flow(req, payload, meta, chain.version, payload_crc)))
            if decision is Decision.COMMITTED:
                return response(meta)
            if decision is Decision.MISSING:
                raise status_error(StatusCode.MISSING_UPDATE,
                                   f"target {me} misses versions before {update_ver} of chunk "
                                   f"{req.chunk_id.hex()} (has {meta.commit_ver if meta else 0})")
    if not full and reads_base(meta, req):
        yield from check_base(me, req, meta)
    pending = yield from apply_flow(me, req, payload, update_ver, full, chain.version, meta, payload_crc)
    yield from forward_flow(me, chain, req, payload, update_ver, full, pending)
    committed = yield Commit(req.chunk_id, update_ver, chain.version)
    return response(committed)


def reads_base(meta, req: ss.UpdateReq) -> bool:
    """Does applying this delta (not a full replace) read the committed bytes it lands on? Then a
    damaged committed copy would be carried into the new version under a freshly computed checksum
    (the chunk engine's copy-on-write: a write into the committed extent, a truncate that cuts it).
    Writes past the committed end extend the stored checksum instead, so damage stays detectable."""
    if meta is None or not meta.commit_ver or not meta.length:
        return False
    if req.kind == ss.TRUNCATE:
        return req.length < meta.length
    if req.kind == ss.WRITE:
        return req.offset < meta.length and not (req.offset == 0 and req.length >= meta.length)
    return False


def check_base(me: int, req: ss.UpdateReq, meta) -> Flow:
    """Verify our committed copy before a delta is applied on it (`reads_base`). A damaged copy at a
    successor asks its predecessor for the whole new chunk (MISSING_UPDATE: the same answer as for
    missed versions; the full replace repairs it); at the head, whose copy every replica's new version
    would be composed from, the write fails with a status the client retries (CHUNK_LOCKED) while the
    chunk is repaired from a verified copy on another replica."""
    if (yield VerifyCommitted(req.chunk_id)):
        return
    cid = req.chunk_id.hex()
    if req.from_target:  # no repair of our own: the whole chunk arrives in this same update
        raise status_error(StatusCode.MISSING_UPDATE,
                           f"target {me} holds a damaged copy of chunk {cid} (v{meta.commit_ver} fails its "
                           "checksum): send the whole chunk")
    yield ReportDamage(me, req.chunk_id, "write")
    raise status_error(StatusCode.CHUNK_LOCKED,
                       f"chunk {cid} on head target {me} fails its checksum (v{meta.commit_ver}); it is being "
                       "repaired from another replica: retry")


def check_newest(me: int, cid: bytes, data, meta, what: str) -> Flow:
    """The newest version's bytes we are about to build on or send whole must match the checksum the
    store recorded for them (`meta`'s pending fields describe the newest version): a damaged copy must
    never go out under a checksum computed afresh from it."""
    if meta is None or (len(data) == meta.pending_length and crc32c.crc32c(data) == meta.pending_crc):
        return
    yield ReportDamage(me, cid, what)
    raise status_error(StatusCode.CHECKSUM_MISMATCH,
                       f"chunk {cid.hex()} on target {me}: its newest version (v{meta.update_ver}, "
                       f"{len(data)} B, crc32c {crc32c.crc32c(data):08x}) fails its checksum "
                       f"{meta.pending_crc:08x}/{meta.pending_length} B; not sent ({what})")


def stale_incarnation(me: int, chain: ms.ChainInfo, req: ss.UpdateReq, meta) -> bool:
    """Does a SYNCING target hold an older incarnation of the chunk than the whole chunk its predecessor
    sends, under a version number at least as high? Versions restart at 1 when a chunk is removed and
    written again: a target that was out of the chain when the removal committed still holds the old
    chunk (say v5) until its resync removes it, and took a live full replace of the new v2 for
    "already committed" (a write then failed with CHECKSUM_MISMATCH: the real-process soak, lengths
    differing). A SYNCING target takes its predecessor's chunk as it is, as a resync does, when its
    copy was committed under an older chain version than the current one: before it left the chain.
    (A copy written in this chain version came from this predecessor, which sends a chunk's versions
    in order: a lower version arriving now is a late duplicate, and must not take back a newer one.)"""
    return (req.full_replace and req.kind == ss.WRITE and meta is not None
            and _state_of(chain, me) == ms.SYNCING and meta.chain_ver < chain.version
            and (meta.commit_ver != req.update_ver or meta.crc != req.crc or meta.length != req.length))


def apply_flow(me: int, req: ss.UpdateReq, payload, update_ver: int, full: bool, chain_ver: int,
               meta=None, payload_crc: int | None = None) -> Flow:
    """Write the pending version; a head with `full` composes it on its newest version. `payload_crc`: the
    crc32c of `payload` when the caller checked it (passed to the store with the payload, not a composed
    chunk)."""
    cid, tag = req.chunk_id, tag_bytes(req)
    if req.kind == ss.REMOVE:
        return (yield Remove(cid, update_ver, chain_ver, tag))
    if full and req.from_target == 0:
        newest = yield ReadNewest(cid, req.chunk_size)
        yield from check_newest(me, cid, newest, meta, "composing a write on it")
        data = compose(newest, req, payload)
        return (yield Write(cid, update_ver, chain_ver, 0, data, req.chunk_size, True, tag))
    if req.kind == ss.TRUNCATE:
        return (yield Truncate(cid, update_ver, chain_ver, req.length, req.chunk_size, tag))
    return (yield Write(cid, update_ver, chain_ver, req.offset, payload, req.chunk_size, full, tag, payload_crc))


def compose(newest, req: ss.UpdateReq, payload) -> bytearray:
    """The whole chunk after applying `req` on top of `newest`."""
    chunk = bytearray(newest)
    if req.kind == ss.TRUNCATE:
        del chunk[req.length:]
        chunk.extend(bytes(max(0, req.length - len(chunk))))
        return chunk
    end = req.offset + len(payload)
    if len(chunk) < end:
        chunk.extend(bytes(end - len(chunk)))
    chunk[req.offset:end] = payload
    return chunk


def forward_flow(me: int, chain: ms.ChainInfo, req: ss.UpdateReq, payload, update_ver: int,
                 full: bool, pending) -> Flow:
    """Send the update to our successor until it commits, following routing changes."""
    deadline = (yield Now()) + FORWARD_RETRY_S
    delay = FORWARD_BACKOFF_S[0]
    started_as = _state_of(chain, me)
    while True:
        order = write_targets(chain)
        if me not in order or (_state_of(chain, me) == ms.SYNCING and started_as != ms.SYNCING):
            # The chain dropped us (mgmtd failed us, or an admin took us offline) while we forwarded:
            # committing now would acknowledge a write the chain's real head never sees. Coming back
            # as SYNCING (the last of the write order: "the tail") means we were dropped meanwhile, and
            # the chain may have committed another update under our pending version's number (the
            # simulator, seed 760 with an admin offline/online). A target that stayed in the chain
            # keeps its state: it cannot go OFFLINE -> SYNCING -> SERVING while this flow holds the
            # chunk lock, since its resync must take that lock to send this chunk.
            raise status_error(StatusCode.CHAIN_VERSION_MISMATCH,
                               f"target {me} left chain {chain.chain_id} (now version {chain.version}) while "
                               f"forwarding chunk {req.chunk_id.hex()}; retry on the current chain")
        if order.index(me) + 1 >= len(order):
            return  # we are the tail now: commit locally
        successor = order[order.index(me) + 1]
        syncing = any(t.target_id == successor and t.public_state == ms.SYNCING for t in chain.targets)
        try:
            fwd, body = yield from successor_request(me, chain, req, payload, update_ver,
                                                     full or syncing, pending)
            rsp = yield Forward(successor, fwd, body)
            check_successor(req, rsp, pending, successor)
            return
        except ThreeFSError as e:
            if e.code == StatusCode.MISSING_UPDATE and not full:
                full = True  # the successor lags: send it the whole chunk
                continue
            if (not e.retryable and e.code != StatusCode.MISSING_UPDATE) or (yield Now()) > deadline:
                raise status_error(e.code, f"forwarding chunk {req.chunk_id.hex()} to target "
                                   f"{successor} failed: {e.message}")
        yield Sleep(delay)
        delay = min(delay * 2, FORWARD_BACKOFF_S[1])
        chain = yield RefreshChain(req.chain_id)


def _state_of(chain: ms.ChainInfo, target_id: int) -> str | None:
    return next((t.public_state for t in chain.targets if t.target_id == target_id), None)


def successor_request(me: int, chain: ms.ChainInfo, req: ss.UpdateReq, payload, update_ver: int,
                      full: bool, pending=None) -> Flow:
    """The request (and payload) for our successor: the same delta, or our whole newest chunk
    (checked against `pending`, the meta our write of this version returned)."""
    fwd = ss.UpdateReq(req.chain_id, chain.version, req.chunk_id, req.kind, req.offset, req.length,
                       req.chunk_size, req.crc, req.tag, update_ver, full, me)
    if not full or req.kind == ss.REMOVE:
        return fwd, (payload if req.kind == ss.WRITE else None)
    data = yield ReadNewest(req.chunk_id, req.chunk_size)
    yield from check_newest(me, req.chunk_id, data, pending, "sending the whole chunk to a successor")
    fwd.offset, fwd.kind, fwd.length, fwd.crc = 0, ss.WRITE, len(data), crc32c.crc32c(data)
    return fwd, data


def check_successor(req: ss.UpdateReq, rsp: ss.UpdateRsp, pending, successor: int) -> None:
    """Replicas verifiably agree after every write: compare the successor's chunk checksum."""
    if req.kind == ss.REMOVE or pending is None:
        return
    if rsp.crc != pending.pending_crc or rsp.length != pending.pending_length:
        raise status_error(StatusCode.CHECKSUM_MISMATCH,
                           f"target {successor} holds chunk {req.chunk_id.hex()} with crc "
                           f"{rsp.crc:08x}/{rsp.length} B, expected {pending.pending_crc:08x}/"
                           f"{pending.pending_length} B")


def sync_apply_flow(req: ss.UpdateReq, payload, meta, chain_ver: int, payload_crc: int | None = None) -> Flow:
    """Resync replaces the chunk and its versions with the predecessor's, whatever we had."""
    cid = req.chunk_id
    if meta is not None:
        ver = max(meta.update_ver, meta.commit_ver) + 1
        yield Remove(cid, ver, chain_ver, b"")
        yield Commit(cid, ver, chain_ver)
    if req.kind == ss.REMOVE:
        return None
    yield Write(cid, req.update_ver, chain_ver, 0, payload, req.chunk_size, True, b"", payload_crc)
    return (yield Commit(cid, req.update_ver, chain_ver))


# -- admission and exactly-once (used by the service and the simulator alike) -------------------
def serve_update_flow(hosted: Container[int], req: ss.UpdateReq, payload, state: "ReplicaState",
                      payload_crc: int | None = None) -> Flow:
    """One update request at a storage service, from its arrival to its answer (the service's `update`
    and the simulator's `handle_update` both run this): a retry gets the cached answer (exactly-once);
    the request's chain version must be ours (our routing is refreshed first when the caller saw a newer
    one); the target of the chain `hosted` here must be writable (and the head for a client's update);
    then the chunk lock, and the same checks again under it (3FS: the chain may have changed while we
    waited); the update flow runs counted by the chain version it was admitted under (`FlowTracker`:
    resync waits for older ones), and its answer is kept for retries. Errors propagate to the caller.
    `payload_crc`: the crc32c of `payload`, when the caller checked the payload against it (a write's
    request crc, checked on arrival): the store uses it instead of computing it again."""
    cached = state.dedup.get(req)
    if cached is not None:
        return cached
    chain = yield ChainView(req.chain_id, req.chain_ver)
    check_chain_version(chain, req.chain_ver)
    me = local_target(chain, hosted)
    admit(me, chain, req)
    yield LockChunk(me, req.chunk_id)
    chain = yield ChainView(req.chain_id)
    check_chain_version(chain, req.chain_ver)
    admit(me, chain, req)
    tracker = state.tracker(me)
    tracker.enter(chain.version)
    try:
        rsp = yield from update_flow(me, chain, req, payload, payload_crc)
    finally:
        tracker.exit(chain.version)
    state.dedup.put(req, rsp)
    return rsp


def local_target(chain: ms.ChainInfo, hosted: Container[int], where: str = "this node") -> int:
    """The target of `chain` that is hosted here (a service hosts at most one target per chain)."""
    for t in chain.targets:
        if t.target_id in hosted:
            return t.target_id
    raise status_error(StatusCode.TARGET_NOT_FOUND, f"{where} has no target in chain {chain.chain_id}")


def admit(me: int, chain: ms.ChainInfo, req: ss.UpdateReq) -> None:
    """Checks before an update may run at target `me` (chain version already matched)."""
    order = write_targets(chain)
    if me not in order:
        raise status_error(StatusCode.TARGET_OFFLINE, f"target {me} is not writable in chain "
                           f"{chain.chain_id} ({ms.SERVING}/{ms.SYNCING} only)")
    if req.from_target == 0 and order[0] != me:
        raise status_error(StatusCode.NOT_HEAD, f"target {me} is not the head of chain "
                           f"{chain.chain_id}; head is {order[0]}")
    if req.from_target:
        # Only our predecessor in this chain version may forward to us, and only to a SYNCING target
        # does a resync write. A target that left the chain may still run an old resync (an admin took
        # it offline while it synced us): its full-chunk replaces would take back versions committed
        # since (the simulator, seed 464: a SERVING target went back from v5 to v3 -> stale read).
        index = order.index(me)
        predecessor = order[index - 1] if index else 0
        if req.from_target != predecessor:
            raise status_error(StatusCode.CHAIN_VERSION_MISMATCH,
                               f"target {me}: an update of chunk {req.chunk_id.hex()} from target "
                               f"{req.from_target}, which is not our predecessor in chain {chain.chain_id} "
                               f"v{chain.version} ({predecessor or 'none: we are its head'})")
        if req.sync and _state_of(chain, me) != ms.SYNCING:
            raise status_error(StatusCode.CHAIN_VERSION_MISMATCH,
                               f"target {me} is {_state_of(chain, me)} in chain {chain.chain_id} "
                               f"v{chain.version}, not SYNCING: resync of chunk {req.chunk_id.hex()} "
                               f"from target {req.from_target} refused")


def check_chain_version(chain: ms.ChainInfo, chain_ver: int) -> None:
    if chain_ver != chain.version:
        raise status_error(StatusCode.CHAIN_VERSION_MISMATCH,
                           f"chain {chain.chain_id} is at version {chain.version}, request carries "
                           f"{chain_ver}; refresh routing and retry")


class ReplicaState:
    """The update path's memory at one storage service (lost when its process restarts): results of
    recent client updates, and the update flows in progress per target."""

    def __init__(self, dedup_entries_max: int = DEDUP_ENTRIES_MAX) -> None:
        self.dedup = ExactlyOnce(dedup_entries_max)
        self.flows: dict[int, FlowTracker] = {}

    def tracker(self, target_id: int) -> "FlowTracker":
        tracker = self.flows.get(target_id)
        if tracker is None:
            tracker = self.flows[target_id] = FlowTracker()
        return tracker


def local_state(public_state: str | None) -> str:
    """The local state a storage service reports for a target its routing shows in `public_state`
    (None: not in its routing): UPTODATE while mgmtd still counts the target as holding every
    acknowledged write (SERVING, LASTSRV); ONLINE otherwise, and it must resync (mgmtd itself records
    when a resync finished: sync_done). A process that is down reports nothing (mgmtd times it out)."""
    return ms.UPTODATE if public_state in (ms.SERVING, ms.LASTSRV) else ms.ONLINE


class ExactlyOnce:
    """Results of recent client updates by (client id, request id): a retry gets the cached answer."""

    def __init__(self, entries_max: int = DEDUP_ENTRIES_MAX):
        import collections

        self.entries_max = entries_max
        self._results: "collections.OrderedDict[tuple[str, int], ss.UpdateRsp]" = collections.OrderedDict()

    @staticmethod
    def key(req: ss.UpdateReq) -> tuple[str, int] | None:
        return (req.tag.client_id, req.tag.request_id) if req.tag and not req.from_target else None

    def get(self, req: ss.UpdateReq) -> ss.UpdateRsp | None:
        key = self.key(req)
        return None if key is None else self._results.get(key)

    def put(self, req: ss.UpdateReq, rsp: ss.UpdateRsp) -> None:
        key = self.key(req)
        if key is None:
            return
        self._results[key] = rsp
        while len(self._results) > self.entries_max:
            self._results.popitem(last=False)


def read_check(me: int, public_state: str | None, meta, allow_uncommitted: bool,
               admin_offline: bool = False) -> None:
    """May target `me` serve a read of this chunk? Raises the error the reader should see.

    `admin_offline`: our routing says an admin took the target offline. It stops serving reads at
    once, while it is still SERVING and takes writes: mgmtd drops it from the chain only after our
    node's heartbeat shows that it has seen this routing (mgmtd.chain_state.admin_offline_effective),
    so no read served here can miss a write the chain acknowledged without us."""
    from threefs.storage.replica import readable

    if public_state != ms.SERVING:
        raise status_error(StatusCode.TARGET_OFFLINE, f"target {me} is {public_state or 'unknown'}, "
                           "not SERVING")
    if admin_offline:
        raise status_error(StatusCode.TARGET_OFFLINE, f"target {me} is being taken offline by an admin; "
                           "read another replica")
    if not readable(meta, allow_uncommitted):
        raise status_error(StatusCode.CHUNK_NOT_COMMIT, f"chunk {meta.chunk_id.hex()} has a pending update")


# -- resync (3FS "Data recovery"): the predecessor of a SYNCING target brings it up to date ------
def _absent(meta) -> bool:
    """No data to send: no chunk, a pending removal, or never committed nor pending."""
    return meta is None or meta.pending_remove or (not meta.commit_ver and meta.update_ver == meta.commit_ver)


def differs(meta, brief) -> bool:
    """Must the successor get this chunk (or its removal)? `brief` is its dumped metadata or None.

    Compared with our NEWEST version: a pending version here may already be committed further down
    the chain (and read there), so resync carries it rather than the older committed one."""
    if _absent(meta):
        return brief is not None
    if brief is not None and brief.update_ver > brief.commit_ver:
        return True  # a stale pending version there (its update failed): replace it
    return (brief is None or brief.commit_ver != meta.update_ver or brief.crc != meta.pending_crc
            or brief.length != meta.pending_length)


class FlowTracker:
    """Counts update flows in progress by the chain version they were admitted under.

    Resync waits until every flow admitted under an older chain version has finished: such a flow may
    not know the successor is SYNCING and would not forward to it (3FS: the sync starts from a
    quiescent point of the predecessor)."""

    def __init__(self) -> None:
        self.active: dict[int, int] = {}
        self._waiters: list[tuple[int, object]] = []

    def enter(self, chain_ver: int) -> None:
        self.active[chain_ver] = self.active.get(chain_ver, 0) + 1

    def exit(self, chain_ver: int) -> None:
        self.active[chain_ver] -= 1
        if not self.active[chain_ver]:
            del self.active[chain_ver]
        ready = [w for w in self._waiters if self.quiet_below(w[0])]
        self._waiters = [w for w in self._waiters if w not in ready]
        for _, callback in ready:
            callback()

    def quiet_below(self, chain_ver: int) -> bool:
        return all(v >= chain_ver for v in self.active)

    def when_quiet_below(self, chain_ver: int, callback) -> None:
        """callback() once no flow admitted under a version < chain_ver is running (maybe at once)."""
        if self.quiet_below(chain_ver):
            callback()
        else:
            self._waiters.append((chain_ver, callback))


def resync_job(chain: ms.ChainInfo, hosted: Container[int]) -> tuple[int, int] | None:
    """(our target, its successor) when a target hosted here is the predecessor of the chain's SYNCING
    target and must resync it (3FS "Data recovery"); None otherwise. Writes go SERVING then SYNCING, so
    the predecessor is the last SERVING target, the one that forwards every write to the SYNCING one."""
    order = write_targets(chain)
    for me, successor in zip(order, order[1:]):
        state = next(t.public_state for t in chain.targets if t.target_id == successor)
        if me in hosted and state == ms.SYNCING:
            return me, successor
    return None


def resync_locked_flow(me: int, successor: int, chain_id: int, chunk_id: bytes, brief) -> Flow:
    """One chunk of a resync under its chunk lock, decided on the chain as it is once the lock is held."""
    yield LockChunk(me, chunk_id)
    chain = yield ChainView(chain_id)
    return (yield from resync_chunk_flow(me, successor, chain, chunk_id, brief))


def resync_chunk_flow(me: int, successor: int, chain: ms.ChainInfo, chunk_id: bytes, brief) -> Flow:
    """Send one chunk (or its removal) to the syncing successor if it differs from `brief` (the
    successor's dumped metadata, None if it has none). The caller holds the chunk lock, so the decision
    is made on our current state, not on a listing that a concurrent update may have outdated."""
    meta = yield GetMeta(chunk_id)
    if not differs(meta, brief):
        return None
    if _absent(meta):
        req = ss.UpdateReq(chain.chain_id, chain.version, chunk_id, ss.REMOVE, from_target=me, sync=True,
                           update_ver=1)
        return (yield Forward(successor, req, None))
    data = yield ReadNewest(chunk_id, meta.pending_length)
    yield from check_newest(me, chunk_id, data, meta, "resync")
    req = ss.UpdateReq(chain.chain_id, chain.version, chunk_id, ss.WRITE, 0, len(data),
                       max(len(data), 1), crc32c.crc32c(data), update_ver=meta.update_ver,
                       full_replace=True, from_target=me, sync=True)
    return (yield Forward(successor, req, data))
