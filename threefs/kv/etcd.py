"""The KV engine on an etcd cluster: `open_engine("etcd://host:port[,host:port...][/prefix]")`.

Metadata on etcd survives the loss of a host: with 3 members any one may fail and the KV keeps serving.
Spoken over etcd 3.4's gRPC API with grpcio (messages hand-encoded: threefs.kv.etcd_wire). Design, semantics argument
and measured figures: docs/etcd.md.

Layout under `prefix` (default "threefs"):
  prefix/d/K    user key K and its value
  prefix/w/K    K's write marker: put (empty, with the current lease) by every commit that clears K (even an
                absent K) or write-conflicts it; a set needs none, its data key's mod_revision moves
  prefix/c/ID   the clear_range log: the ranges cleared by commit ID (msgpack), with the current lease
  prefix/cr     touched by every commit that has a clear_range
  prefix/t/ID   commit ID's exactly-once token (empty, with the current lease)
  prefix/e      the version key: put by every commit (no compare), so its mod_revision is the latest commit

- Replica (_Replica; `?replica=off` turns it off): every data key, loaded at one revision and kept exact by a
  watch on [prefix/d/, prefix/e]; a transaction waits (bounded) until the watch has applied its read version,
  then reads locally. Compaction, dead or frozen watch members fall back to etcd reads, never to stale ones.

- Speculative transactions (EtcdEngine.run only): reads at the replica's progress with no read-version round
  trip; the commit compares snapshot reads too against that version, and a failed first send, a read-only
  commit or an error raised by the operation wait for a read version and check on the replica that nothing
  read changed up to it (else KV_CONFLICT, retried), so one round trip per create. docs/etcd.md.

- version = etcd revision. A transaction's read version is the version key's mod_revision, by a linearizable
  read (without a replica: the revision of its first get, which returns the value too); concurrent transactions of one
  engine share such reads (FoundationDB's GRV batching: a transaction waits for a read *sent after it asked*,
  so it sees every commit acknowledged before). Reads are serializable etcd range
  requests at that revision, so etcd's MVCC is the snapshot until it compacts ("compacted" -> KV_TOO_OLD);
  concurrent point reads of one engine are coalesced into one read-only Txn.
- Conflicts are etcd's own compares, evaluated atomically with the writes in one Txn, so commits that do not
  conflict run in parallel (nothing is serialised through one key):
  * every read range [b, e) of the transaction becomes `mod_revision(d/b .. d/e) < rv + 1` and
    `mod_revision(w/b .. w/e) < rv + 1` (a point read one-key compares, a range read range compares). A set
    moves its data key's mod_revision, a point delete (or clear of nothing) and a write-conflict key put the
    marker, so a phantom insert, an update and a delete inside a read range all fail it;
  * clear_range cannot be marked key by key (it conflicts even where no key existed), so it is logged in c/ and
    touches cr. A transaction with reads also compares `mod_revision(cr) < rv + 1`; when that alone fails, it
    reads the c/ entries newer than rv (min_mod_revision) and cr at one revision, raises KV_CONFLICT if one
    overlaps its reads, else commits again comparing cr to the mod_revision it saw (exact, not pessimistic).
  * markers, log entries and tokens carry a lease of LEASE_TTL_S that the engine uses for a quarter of it only,
    so they vanish after at least 3/4 of LEASE_TTL_S, far more than the MVCC window: an absent marker means
    "no write since any still-valid read version", which is all a compare needs.
- Exactly once: every commit compares `create_revision(t/ID) == 0` and puts t/ID, so a commit resent after a
  lost reply or a member's death cannot apply twice; its failure branch reads t/ID, so "already applied" is
  told from "conflict" without another round trip.
- Batching: commits of one engine that are independent of each other (no one's reads overlap another's writes,
  no two write the same key, at most one clear_range) are sent as nested Txns inside one etcd Txn. etcd
  evaluates all compares of a Txn against the state before it and applies them at one revision, which is
  exactly right for independent transactions (any serial order gives the same result). A batch that fails as a
  whole (too large, ...) is resent transaction by transaction, so only the culprit gets the error.

Failover: the client knows every endpoint; a connection error, a timeout or "no leader" moves it to the next
endpoint until REQUEST_DEADLINE_S, and a member silent for HEDGE_S gets the request sent to the next one too
(first answer wins; commits are safe to send twice thanks to their token). Limits: etcd refuses requests over --max-request-bytes (default 1.5 MiB)
and Txns with more than --max-txn-ops operations (default 128); both become KV_TOO_LARGE with the server's
message. Run etcd with the flags in threefs.testing.etcd_cluster (16 MiB, 100,000 ops) to fit TXN_BYTES_MAX.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import os
import time
import urllib.parse
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
import msgspec

from threefs.common.status import KVConflictError, StatusCode, ThreeFSError, status_error
from threefs.kv import etcd_wire as wire
from threefs.kv.api import MVCC_WINDOW_S, KVEngine, Transaction
from threefs.kv.txn import BufferedTransaction, Range, WriteBuffer, check_key, coalesce, find_overlap, key_after

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "threefs"
ENDPOINTS_MAX = 16
REQUEST_TIMEOUT_S = 3.0  # one HTTP request to one member; then the next member is tried
REQUEST_DEADLINE_S = 15.0  # all members, retried: longer than an etcd leader election
RETRY_PAUSE_S = 0.1  # between rounds over all members
HEDGE_S = 0.5  # a member silent for this long gets the request sent to the next member too
MESSAGE_BYTES_MAX = 64 << 20  # gRPC's receive limit (default 4 MiB) raised above etcd's request limit
COMMIT_ATTEMPTS_MAX = 50  # rounds lost to clear_range commits (each checked exactly) before KV_CONFLICT
RANGE_PAGE = 1000  # keys per range request
LEASE_TTL_S = 20  # markers, clear_range log entries and tokens live at least 3/4 of it (15 s >> MVCC window)
BATCH_COMMITS_MAX = 64  # transactions per etcd Txn
BATCH_READS_MAX = 256  # point reads per etcd Txn
BATCH_BYTES_MAX = 4 << 20  # of keys and values per batch, well under etcd's --max-request-bytes
# Batches of one engine in flight at once; whatever queues meanwhile goes in the next one, so batches grow
# with load. Measured on 2 loaded cores, 8 tasks, create-shaped commits/s, two runs: 1 -> 349/499,
# 2 -> 459/463, 4 -> 307/228, 8 -> 391/231 (on the JSON gateway, where requests cost more CPU, 1 was best).
COMMITS_IN_FLIGHT = int(os.environ.get("THREEFS_ETCD_COMMITS_IN_FLIGHT", "2"))
READS_IN_FLIGHT = 2
GRVS_IN_FLIGHT = 1  # 1, 4 or 8 in flight: no difference above the noise (in-process meta creates, load 18)
# The replica (a copy of every data key, kept exact by a watch; see _Replica):
REPLICA_KEYS_MAX = 500_000  # a KV with more data keys is read from etcd instead (no replica)
REPLICA_WAIT_S = 0.5  # a transaction waits this long for the watch to reach its read version, then reads etcd
REPLICA_RETRY_S = 0.2  # between watch streams (a member died, or the stream stalled)
# The watchdog (EtcdEngine._replica_stalled): the engine learns revisions of the version key that exist (GRVs,
# commit replies, a failed commit's stamp). A replica that has not reached one within REPLICA_STALL_S has a
# stalled watch (a stream that stays open and silent): the stream is restarted on another member, and after
# REPLICA_RESTARTS_MAX restarts that did not help the replica is loaded afresh. Speculative transactions do
# not read a replica that has been behind a known revision for REPLICA_WAIT_S (they take a read version).
REPLICA_CHECK_S = 0.1
REPLICA_STALL_S = 2.0
REPLICA_RESTARTS_MAX = 3
REPLICA_TOO_BIG_RETRY_S = 60.0  # a KV over REPLICA_KEYS_MAX is counted again after this
LEADER_CHECK_S = 3.0  # how often the engine checks that it talks to the leader
LEADER_CHECK_TIMEOUT_S = 1.0
REPLICA_LOAD_WAIT_S = 5.0  # open_etcd waits this long for the replica (then serves without it meanwhile)
# A speculative transaction asks for a read version only when it must validate (a failed first send, whose reply
# carries one; a read-only commit; an error); a retried attempt also at its first snapshot read (validation then
# checks a short interval, so a snapshot key written concurrently is no conflict). Eager: at the start, always.
SPECULATIVE_EAGER_GRV = os.environ.get("THREEFS_ETCD_EAGER_GRV") == "1"
STATS_DUMP_S = 0.5  # with THREEFS_KV_STATS_DIR set
REPLICA_HISTORY_S = MVCC_WINDOW_S + 2.0  # replaced versions are kept this long, so reads at a valid rv hit

_TRANSIENT_ERRORS = ("no leader", "leader changed", "timed out", "not capable", "unhealthy", "stopped",
                     "too many requests", "connection", "future revision", "lease not found")
_TRANSIENT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.UNKNOWN)
_TOO_LARGE_ERRORS = ("too many operations", "request is too large", "message larger than max",
                     "received message larger")
_LOG_ENCODER = msgspec.msgpack.Encoder()
_LOG_DECODER = msgspec.msgpack.Decoder(list[tuple[bytes, bytes]])

T = TypeVar("T")
R = TypeVar("R")


def _kvs(response: dict[str, Any]) -> list[dict[str, Any]]:
    return (response.get("response_range") or {}).get("kvs") or []


class _Batcher(Generic[T, R]):
    """Coalesces concurrent submissions into batches: a batch is sent as soon as fewer than `in_flight`
    batches are outstanding, with everything queued by then (no timer: batching costs no latency when idle).
    `send(items)` returns one result (or exception) per item; `pick(items)` chooses the items of the next
    batch (the rest wait for a later one)."""

    def __init__(self, send: Callable[[list[T]], Awaitable[list[R | BaseException]]], in_flight: int,
                 pick: Callable[[list[T]], list[int]]):
        self._send = send
        self._in_flight_max = in_flight
        self._pick = pick
        self._queue: list[tuple[T, asyncio.Future]] = []
        self._in_flight = 0

    async def submit(self, item: T) -> R:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        self._launch()
        return await future

    def _launch(self) -> None:
        while self._queue and self._in_flight < self._in_flight_max:
            chosen = self._pick([item for item, _ in self._queue])
            batch = [self._queue[i] for i in chosen]
            chosen_set = set(chosen)
            self._queue = [entry for i, entry in enumerate(self._queue) if i not in chosen_set]
            self._in_flight += 1
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[tuple[T, asyncio.Future]]) -> None:
        try:
            results = await self._send([item for item, _ in batch])
        except BaseException as exc:  # every waiter gets the error; it is theirs
            results = [exc] * len(batch)
        finally:
            self._in_flight -= 1
        for (_, future), result in zip(batch, results):
            if future.done():  # the waiter was cancelled
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        self._launch()


class _Replica:
    """Every data key of the engine's prefix, at every revision in [floor, progress]: loaded by one range read
    at revision `start`, then kept exact by an etcd watch from start + 1 (each event is applied in revision
    order, and every commit of every engine puts the version key, so `progress` reaches any read version).

    Exactness: a read at rv with floor <= rv <= progress returns what etcd returns at rv. Each key keeps the
    versions [(revision, value or None for a deletion)] it had since it was loaded; a version is dropped only
    once a later one is at or below `floor`, and a key whose deletion is at or below `floor` is dropped
    entirely, so the newest version at or below any rv >= floor is always kept, and a key with none was absent
    at rv. `floor` trails `progress` by REPLICA_HISTORY_S (older read versions fall back to etcd, and cannot
    commit anyway: the MVCC window)."""

    def __init__(self, start: int, rows: list[tuple[bytes, bytes, int]]):
        self.start = self.progress = self.floor = start
        self.versions: dict[bytes, list[tuple[int, bytes | None]]] = {k: [(rev, v)] for k, v, rev in rows}
        self.keys = sorted(self.versions)  # deleted keys too, until swept
        self.live = True
        self._waiters: list[tuple[int, int, asyncio.Future]] = []  # heap of (revision, seq, future)
        self._seq = 0
        self._marks: deque[tuple[float, int]] = deque()  # (monotonic time, progress) to move `floor`
        self._deleted: deque[tuple[int, bytes]] = deque()  # (deletion revision, key), swept past `floor`

    def readable(self, rv: int) -> bool:
        return self.live and self.floor <= rv <= self.progress

    def value_at(self, key: bytes, rv: int) -> bytes | None:
        versions = self.versions.get(key)
        if versions is None:
            return None
        for rev, value in reversed(versions):
            if rev <= rv:
                return value
        return None  # created after rv (an older version would still be kept: see the class docstring)

    def range_at(self, begin: bytes, end: bytes, rv: int, limit: int, reverse: bool) -> list[tuple[bytes, bytes]]:
        keys = self.keys
        i, j = bisect_left(keys, begin), bisect_left(keys, end)
        rows: list[tuple[bytes, bytes]] = []
        for n in range(j - 1, i - 1, -1) if reverse else range(i, j):
            value = self.value_at(keys[n], rv)
            if value is not None:
                rows.append((keys[n], value))
                if len(rows) == limit:
                    break
        return rows

    def changed(self, ranges: list[Range], after: int, upto: int) -> bool:
        """Whether any key in `ranges` has a version in (after, upto] (needs floor <= after, upto <=
        progress: else True, the safe answer)."""
        if not self.live or after < self.floor or upto > self.progress:
            return True
        keys, versions = self.keys, self.versions
        for begin, end in ranges:
            if end == key_after(begin):
                found = versions.get(begin)
                candidates = [found] if found is not None else []
            else:
                candidates = [versions[k] for k in keys[bisect_left(keys, begin):bisect_left(keys, end)]]
            for history in candidates:
                for rev, _ in reversed(history):
                    if rev <= after:
                        break
                    if rev <= upto:
                        return True
        return False

    def apply(self, events: list[tuple[bytes, bytes | None, int]], revision: int) -> None:
        """Events (key, value or None, revision) of revisions above `progress`, in order; then progress =
        `revision` (the last of them: etcd never splits a revision across watch responses)."""
        floor = self.floor
        for key, value, rev in events:
            if rev <= self.progress:  # already applied (never sent twice; a guard)
                continue
            versions = self.versions.get(key)
            if versions is None:
                if value is None:
                    continue
                self.versions[key] = [(rev, value)]
                insort(self.keys, key)
                continue
            versions.append((rev, value))
            while len(versions) > 1 and versions[1][0] <= floor:
                del versions[0]
            if value is None:
                self._deleted.append((rev, key))
        if revision > self.progress:
            self.progress = revision
            now = time.monotonic()
            self._marks.append((now, revision))
            while self._marks and self._marks[0][0] <= now - REPLICA_HISTORY_S:
                self._advance_floor(self._marks.popleft()[1])
            while self._waiters and self._waiters[0][0] <= revision:
                future = heapq.heappop(self._waiters)[2]
                if not future.done():
                    future.set_result(True)

    def _advance_floor(self, floor: int) -> None:
        self.floor = max(self.floor, floor)
        while self._deleted and self._deleted[0][0] <= self.floor:
            rev, key = self._deleted.popleft()
            versions = self.versions.get(key)
            if versions is not None and versions[-1] == (rev, None):  # still deleted: absent at every rv >= floor
                del self.versions[key]
                i = bisect_left(self.keys, key)
                if i < len(self.keys) and self.keys[i] == key:
                    del self.keys[i]

    async def wait(self, rv: int, timeout_s: float) -> bool:
        """Whether progress reached `rv` within `timeout_s` (and the replica is still live)."""
        if self.progress >= rv:
            return self.live
        future = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._waiters, (rv, self._seq, future))
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return False
        return self.live and self.progress >= rv

    def close(self) -> None:
        """Never serve again (the watch lost history: compaction); waiters fall back to etcd."""
        self.live = False
        for _, _, future in self._waiters:
            if not future.done():
                future.set_result(False)
        self._waiters.clear()


class _Compacted(Exception):
    """The watch's start revision was compacted away: the replica cannot be brought up to date."""


@dataclass
class _Commit:
    """One transaction's commit, prepared for (nested) etcd Txns."""

    ident: bytes
    read_version: int | None
    reads: list[Range]
    writes: WriteBuffer
    write_ranges: list[Range]
    size_bytes: int
    cr_expected: int | None = None  # None: cr must not have moved since the read version; else its mod_revision
    has_clear: bool = field(default=False)


class EtcdEngine(KVEngine):
    """The KV on an etcd cluster. `clock` (seconds) drives the MVCC window; tests may fake it."""

    def __init__(self, endpoints: list[str], prefix: str = DEFAULT_PREFIX, *,
                 clock: Callable[[], float] = time.time, window_s: float = MVCC_WINDOW_S,
                 request_deadline_s: float = REQUEST_DEADLINE_S, batching: bool = True,
                 lease_ttl_s: int = LEASE_TTL_S, replica: bool = True, speculative: bool = True):
        if not endpoints or len(endpoints) > ENDPOINTS_MAX:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"etcd KV needs 1..{ENDPOINTS_MAX} endpoints, "
                               f"got {len(endpoints)}")
        self.endpoints = list(endpoints)
        base = prefix.encode()
        self.data_prefix = base + b"/d/"
        self.marker_prefix = base + b"/w/"
        self.clear_log_prefix = base + b"/c/"
        self.clear_counter = base + b"/cr"
        self.token_prefix = base + b"/t/"
        # Put (no lease, no compare) by every commit: its mod_revision is the revision of the latest commit
        # under the prefix, the read version a transaction takes; and the watch sees every commit through it.
        self.version_key = base + b"/e"
        self._stamp = wire.op_put(wire.put_request(self.version_key, b""))
        self.clock = clock
        self.window_s = window_s
        self.request_deadline_s = request_deadline_s
        # Markers must outlive every valid read version: a lease is used for a quarter of its TTL, and what is left
        # (lease_ttl_s * 3/4) must exceed the MVCC window. Tests shorten it to watch the markers go.
        if lease_ttl_s * 3 / 4 <= window_s:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"etcd KV lease TTL {lease_ttl_s} s must exceed "
                               f"4/3 of the MVCC window ({window_s} s)")
        self.lease_ttl_s = lease_ttl_s
        self._current = 0  # index of the endpoint that answered last
        self._channels: dict[int, tuple[grpc.aio.Channel, dict[str, Any]]] = {}
        self._closed = False
        self._engine_id = os.urandom(6).hex().encode()
        self._commit_seq = 0
        self._lease: tuple[int, float] | None = None  # (lease id, monotonic time after which it is not used)
        self._lease_lock = asyncio.Lock()
        self._grv = _Batcher(self._send_grv, GRVS_IN_FLIGHT, lambda items: list(range(len(items))))
        self._reads = _Batcher(self._send_reads, READS_IN_FLIGHT,
                               (lambda items: list(range(min(len(items), BATCH_READS_MAX)))) if batching
                               else (lambda items: [0]))
        self._commits = _Batcher(self._send_commits, COMMITS_IN_FLIGHT,
                                 self._pick_independent if batching else (lambda items: [0]))
        self.stats = {"requests": 0, "commit_batches": 0, "commits": 0, "read_batches": 0, "reads": 0,
                      "grv": 0, "clear_checks": 0, "batch_splits": 0, "replica_reads": 0, "replica_misses": 0,
                      "replica_stalls": 0, "replica_loads": 0, "watch_streams": 0, "watch_events": 0,
                      "conflicts": 0, "clear_rounds": 0, "txns": 0, "grv_waits": 0,
                      "speculative": 0, "spec_resends": 0, "spec_stale": 0, "stale_errors": 0,
                      "watch_restarts": 0, "watch_leader_moves": 0, "replica_lag_reloads": 0, "spec_lagging": 0,
                      "conflict_rvs": 0,
                      "grv_wait_s": 0.0, "replica_wait_s": 0.0, "commit_wait_s": 0.0, "txn_call_s": 0.0}
        # THREEFS_KV_STATS_DIR: every STATS_DUMP_S, this engine writes its stats to etcd-<pid>-<id>.json there
        # (benchmarks read them from the meta and mgmtd processes: round trips and conflicts per operation).
        self._stats_dir = os.environ.get("THREEFS_KV_STATS_DIR") or None
        self._stats_task: asyncio.Task | None = None
        self._replica_wanted = replica
        self._replica: _Replica | None = None  # live once loaded; None while (re)loading or off
        self._replica_task: asyncio.Task | None = None
        self._leader_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self.watch_index: int | None = None  # the endpoint the watch stream was last opened on
        self.acked_revision = 0  # the highest revision of a commit this engine acknowledged
        # The highest revision of the version key this engine knows to exist (GRVs, commit replies): the replica's
        # watch must reach it. _lag: (such a revision above the replica's progress, monotonic time it was first
        # seen there), None while the replica is caught up; see _replica_stalled.
        self.seen_revision = 0
        self._lag: tuple[int, float] | None = None
        self._watch_restarts = 0  # consecutive watchdog restarts that did not bring the replica to its target
        self._restarted_at = 0.0  # monotonic time of the last one
        self._reload_replica = False
        self.speculative = speculative

    def transaction(self) -> Transaction:
        if self._closed:
            raise status_error(StatusCode.KV_ERROR, f"etcd KV {self.endpoints} is closed")
        return _EtcdTransaction(self)

    # run() is KVEngine.run with speculative transactions (see _EtcdTransaction), through its two hooks: their
    # reads come from the replica at its progress without waiting for a read version, and are validated before
    # anything derived from them leaves: the commit checks them, a read-only commit and an error raised by `fn`
    # wait for a read version and check that nothing read changed up to it (else the attempt is retried, as on
    # a conflict).
    def _attempt_transaction(self, attempt: int, previous: Transaction | None) -> Transaction:
        """Only the first attempt speculates. A retry reads at a read version (from the replica once its watch
        has reached it, else from etcd): a replica whose watch is stuck behind would otherwise make every
        speculative attempt read the same stale keys and fail validation until the deadline (seen: a meta
        server's transactions timing out after 19 attempts). After a commit conflict that read version is the
        version key the failed Txn saw (`revision`): a revision read by etcd after run() began, so at or above
        every commit acknowledged before it, which is all a read version must be; no read-version round trip."""
        if self._closed:
            raise status_error(StatusCode.KV_ERROR, f"etcd KV {self.endpoints} is closed")
        # Only after a speculative attempt (its miss came from a copy behind, not from a writer now): a later
        # retry comes after a backoff of up to 100 ms, and reading at the version of before it made a contended
        # key conflict again and again (seen: 100 conflicts in a row in test_kv_etcd_replica_stall). It asks.
        read_at = (previous.conflict_at if isinstance(previous, _EtcdTransaction) and previous.speculated
                   else None)
        return _EtcdTransaction(self, speculative=self.speculative and attempt == 0, read_at=read_at)

    async def _check_error(self, tr: Transaction, exc: Exception) -> None:
        """An error derived from speculative reads is only an answer if they were current."""
        assert isinstance(tr, _EtcdTransaction)
        if not await tr.validate():
            self.stats["stale_errors"] += 1
            raise KVConflictError(StatusCode.KV_CONFLICT, "KV conflict: the transaction's reads were stale "
                                  "when it failed") from exc

    async def close(self) -> None:
        self._closed = True
        if self._stats_dir is not None:
            self._dump_stats()
        for task in (self._replica_task, self._leader_task, self._stats_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except BaseException:  # noqa: BLE001 - ended on purpose; its errors were logged
                    pass
        self._replica_task = self._leader_task = self._stats_task = None
        if self._replica is not None:
            self._replica.close()
            self._replica = None
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            await channel.close()

    # -- requests -------------------------------------------------------------------------------------------
    def _stubs(self, index: int) -> dict[str, Any]:
        """The unary-call stubs of endpoint `index` (one HTTP/2 channel each: requests are multiplexed, so the
        channel is the connection pool, whatever the concurrency)."""
        return self._channel(index)[1]

    def _channel(self, index: int) -> tuple[grpc.aio.Channel, dict[str, Any]]:
        entry = self._channels.get(index)
        if entry is None:
            options = [("grpc.max_receive_message_length", MESSAGE_BYTES_MAX),
                       ("grpc.max_send_message_length", MESSAGE_BYTES_MAX)]
            channel = grpc.aio.insecure_channel(self.endpoints[index], options=options)
            stubs = {name: channel.unary_unary(method) for name, method in wire.METHODS.items()}
            entry = self._channels[index] = (channel, stubs)
        return entry

    async def call(self, path: str, request: bytes) -> dict[str, Any]:
        """Send `request` (etcd_wire bytes) as "range", "txn" or "lease/grant" to a live member and decode the
        reply. A member that has not answered within HEDGE_S gets company: the same request goes to the next
        member too and the first answer wins (a cut-off member would otherwise stall every caller for
        REQUEST_TIMEOUT_S; commits are safe to send twice, their token makes them apply once). Members that
        fail are passed over until REQUEST_DEADLINE_S."""
        if self._closed:
            raise status_error(StatusCode.KV_ERROR, f"etcd KV {self.endpoints} is closed")
        decode = wire.DECODERS[path]
        deadline = time.monotonic() + self.request_deadline_s
        errors: list[str] = []
        n = len(self.endpoints)
        while True:  # bounded by the deadline
            first = self._current
            order = [(first + i) % n for i in range(n)]
            running: dict[asyncio.Task, int] = {}
            try:
                while order or running:  # each endpoint tried at most once per round
                    if order and not running:
                        index = order.pop(0)
                        running[asyncio.ensure_future(self._attempt(index, path, request))] = index
                    done, _ = await asyncio.wait(running, timeout=HEDGE_S if order else None,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if not done:  # slow: ask the next member as well
                        index = order.pop(0)
                        running[asyncio.ensure_future(self._attempt(index, path, request))] = index
                        continue
                    for task in done:
                        index = running.pop(task)
                        exc = task.exception()
                        if exc is None:
                            self._current = index
                            return decode(task.result())
                        if not isinstance(exc, grpc.aio.AioRpcError):
                            raise exc
                        message = exc.details() or str(exc.code())
                        errors.append(f"{self.endpoints[index]}: {exc.code().name} {message}")
                        if exc.code() not in _TRANSIENT_CODES:
                            self._raise_permanent(message)
                        if "lease not found" in message.lower():
                            self._lease = None
                            raise _LeaseLost(message)
                        if "future revision" in message.lower():
                            await asyncio.sleep(0.005)  # this member lags the one that gave the read version
                        if self._current == index:  # others may have moved on already
                            self._current = (index + 1) % n
            finally:
                for task in running:
                    task.cancel()
            if time.monotonic() + RETRY_PAUSE_S > deadline:
                raise status_error(StatusCode.UNAVAILABLE, f"etcd KV: no member answered within "
                                   f"{self.request_deadline_s} s; last errors: {'; '.join(errors[-3:])}")
            await asyncio.sleep(RETRY_PAUSE_S)

    async def _attempt(self, index: int, path: str, request: bytes) -> bytes:
        self.stats["requests"] += 1
        return await self._stubs(index)[path](request, timeout=REQUEST_TIMEOUT_S)

    @staticmethod
    def _raise_permanent(message: str) -> None:
        """Raise the StatusCode error for an etcd error that another member would repeat."""
        lowered = message.lower()
        if "compacted" in lowered:
            raise status_error(StatusCode.KV_TOO_OLD, f"etcd KV: {message}; the read version was compacted "
                               f"away, retry with a new transaction")
        if any(text in lowered for text in _TOO_LARGE_ERRORS):
            raise status_error(StatusCode.KV_TOO_LARGE, f"etcd KV refused the commit: {message}; split the "
                               f"transaction or raise etcd's --max-request-bytes / --max-txn-ops")
        if not any(text in lowered for text in _TRANSIENT_ERRORS):
            raise status_error(StatusCode.KV_ERROR, f"etcd KV: {message}")

    def stored(self, key: bytes) -> bytes:
        return self.data_prefix + key

    def marker(self, key: bytes) -> bytes:
        return self.marker_prefix + key

    async def lease(self) -> int:
        """The lease new markers, log entries and tokens are attached to (a new one every quarter of the TTL)."""
        lease = self._lease
        if lease is not None and time.monotonic() < lease[1]:
            return lease[0]
        async with self._lease_lock:
            lease = self._lease
            if lease is None or time.monotonic() >= lease[1]:
                start = time.monotonic()  # the lease's clock starts at etcd after this: a safe under-estimate
                reply = await self.call("lease/grant", wire.lease_grant_request(self.lease_ttl_s))
                if reply["error"] or not reply["ID"]:
                    raise status_error(StatusCode.KV_ERROR, f"etcd KV: no lease granted: {reply['error']}")
                lease = self._lease = (reply["ID"], start + self.lease_ttl_s / 4)
            return lease[0]

    # -- read versions and reads ----------------------------------------------------------------------------
    async def read_version(self) -> int:
        """A revision at which every commit acknowledged before this call is visible (batched)."""
        return await self._grv.submit(None)

    async def _send_grv(self, items: list[None]) -> list[int]:
        """The version key's mod_revision (the latest commit under the prefix) by a linearizable read: every
        commit acknowledged before the read was sent is at or below it, and nothing under the prefix changed
        between it and the reply's revision but lease expiries (markers, tokens: no data)."""
        self.stats["grv"] += 1
        reply = await self.call("range", wire.range_request(self.version_key, keys_only=True))
        kvs = reply["kvs"]
        if kvs:
            self._note_revision(kvs[0]["mod_revision"])
        return [kvs[0]["mod_revision"] if kvs else reply["header"]["revision"]] * len(items)

    def _note_revision(self, revision: int) -> None:
        """`revision` is a revision of the version key (so one the replica's watch delivers): remember it, and
        when the replica is below it, since when (the watchdog's clock)."""
        if revision > self.seen_revision:
            self.seen_revision = revision
        replica = self._replica
        if self._lag is None and replica is not None and replica.live and replica.progress < revision:
            self._lag = (revision, time.monotonic())

    def replica_lagging(self, replica: _Replica) -> bool:
        """Whether `replica` has been below a revision known to exist for REPLICA_WAIT_S or more (its watch may be
        stalled): speculating on it would read stale keys."""
        lag = self._lag
        return lag is not None and replica.progress < lag[0] and time.monotonic() - lag[1] >= REPLICA_WAIT_S

    def _replica_stalled(self, replica: _Replica) -> bool:
        """The watchdog, every REPLICA_CHECK_S while a watch stream runs: whether the stream must be restarted
        because the replica has not reached, within REPLICA_STALL_S, a revision the engine knows exists. A lag
        episode ends when the replica reaches the revision it began with (a working watch under load reaches
        each such revision quickly; a stalled one never does). After REPLICA_RESTARTS_MAX restarts in a row
        that did not end the episode, the replica is reloaded (_reload_replica)."""
        now = time.monotonic()
        progress, seen, lag = replica.progress, self.seen_revision, self._lag
        if progress >= seen:
            self._lag = None
            self._watch_restarts = 0
            return False
        if lag is None or progress >= lag[0]:
            if lag is not None:
                self._watch_restarts = 0
            self._lag = (seen, now)
            return False
        if now - max(lag[1], self._restarted_at) < REPLICA_STALL_S:  # each stream gets REPLICA_STALL_S
            return False
        self.stats["replica_stalls"] += 1
        self.stats["watch_restarts"] += 1
        self._watch_restarts += 1
        self._restarted_at = now
        reload = self._watch_restarts >= REPLICA_RESTARTS_MAX
        log.warning("etcd KV %s: the replica's watch on %s is stalled: progress %d, revision %d known to exist "
                    "for %.1f s; %s", self.endpoints,
                    self.endpoints[self.watch_index] if self.watch_index is not None else "?", progress,
                    lag[0], now - lag[1], "loading the replica again" if reload else "restarting the stream")
        if reload:
            self._reload_replica = True
            self._watch_restarts = 0
        return True

    # -- the replica: every data key, kept exact by a watch ------------------------------------------------
    async def replica_at(self, rv: int) -> _Replica | None:
        """The live replica once its watch has reached `rv` (bounded by REPLICA_WAIT_S), else None: the
        transaction then reads etcd. A stall moves the watch to another member."""
        if not self._replica_wanted or self._closed:
            return None
        if self._replica_task is None:
            self._start_background()
        replica = self._replica
        if replica is None:
            return None
        if replica.progress < rv and self.replica_lagging(replica):
            return None  # behind for REPLICA_WAIT_S already (the watchdog restarts its stream): no more waits
        if await replica.wait(rv, REPLICA_WAIT_S):
            return replica
        if replica.live and replica.progress < rv:
            self.stats["replica_stalls"] += 1
            watch = self._watch_task
            if watch is not None:
                watch.cancel()  # the loop opens a stream on the next member
        return None

    def _start_background(self) -> None:
        """The leader check, and the replica's loop if the replica is wanted (once each)."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        if self._leader_task is None:
            self._leader_task = loop.create_task(self._leader_loop())
        if self._replica_wanted and self._replica_task is None:
            self._replica_task = loop.create_task(self._replica_loop())
        if self._stats_dir is not None and self._stats_task is None:
            self._stats_task = loop.create_task(self._stats_loop())

    async def _stats_loop(self) -> None:
        while not self._closed:  # ends with the engine (close cancels it)
            await asyncio.sleep(STATS_DUMP_S)
            self._dump_stats()

    def _dump_stats(self) -> None:
        path = os.path.join(self._stats_dir, f"etcd-{os.getpid()}-{self._engine_id.decode()}.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump({"time": time.time(), **self.stats}, f)
            os.replace(path + ".tmp", path)
        except OSError as exc:
            log.debug("etcd KV: stats not written to %s: %s", path, exc)

    async def start_replica(self, timeout_s: float = REPLICA_LOAD_WAIT_S) -> bool:
        """Start loading the replica and wait up to `timeout_s` for it; whether it is live (if not, reads go
        to etcd until it is)."""
        if self._closed:
            return False
        if self._leader_task is None:
            try:
                await self.find_leader()
            except (grpc.aio.AioRpcError, OSError):
                pass
            self._start_background()
        if not self._replica_wanted:
            return False
        deadline = time.monotonic() + timeout_s
        while self._replica is None and time.monotonic() < deadline and not self._replica_task.done():
            await asyncio.sleep(0.01)
        return self._replica is not None

    async def _replica_loop(self) -> None:
        """Load the replica, then keep it up to date through watch streams: a stream that ends (member died,
        lost its leader, stalled) is reopened on the next member from progress + 1, so nothing is missed; a
        compacted start revision (the replica fell more than etcd's history behind) loads it afresh."""
        index = self._current
        while not self._closed:  # ends with the engine (close cancels it)
            try:
                replica = self._replica
                if replica is None:
                    replica = await self._load_replica()
                    if replica is None:  # too many keys to hold: read etcd
                        await asyncio.sleep(REPLICA_TOO_BIG_RETRY_S)
                        continue
                    self._replica = replica
                    self._lag = None
                    self._watch_restarts = 0
                    self._reload_replica = False
                self._restarted_at = time.monotonic()  # the watchdog gives each stream REPLICA_STALL_S
                self.watch_index = index  # before the task runs: the leader check compares with it
                watch = self._watch_task = asyncio.ensure_future(self._watch(replica, index))
                try:
                    while not watch.done():  # the watchdog: a stream that stays open but stops delivering
                        await asyncio.wait((watch,), timeout=REPLICA_CHECK_S)
                        if not watch.done() and self._replica_stalled(replica):
                            watch.cancel()
                    await watch
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if self._closed or (current is not None and current.cancelling()):
                        raise
                    # The watchdog, replica_at or the leader check cancelled the stream: on to the next member
                finally:
                    if not watch.done():
                        watch.cancel()
                    self._watch_task = None
                if self._reload_replica:  # restarted streams did not help: load the replica afresh
                    self._reload_replica = False
                    self.stats["replica_lag_reloads"] += 1
                    replica.close()
                    self._replica = None
                    self._lag = None
            except _Compacted:
                log.warning("etcd KV %s: the replica's watch was compacted; loading it again", self.endpoints)
                if self._replica is not None:
                    self._replica.close()
                self._replica = None
                # Not the member's fault: the reloaded replica watches where requests go (moving on, as after a
                # failure, once put the new stream back on a frozen member it had just left).
                index = self._current
                continue
            except (ThreeFSError, grpc.aio.AioRpcError, ConnectionError) as exc:
                log.info("etcd KV %s: watch stream on %s ended: %s", self.endpoints, self.endpoints[index], exc)
            except Exception:  # a bug: the replica may be half-updated, so it is dropped (reads go to etcd)
                log.exception("etcd KV %s: the replica failed; loading it again", self.endpoints)
                if self._replica is not None:
                    self._replica.close()
                self._replica = None
            # The member requests go to (the leader, see _leader_loop) unless the stream just failed there.
            index = self._current if self._current != index else (index + 1) % len(self.endpoints)
            if index == self._current or len(self.endpoints) == 1:
                await asyncio.sleep(REPLICA_RETRY_S)

    async def _leader_loop(self) -> None:
        """Every LEADER_CHECK_S, send requests to the leader if another member answers them: a follower
        forwards commits to the leader and asks it for every linearizable read, one more hop each (measured
        in-process, 8 tasks of meta creates on 3 loaded members: 86/157 creates/s on the leader against 64/122
        on a follower). The watch follows (resumed from its progress)."""
        while not self._closed:  # ends with the engine (close cancels it)
            try:
                await self.find_leader()
            except (grpc.aio.AioRpcError, OSError) as exc:
                log.debug("etcd KV %s: no leader found: %s", self.endpoints, exc)
            await asyncio.sleep(LEADER_CHECK_S)

    async def find_leader(self) -> int | None:
        """Ask the members (the current one first) who leads; make the leader the current endpoint."""
        n = len(self.endpoints)
        if n == 1:
            return 0
        ids: dict[int, int] = {}
        leader = 0
        for i in [(self._current + k) % n for k in range(n)]:
            try:
                raw = await self._stubs(i)["status"](b"", timeout=LEADER_CHECK_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                continue
            status = wire.status_response(raw)
            ids[status["member_id"]] = i
            leader = leader or status["leader"]
            if leader in ids:
                break
        index = ids.get(leader)
        if index is not None:
            self._current = index
            watch = self._watch_task
            # Compared with the watch's member, not with _current: a failed or hedged request may have moved
            # _current to the new leader already, and a watch left on a cut-off member stays silent (no reset
            # crosses a cut link) while the engine's requests go elsewhere.
            if watch is not None and self.watch_index != index:
                self.stats["watch_leader_moves"] += 1
                watch.cancel()  # reopened on the leader, from its progress
        return index

    async def _load_replica(self) -> _Replica | None:
        """Every data key at one revision (paged reads at it), or None when there are over REPLICA_KEYS_MAX."""
        self.stats["replica_loads"] += 1
        # The version key must exist for read versions to be commit revisions the watch reaches.
        await self.call("txn", wire.txn_request([wire.compare(self.version_key, wire.CREATE, wire.EQUAL, 0)],
                                                [wire.op_put(wire.put_request(self.version_key, b""))]))
        start = (await self.call("range", wire.range_request(self.version_key, keys_only=True)))["header"]["revision"]
        lo, hi = self.data_prefix, key_after(self.version_key)
        counted = await self.call("range", wire.range_request(lo, hi, revision=start, count_only=True,
                                                              serializable=True))
        if counted["count"] > REPLICA_KEYS_MAX:
            log.info("etcd KV %s: %d keys, over REPLICA_KEYS_MAX (%d): no replica, reads go to etcd",
                     self.endpoints, counted["count"], REPLICA_KEYS_MAX)
            return None
        rows: list[tuple[bytes, bytes, int]] = []
        cut = len(self.data_prefix)
        while lo < hi:  # bounded: every page moves lo past the keys it returned
            reply = await self.call("range", wire.range_request(lo, hi, revision=start, limit=RANGE_PAGE,
                                                                serializable=True))
            kvs = reply["kvs"]
            rows.extend((i["key"][cut:], i["value"], i["mod_revision"]) for i in kvs
                        if i["key"].startswith(self.data_prefix))
            if not reply.get("more") or not kvs:
                break
            lo = key_after(kvs[-1]["key"])
        return _Replica(start, rows)

    async def _watch(self, replica: _Replica, index: int) -> None:
        """One watch stream on member `index` from replica.progress + 1, applying events until it ends."""
        self.stats["watch_streams"] += 1
        self.watch_index = index
        channel, _ = self._channel(index)
        # hasleader: a member cut off from its leader ends the stream instead of going silent.
        call = channel.stream_stream(wire.WATCH_METHOD)(metadata=(("hasleader", "true"),))
        cut, data_prefix = len(self.data_prefix), self.data_prefix
        try:
            await call.write(wire.watch_create_request(self.data_prefix, key_after(self.version_key),
                                                       replica.progress + 1))
            while True:  # ends with the stream
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    raise ConnectionError("the watch stream was closed")
                reply = wire.watch_response(raw)
                if reply["canceled"]:
                    if reply["compact_revision"]:
                        raise _Compacted(reply["compact_revision"])
                    raise ConnectionError(f"watch cancelled: {reply['cancel_reason'] or 'no reason given'}")
                events = reply["events"]
                if not events:
                    continue
                self.stats["watch_events"] += len(events)
                replica.apply([(key[cut:], None if kind == wire.DELETE_EVENT else value, rev)
                               for kind, key, value, rev in events if key.startswith(data_prefix)],
                              events[-1][3])
        finally:
            call.cancel()

    def read_version_blocking(self) -> int:
        """The same as read_version, for the synchronous read_version hook (see _EtcdTransaction)."""
        errors = []
        request = wire.range_request(self.clear_counter, keys_only=True)
        for endpoint in self.endpoints[self._current:] + self.endpoints[: self._current]:
            try:
                with grpc.insecure_channel(endpoint) as channel:
                    raw = channel.unary_unary(wire.METHODS["range"])(request, timeout=REQUEST_TIMEOUT_S)
                return wire.range_response(raw)["header"]["revision"]
            except grpc.RpcError as exc:
                errors.append(f"{endpoint}: {exc}")
        raise status_error(StatusCode.UNAVAILABLE, f"etcd KV: no member answered: {'; '.join(errors[-3:])}")

    async def get_at(self, key: bytes, revision: int) -> bytes | None:
        return (await self._reads.submit((key, revision)))[0]

    async def get_latest(self, key: bytes) -> tuple[bytes | None, int]:
        """(value of `key`, revision): a linearizable read, so the revision serves as a read version too
        (a transaction's first get needs no read-version round trip of its own)."""
        return await self._reads.submit((key, None))

    async def _send_reads(self, items: list[tuple[bytes, int | None]]) -> list[tuple[bytes | None, int]]:
        """One read-only Txn. Reads at a revision are serializable (any member that has applied the revision
        answers alike); a latest read makes the whole Txn linearizable and its header revision the version."""
        self.stats["read_batches"] += 1
        self.stats["reads"] += len(items)
        ops = [wire.op_range(wire.range_request(self.stored(key), revision=revision or 0,
                                                serializable=revision is not None)) for key, revision in items]
        reply = await self.call("txn", wire.txn_request([], ops))
        header_revision = reply["header"]["revision"]
        out: list[tuple[bytes | None, int]] = []
        for (_, revision), response in zip(items, reply.get("responses") or [{}] * len(items)):
            kvs = _kvs(response)
            out.append((kvs[0]["value"] if kvs else None,
                        header_revision if revision is None else revision))
        return out

    async def range_at(self, begin: bytes, end: bytes, revision: int, limit: int,
                       reverse: bool) -> list[tuple[bytes, bytes]]:
        """Pairs in [begin, end) at `revision`, in pages of RANGE_PAGE keys."""
        lo, hi = self.stored(begin), self.stored(end)
        rows: list[tuple[bytes, bytes]] = []
        while lo < hi:  # bounded: every page moves lo or hi past the keys it returned
            page = min(RANGE_PAGE, limit - len(rows)) if limit else RANGE_PAGE
            reply = await self.call("range", wire.range_request(
                lo, hi, revision=revision, limit=page, serializable=True,
                sort_order=wire.DESCEND if reverse else wire.ASCEND))
            kvs = reply["kvs"]
            rows.extend((i["key"][len(self.data_prefix):], i["value"]) for i in kvs)
            if not reply.get("more") or not kvs or len(rows) == limit:
                break
            last = kvs[-1]["key"]
            if reverse:
                hi = last
            else:
                lo = key_after(last)
        return rows

    # -- commits --------------------------------------------------------------------------------------------
    def new_ident(self) -> bytes:
        """A commit's token name, unique to this engine and commit."""
        self._commit_seq += 1
        return self._engine_id + b"-%d" % self._commit_seq

    async def commit(self, read_version: int | None, reads: list[Range], writes: WriteBuffer,
                     ident: bytes | None = None) -> int:
        """Commit `writes` if nothing written after `read_version` overlaps `reads` (module docstring).
        `ident`: the token of an earlier send of the same writes that failed its compares (a speculative
        transaction's second send, see _EtcdTransaction), so that at most one of them ever applies."""
        size = sum(len(k) + len(v or b"") for k, v in writes.ops.items()) + sum(len(b) + len(e) for b, e in reads)
        commit = _Commit(ident=ident or self.new_ident(), read_version=read_version,
                         reads=reads, writes=writes, write_ranges=writes.write_ranges(), size_bytes=size,
                         has_clear=bool(writes.cleared))
        self._last_commit = commit  # for tests
        for _ in range(COMMIT_ATTEMPTS_MAX):
            t0 = time.perf_counter()
            sent_s = self.clock()
            outcome, value = await self._commits.submit(commit)
            self.stats["commit_wait_s"] += time.perf_counter() - t0
            if outcome == "ok":
                self.acked_revision = max(self.acked_revision, value)
                self._note_revision(value)
                return value
            if outcome == "conflict":
                self.stats["conflicts"] += 1
                self._note_revision(value)
                exc = KVConflictError(StatusCode.KV_CONFLICT, f"KV conflict: a key read at version "
                                      f"{read_version} was written by a later commit")
                exc.revision = value  # the version key when it failed: a read version taken after the send
                exc.sent_s = sent_s  # (for the age of a transaction reading at it)
                raise exc
            # "clear": a clear_range committed since our read version; check its ranges exactly.
            self.stats["clear_rounds"] += 1
            commit.cr_expected = await self._check_clear_log(commit)
        raise KVConflictError(StatusCode.KV_CONFLICT, f"KV commit lost {COMMIT_ATTEMPTS_MAX} rounds to "
                              f"concurrent clear_range commits; retry")

    async def _check_clear_log(self, commit: _Commit) -> int:
        """Raise KV_CONFLICT if a clear_range logged after the read version overlaps our reads; else return cr's
        mod_revision, read at the same revision as the log."""
        assert commit.read_version is not None
        self.stats["clear_checks"] += 1
        ops = [wire.op_range(wire.range_request(self.clear_log_prefix, self.clear_log_prefix[:-1] + b"0",
                                                min_mod_revision=commit.read_version + 1)),
               wire.op_range(wire.range_request(self.clear_counter, keys_only=True))]
        reply = await self.call("txn", wire.txn_request([], ops))
        responses = reply.get("responses") or [{}, {}]
        begins = [r[0] for r in commit.reads]
        for item in _kvs(responses[0]):
            for begin, end in _LOG_DECODER.decode(item["value"]):
                hit = find_overlap(commit.reads, begins, begin, end)
                if hit is not None:
                    raise KVConflictError(StatusCode.KV_CONFLICT, f"KV conflict: range [{hit[0][:64]!r}, "
                                          f"{hit[1][:64]!r}) read at version {commit.read_version} was cleared "
                                          f"by the commit at revision {item['mod_revision']}")
        counter = _kvs(responses[1])
        return counter[0]["mod_revision"] if counter else 0

    @staticmethod
    def _pick_independent(items: list[_Commit]) -> list[int]:
        """Indexes of queued commits that may share one etcd Txn: nobody's reads overlap another's writes, no
        two write the same key (etcd refuses that), at most one clear_range (they all touch cr)."""
        chosen: list[int] = []
        reads: list[Range] = []
        writes: list[Range] = []
        size, clear = 0, False
        for i, c in enumerate(items):
            if len(chosen) >= BATCH_COMMITS_MAX or (chosen and size + c.size_bytes > BATCH_BYTES_MAX):
                break
            if c.has_clear and clear:
                continue
            if chosen and (_overlaps(c.reads, writes) or _overlaps(c.write_ranges, reads)
                           or _overlaps(c.write_ranges, writes)):
                continue
            chosen.append(i)
            reads = coalesce([*reads, *c.reads])
            writes = coalesce([*writes, *c.write_ranges])
            size += c.size_bytes
            clear = clear or c.has_clear
        return chosen

    async def _send_commits(self, batch: list[_Commit]) -> list[tuple[str, int] | BaseException]:
        self.stats["commit_batches"] += 1
        self.stats["commits"] += len(batch)
        for _ in range(3):  # a lease lost under us (expired during a long stall): take a new one
            try:
                lease = await self.lease()
                t0 = time.perf_counter()
                if len(batch) == 1:
                    reply = await self.call("txn", self._txn(batch[0], lease, stamp=True))
                    self.stats["txn_call_s"] += time.perf_counter() - t0
                    return [self._outcome(batch[0], reply, reply["header"]["revision"])]
                # The version key once, outside the nested Txns (etcd refuses a key put twice in one Txn).
                ops = [*(wire.op_txn(self._txn(c, lease)) for c in batch), self._stamp]
                reply = await self.call("txn", wire.txn_request([], ops))
                self.stats["txn_call_s"] += time.perf_counter() - t0
            except _LeaseLost:
                continue
            except ThreeFSError:
                if len(batch) == 1:
                    raise
                # The batch failed as a whole (too large, ...): each on its own, so only the culprit fails.
                self.stats["batch_splits"] += 1
                alone = await asyncio.gather(*(self._send_commits([c]) for c in batch), return_exceptions=True)
                return [r if isinstance(r, BaseException) else r[0] for r in alone]
            revision = reply["header"]["revision"]
            return [self._outcome(c, r.get("response_txn") or {}, revision)
                    for c, r in zip(batch, reply.get("responses") or [])]
        raise status_error(StatusCode.UNAVAILABLE, "etcd KV: the commit lease kept disappearing")

    def _outcome(self, commit: _Commit, reply: dict[str, Any], revision: int) -> tuple[str, int]:
        if reply.get("succeeded"):
            return "ok", revision
        responses = reply.get("responses") or [{}, {}]
        token = _kvs(responses[0])
        if token:  # an earlier send of this very commit was applied (its reply was lost)
            return "ok", token[0]["create_revision"]
        if not commit.reads:
            return "ok", revision  # unreachable: without reads only the token is compared
        counter = _kvs(responses[1])
        cr = counter[0]["mod_revision"] if counter else 0
        assert commit.read_version is not None
        moved = cr > commit.read_version if commit.cr_expected is None else cr != commit.cr_expected
        if moved:
            return "clear", 0
        # The version key as the failed Txn saw it: the latest commit under the prefix then, at or above every
        # commit acknowledged before this one was sent, and a revision the replica's watch reaches.
        stamp = _kvs(responses[2]) if len(responses) > 2 else []
        return "conflict", stamp[0]["mod_revision"] if stamp else 0

    def _txn(self, commit: _Commit, lease: int, stamp: bool = False) -> bytes:
        """The etcd Txn of one commit: compares, writes (with `stamp`, the version key too), and a failure
        branch that tells why it failed."""
        token = self.token_prefix + commit.ident
        compares = [wire.compare(token, wire.CREATE, wire.EQUAL, 0)]
        if commit.reads:
            assert commit.read_version is not None
            below = commit.read_version + 1
            for begin, end in commit.reads:
                point = end == key_after(begin)
                # A set moves the data key's own mod_revision; a delete, a clear of nothing and a write-conflict
                # key leave none there (a deleted key compares as 0), so they put the marker instead.
                compares.append(wire.compare(self.stored(begin), wire.MOD, wire.LESS, below,
                                             b"" if point else self.stored(end)))
                compares.append(wire.compare(self.marker(begin), wire.MOD, wire.LESS, below,
                                             b"" if point else self.marker(end)))
            if commit.cr_expected is None:
                compares.append(wire.compare(self.clear_counter, wire.MOD, wire.LESS, below))
            else:
                compares.append(wire.compare(self.clear_counter, wire.MOD, wire.EQUAL, commit.cr_expected))
        success = [wire.op_put(wire.put_request(token, b"", lease)), *self._write_ops(commit, lease)]
        if stamp:
            success.append(self._stamp)
        failure = [wire.op_range(wire.range_request(token, keys_only=True)),
                   wire.op_range(wire.range_request(self.clear_counter, keys_only=True)),
                   wire.op_range(wire.range_request(self.version_key, keys_only=True))]
        return wire.txn_request(compares, success, failure)

    def _write_ops(self, commit: _Commit, lease: int) -> list[bytes]:
        """The etcd ops of the writes. etcd refuses a put inside a delete_range of the same Txn, so each cleared
        range is cut around the keys set after it."""
        writes = commit.writes
        ops: list[bytes] = []
        set_keys = sorted(writes.ops)
        for begin, end in writes.cleared:
            cursor = begin
            for key in set_keys:
                if cursor <= key < end:
                    if cursor < key:
                        ops.append(wire.op_delete(wire.delete_request(self.stored(cursor), self.stored(key))))
                    cursor = key_after(key)
            if cursor < end:
                ops.append(wire.op_delete(wire.delete_request(self.stored(cursor), self.stored(end))))
        if writes.cleared:
            entry = _LOG_ENCODER.encode(writes.cleared)
            ops.append(wire.op_put(wire.put_request(self.clear_log_prefix + commit.ident, entry, lease)))
            ops.append(wire.op_put(wire.put_request(self.clear_counter, b"")))
        marked: set[bytes] = set()
        for key, value in writes.ops.items():
            if value is None:
                ops.append(wire.op_delete(wire.delete_request(self.stored(key))))
                marked.add(key)
            else:
                ops.append(wire.op_put(wire.put_request(self.stored(key), value)))
        marked.update(begin for begin, _ in writes.write_conflicts)
        for key in marked:
            ops.append(wire.op_put(wire.put_request(self.marker(key), b"", lease)))
        return ops


def _retrieve(future: asyncio.Future) -> None:
    """Done callback: a future nobody may await has its exception retrieved (asyncio would log it)."""
    if not future.cancelled():
        future.exception()


class _LeaseLost(Exception):
    """etcd no longer knows the lease a request used (it expired during a stall): take a new one."""


def _overlaps(a: list[Range], b: list[Range]) -> bool:
    """Whether any range of `a` overlaps any of coalesced `b`."""
    if not a or not b:
        return False
    begins = [r[0] for r in b]
    return any(find_overlap(b, begins, begin, end) is not None for begin, end in a)


class _EtcdTransaction(BufferedTransaction):
    """The read version comes from the cluster, which needs a network round trip: the async entry points take
    it before the shared logic runs (concurrent calls of one transaction share one). The synchronous
    `read_version` / add_read_conflict_* paths (rarely the first call of a transaction) fall back to a
    blocking request."""

    def __init__(self, engine: EtcdEngine, speculative: bool = False, ask_early: bool = False,
                 read_at: tuple[int, float] | None = None):
        super().__init__(clock=engine.clock, window_s=engine.window_s)
        self._read_at = read_at  # (read version, clock time it was taken by): no read-version request
        self.conflict_at: tuple[int, float] | None = None  # a failed commit's (version key seen, time sent)
        self._ask_early = ask_early or SPECULATIVE_EAGER_GRV
        self._engine = engine
        self._version_task: asyncio.Future | None = None
        self._replica: _Replica | None = None  # serves this transaction's reads when live at its read version
        # Speculative (only inside EtcdEngine.run): reads at the replica's progress, validated later.
        self._speculative = speculative
        self._spec_version: int | None = None  # the speculative read version, once taken
        self._snap_reads: list[Range] = []  # snapshot reads, which a speculative read version must validate too
        self._grv_task: asyncio.Future | None = None  # a true read version, asked for at the start
        self._validated: int | None = None  # a read version at which every read was shown to be current

    async def _take_read_version(self) -> None:
        if self._read_version is not None:
            return
        if self._version_task is None:
            self._version_task = asyncio.ensure_future(self._start())
        await asyncio.shield(self._version_task)

    async def _start(self) -> None:
        """Read version, then the replica once its watch has reached it (or None: reads go to etcd)."""
        taken_s = self._clock()  # before the request: the transaction's age is never under-estimated
        stats, t0 = self._engine.stats, time.perf_counter()
        if self._speculative and await self._start_speculative(taken_s):
            stats["txns"] += 1
            stats["speculative"] += 1
            stats["replica_wait_s"] += time.perf_counter() - t0
            return
        if self._read_at is not None:
            version, taken_s = self._read_at
            replica = await self._engine.replica_at(version)
            stats["txns"] += 1
            stats["conflict_rvs"] += 1
            stats["replica_wait_s"] += time.perf_counter() - t0
            if self._read_version is None:
                self._read_version = version
                self._read_time_s = taken_s
                self._replica = replica
            return
        version = await self._engine.read_version()
        t1 = time.perf_counter()
        replica = await self._engine.replica_at(version)
        stats["txns"] += 1
        stats["grv_waits"] += 1
        stats["grv_wait_s"] += t1 - t0
        stats["replica_wait_s"] += time.perf_counter() - t1
        if self._read_version is None:
            self._read_version = version
            self._read_time_s = taken_s
            self._replica = replica

    async def _start_speculative(self, taken_s: float) -> bool:
        """Read at the replica's progress without waiting for a read version (one round trip less). The
        replica first waits for this engine's own acknowledged commits (read-your-writes at no cost); what
        other engines acknowledged may be missing, which validation catches: the commit compares every
        read (snapshot ones too) against this version, and a read-only commit or an error waits for the
        read version asked for here and checks that nothing read changed up to it."""
        engine = self._engine
        replica = engine._replica
        if replica is None or not replica.live:
            return False
        if engine.replica_lagging(replica):  # its watch may be stalled: take a read version instead
            engine.stats["spec_lagging"] += 1
            return False
        if replica.progress < engine.acked_revision and not await replica.wait(engine.acked_revision,
                                                                               REPLICA_WAIT_S):
            return False
        if self._read_version is not None or not replica.live:
            return False
        self._read_version = self._spec_version = replica.progress
        self._read_time_s = taken_s
        self._replica = replica
        if SPECULATIVE_EAGER_GRV:
            self._ask_read_version()
        return True

    @property
    def speculated(self) -> bool:
        """Whether this transaction read at a speculative version (the replica's progress)."""
        return self._spec_version is not None

    def _ask_read_version(self) -> None:
        """Ask for the read version validation may need, now (once)."""
        if self._grv_task is None:
            self._grv_task = asyncio.ensure_future(self._engine.read_version())
            self._grv_task.add_done_callback(_retrieve)

    async def validate(self, seen: int = 0) -> bool:
        """Whether the reads of a speculative transaction were current: nothing read (snapshot reads
        included) changed between its speculative version and a read version taken after it began. Then
        that read version is the transaction's (`_validated`). Always True for other transactions. `seen`:
        the version key's mod_revision read by an etcd Txn sent after the transaction began (a failed first
        send), which serves as that read version without asking for one."""
        if self._spec_version is None or self._validated is not None:
            return True
        spec = self._spec_version
        reads = coalesce([*self._reads, *self._snap_reads])
        if not reads:
            self._validated = spec
            return True
        assert self._replica is not None
        if seen and self._grv_task is None:
            version = seen
        else:
            # The earliest read version taken after the transaction began is the best: the interval to check
            # is the shortest (a snapshot read's key changed after it is no conflict at all).
            self._ask_read_version()
            version = await asyncio.shield(self._grv_task)
        if version > spec:
            replica = self._replica
            if not await replica.wait(version, REPLICA_WAIT_S) or replica.changed(reads, spec, version):
                self._engine.stats["spec_stale"] += 1
                return False
        self._validated = max(version, spec)
        return True

    async def get(self, key: bytes, *, snapshot: bool = False) -> bytes | None:
        self._check_open()
        engine = self._engine
        if snapshot and self._speculative:
            await self._take_read_version()
            value = await super().get(key, snapshot=True)
            if self._spec_version is not None:
                self._snap_reads.append((key, key_after(key)))
                # A snapshot key written concurrently (a directory's record during creates beside ours) fails
                # the first send, and validation against the read version its reply carries finds it changed:
                # a retry. The retried attempt asks for a read version now, so that such a write, after it,
                # is no conflict (the second send goes without the compare).
                if self._ask_early:
                    self._ask_read_version()
            return value
        if (self._read_version is None and self._version_task is None and engine._replica is None
                and not self._writes.lookup(key)[0]):
            # No replica: the first read of the transaction is one linearizable read that gives the value and
            # the read version together.
            check_key(key)
            future = self._version_task = asyncio.get_running_loop().create_future()
            try:
                value, version = await engine.get_latest(key)
            except BaseException as exc:
                future.set_exception(exc)
                future.exception()  # retrieved: concurrent callers get it too, nobody else need look
                raise
            self._read_version = version
            self._read_time_s = self._clock()
            future.set_result(version)
            if not snapshot:
                self._add_read((key, key_after(key)))
            if engine._leader_task is None:
                engine._start_background()
            return value
        await self._take_read_version()
        return await super().get(key, snapshot=snapshot)

    async def get_range(
        self, begin: bytes, end: bytes, *, limit: int = 0, reverse: bool = False, snapshot: bool = False
    ) -> list[tuple[bytes, bytes]]:
        self._check_open()
        await self._take_read_version()
        rows = await super().get_range(begin, end, limit=limit, reverse=reverse, snapshot=snapshot)
        if snapshot and self._spec_version is not None and begin < end:
            if limit and len(rows) == limit:  # only the part up to the last key returned was read
                self._snap_reads.append((begin, key_after(rows[-1][0])) if not reverse else (rows[-1][0], end))
            else:
                self._snap_reads.append((begin, end))
            if self._ask_early:
                self._ask_read_version()
        return rows

    async def commit(self) -> int:
        try:
            return await self._commit()
        except KVConflictError as exc:
            if getattr(exc, "revision", 0):
                self.conflict_at = (exc.revision, exc.sent_s)
            raise

    async def _commit(self) -> int:
        self._check_open()
        await self._take_read_version()
        if self._spec_version is None:
            return await super().commit()
        engine = self._engine
        self._state = "failed"  # until proven otherwise (BufferedTransaction.commit's rule)
        if self._writes.is_empty():
            if not await self.validate():
                raise KVConflictError(StatusCode.KV_CONFLICT, "KV conflict: a key read was written by a "
                                      "commit the transaction should have seen")
            self._state = "committed"
            assert self._validated is not None
            return self._validated
        # First send: every read, snapshot ones too, compared against the speculative version.
        self._check_age()
        ident = engine.new_ident()
        reads = coalesce(self._reads)
        try:
            version = await engine.commit(self._spec_version, coalesce([*reads, *self._snap_reads]),
                                          self._writes, ident)
        except KVConflictError as exc:
            # Something compared changed after the speculative version. If no value read changed up to the
            # version the failed Txn saw (a write-conflict marker, a clear of nothing), the same writes are sent
            # again (same token: at most one applies) at that read version with the usual compares, where
            # snapshot reads are not compared; else it is a conflict, and run() retries at a fresher version.
            engine.stats["spec_resends"] += 1
            if not await self.validate(getattr(exc, "revision", 0)):
                raise
            assert self._validated is not None
            self._check_age()
            version = await engine.commit(self._validated if reads else None, reads, self._writes, ident)
        self._state = "committed"
        return version

    def _engine_read_version(self) -> int:
        return self._engine.read_version_blocking()

    async def _engine_get(self, key: bytes, version: int) -> bytes | None:
        replica = self._replica
        if replica is not None and replica.readable(version):
            self._engine.stats["replica_reads"] += 1
            return replica.value_at(key, version)
        self._engine.stats["replica_misses"] += replica is not None
        return await self._engine.get_at(key, version)

    async def _engine_range(
        self, begin: bytes, end: bytes, version: int, limit: int, reverse: bool
    ) -> list[tuple[bytes, bytes]]:
        replica = self._replica
        if replica is not None and replica.readable(version):
            self._engine.stats["replica_reads"] += 1
            return replica.range_at(begin, end, version, limit, reverse)
        self._engine.stats["replica_misses"] += replica is not None
        return await self._engine.range_at(begin, end, version, limit, reverse)

    async def _engine_commit(self, read_version: int | None, reads: list[Range], writes: WriteBuffer) -> int:
        return await self._engine.commit(read_version, reads, writes)


def parse_etcd_url(url: str) -> tuple[list[str], str]:
    """"etcd://h1:p1,h2:p2/prefix" -> (["h1:p1", "h2:p2"], "prefix"); prefix defaults to DEFAULT_PREFIX.
    The options (`?replica=off`) are parse_etcd_options'."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc or parts.fragment:
        raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"bad etcd KV URL {url!r}; use "
                           f"etcd://host:port[,host:port...][/prefix][?replica=off]")
    parse_etcd_options(url)
    endpoints = [e.strip() for e in parts.netloc.split(",") if e.strip()]
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"bad etcd endpoint {endpoint!r} in {url!r}; "
                               f"each must be host:port")
    prefix = parts.path.strip("/") or DEFAULT_PREFIX
    return endpoints, prefix


def parse_etcd_options(url: str) -> dict[str, Any]:
    """The URL's query as EtcdEngine keyword arguments: `replica=on|off` (default on: see _Replica)."""
    options: dict[str, Any] = {}
    query = urllib.parse.urlsplit(url).query
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError:
        pairs = [(query, "")]
    for name, value in pairs:
        if name == "replica" and value in ("on", "off"):
            options["replica"] = value == "on"
        else:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"bad etcd KV URL option {name}={value!r} in "
                               f"{url!r}; the only option is replica=on|off")
    return options


async def open_etcd(url: str) -> KVEngine:
    """`etcd://host:port[,host:port...][/prefix][?replica=off]`: keys live under `prefix/` (default "threefs")
    on that cluster. Checks that a member answers, so a wrong address fails here with UNAVAILABLE; waits (up to
    REPLICA_LOAD_WAIT_S) for the replica to load."""
    endpoints, prefix = parse_etcd_url(url)
    engine = EtcdEngine(endpoints, prefix, **parse_etcd_options(url))
    try:
        await engine.read_version()
        await engine.start_replica()
    except BaseException:
        await engine.close()
        raise
    return engine
