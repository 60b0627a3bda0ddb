"""The KV engine on an etcd cluster: `open_engine("etcd://host:port[,host:port...][/prefix]")`.

Metadata on etcd survives the loss of a host: with 3 members any one may fail and the KV keeps serving.
Spoken through etcd 3.4's JSON gRPC gateway (/v3/kv/*) with httpx.

Layout under `prefix` (default "threefs"):  `prefix/d/K` holds user key K; `prefix/s` the commit counter N
(how many commits so far); `prefix/l/<N as 8 bytes>` the write log entry of commit N: (wall time, coalesced
write ranges), msgpack.

- version = etcd revision. A transaction's read version is the revision of a linearizable read of the counter,
  which also gives N_rv, the number of commits it sees. Reads are etcd range requests *at that revision*, so
  etcd's own MVCC gives the snapshot, until etcd compacts that revision ("required revision has been
  compacted" becomes KV_TOO_OLD): the server must keep more history than MVCC_WINDOW_S.
- Conflicts are checked as SQLite does it, against a write log, because etcd's compares cannot express
  FoundationDB's conflict ranges: a compare on mod_revision over a range misses keys deleted from it, and a
  clear_range must conflict with readers of keys that did not exist. Commit: (1) one read-only Txn reads the
  counter (N, its mod_revision) and the log entries N_rv+1 .. N at one revision; any overlap of their write
  ranges with our read ranges is KV_CONFLICT; a gap (entries already collected) is KV_TOO_OLD. (2) one Txn,
  on condition that the counter is unchanged, sets counter N+1, adds log entry N+1 and applies the writes
  (puts, deletes, and delete_range for clear_range split around keys set after it). If another commit got
  in between, the condition fails and (1) runs again for the new entries (COMMIT_ATTEMPTS_MAX times). So
  commits are serialised by the counter, exactly like SQLite's write lock, and all-or-nothing in one Txn.
  Fast path: the first try skips (1) and conditions (2) on the counter being as it was at the read version
  (no commit since our snapshot, so nothing to conflict with): one round trip when there is no contention.
- Log GC: a commit at most every GC_INTERVAL_S also deletes log entries older than LOG_KEEP_S (wall time,
  several MVCC windows: a transaction that old fails its age check anyway, so clocks of hosts must agree to
  within LOG_KEEP_S - MVCC_WINDOW_S).

Failover: the client knows every endpoint; a connection error, a timeout or "no leader" moves it to the next
endpoint until REQUEST_DEADLINE_S. A commit whose reply was lost is resent; the counter compare makes a resend
of an applied commit fail, and the retry then finds its own log entry: with read conflicts that is a
KV_CONFLICT (run() retries, like FoundationDB's commit_unknown_result), without reads it commits again
(blind writes are idempotent).

Limits: etcd refuses requests over --max-request-bytes (default 1.5 MiB) and Txns with more than
--max-txn-ops operations (default 128); both become KV_TOO_LARGE with the server's message. Run etcd with
the flags in threefs.testing.etcd_cluster (16 MiB, 100,000 ops) to fit TXN_BYTES_MAX.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import struct
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from threefs.common.status import KVConflictError, StatusCode, ThreeFSError, status_error
from threefs.kv.api import MVCC_WINDOW_S, KVEngine, Transaction
from threefs.kv.txn import BufferedTransaction, Range, WriteBuffer, find_overlap, key_after

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "threefs"
ENDPOINTS_MAX = 16
REQUEST_TIMEOUT_S = 3.0  # one HTTP request to one member; then the next member is tried
REQUEST_DEADLINE_S = 15.0  # all members, retried: longer than an etcd leader election
RETRY_PAUSE_S = 0.1  # between rounds over all members
COMMIT_ATTEMPTS_MAX = 200  # rounds lost to concurrent commits before KV_CONFLICT (run() retries that too)
COMMIT_BACKOFF_S_MAX = 0.01  # jittered pause after a lost round, so racing committers spread out
RANGE_PAGE = 1000  # keys per range request
GC_INTERVAL_S = 1.0
LOG_KEEP_S = 4 * MVCC_WINDOW_S
GC_SCAN_MAX = 1000  # log entries looked at per GC (bounds the extra work of the commit that does it)

_TRANSIENT_ERRORS = ("no leader", "leader changed", "timed out", "not capable", "unhealthy", "stopped",
                     "too many requests", "connection")
_TOO_LARGE_ERRORS = ("too many operations", "request is too large", "message larger than max",
                     "received message larger")
_LOG_ENCODER = msgspec.msgpack.Encoder()
_LOG_DECODER = msgspec.msgpack.Decoder(tuple[float, list[tuple[bytes, bytes]]])


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _span(begin: bytes, end: bytes) -> dict[str, str]:
    return {"key": _b64(begin), "range_end": _b64(end)}


def _range_op(body: dict[str, Any]) -> dict[str, Any]:
    return {"request_range": body}


def _kvs(response: dict[str, Any]) -> list[dict[str, Any]]:
    return (response.get("response_range") or {}).get("kvs") or []


class EtcdEngine(KVEngine):
    """The KV on an etcd cluster. `clock` (seconds) drives the MVCC window and log ages; tests may fake it."""

    def __init__(self, endpoints: list[str], prefix: str = DEFAULT_PREFIX, *,
                 clock: Callable[[], float] = time.time, window_s: float = MVCC_WINDOW_S,
                 request_deadline_s: float = REQUEST_DEADLINE_S):
        if not endpoints or len(endpoints) > ENDPOINTS_MAX:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"etcd KV needs 1..{ENDPOINTS_MAX} endpoints, "
                               f"got {len(endpoints)}")
        self.endpoints = [f"http://{e}" for e in endpoints]
        base = prefix.encode()
        self.data_prefix = base + b"/d/"
        self.counter_key = base + b"/s"
        self.log_prefix = base + b"/l/"
        self.clock = clock
        self.window_s = window_s
        self._current = 0  # index of the endpoint that answered last
        self._client: httpx.AsyncClient | None = None
        self._closed = False
        self._gc_next_s = 0.0
        self.request_deadline_s = request_deadline_s
        self._commit_lock = asyncio.Lock()

    def transaction(self) -> Transaction:
        if self._closed:
            raise status_error(StatusCode.KV_ERROR, f"etcd KV {self.endpoints} is closed")
        return _EtcdTransaction(self)

    async def close(self) -> None:
        self._closed = True
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- requests -------------------------------------------------------------------------------------------
    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to /v3/kv/`path` on a live member; failover to the others until REQUEST_DEADLINE_S."""
        if self._closed:
            raise status_error(StatusCode.KV_ERROR, f"etcd KV {self.endpoints} is closed")
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S)
        deadline = time.monotonic() + self.request_deadline_s
        errors: list[str] = []
        while True:  # bounded by the deadline
            for _ in range(len(self.endpoints)):
                endpoint = self.endpoints[self._current]
                try:
                    response = await self._client.post(f"{endpoint}/v3/kv/{path}", json=body)
                    reply = response.json()
                except (httpx.HTTPError, ValueError) as exc:
                    errors.append(f"{endpoint}: {type(exc).__name__} {exc}")
                else:
                    if response.status_code == 200:
                        return reply
                    message = str(reply.get("error") or reply.get("message") or response.text)
                    self._raise_permanent(message)
                    errors.append(f"{endpoint}: {message}")
                self._current = (self._current + 1) % len(self.endpoints)
            if time.monotonic() + RETRY_PAUSE_S > deadline:
                raise status_error(StatusCode.UNAVAILABLE, f"etcd KV: no member answered within "
                                   f"{self.request_deadline_s} s; last errors: {'; '.join(errors[-3:])}")
            await asyncio.sleep(RETRY_PAUSE_S)

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

    def log_key(self, number: int) -> bytes:
        return self.log_prefix + struct.pack(">Q", number)

    # -- called by _EtcdTransaction -------------------------------------------------------------------------
    def _counter_of(self, reply: dict[str, Any]) -> tuple[int, int]:
        """(commit count, its mod_revision) from a range reply of the counter key; (0, 0) before any commit."""
        kvs = reply.get("kvs") or []
        if not kvs:
            return 0, 0
        return struct.unpack(">Q", _unb64(kvs[0]["value"]))[0], int(kvs[0]["mod_revision"])

    async def read_version(self) -> tuple[int, tuple[int, int]]:
        """(read version, (commits visible at it, the counter's mod_revision))."""
        reply = await self.call("range", {"key": _b64(self.counter_key)})
        return int(reply["header"]["revision"]), self._counter_of(reply)

    def read_version_blocking(self) -> tuple[int, tuple[int, int]]:
        """The same as read_version, for the synchronous read_version hook (see _EtcdTransaction)."""
        errors = []
        for endpoint in self.endpoints[self._current:] + self.endpoints[: self._current]:
            try:
                response = httpx.post(f"{endpoint}/v3/kv/range", json={"key": _b64(self.counter_key)},
                                      timeout=REQUEST_TIMEOUT_S)
                if response.status_code == 200:
                    reply = response.json()
                    return int(reply["header"]["revision"]), self._counter_of(reply)
                errors.append(response.text)
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(f"{endpoint}: {exc}")
        raise status_error(StatusCode.UNAVAILABLE, f"etcd KV: no member answered: {'; '.join(errors[-3:])}")

    async def get_at(self, key: bytes, revision: int) -> bytes | None:
        reply = await self.call("range", {"key": _b64(self.stored(key)), "revision": str(revision)})
        kvs = reply.get("kvs") or []
        return _unb64(kvs[0].get("value", "")) if kvs else None

    async def range_at(self, begin: bytes, end: bytes, revision: int, limit: int,
                       reverse: bool) -> list[tuple[bytes, bytes]]:
        """Pairs in [begin, end) at `revision`, in pages of RANGE_PAGE keys."""
        lo, hi = self.stored(begin), self.stored(end)
        rows: list[tuple[bytes, bytes]] = []
        while lo < hi:  # bounded: every page moves lo or hi past the keys it returned
            page = min(RANGE_PAGE, limit - len(rows)) if limit else RANGE_PAGE
            reply = await self.call("range", {**_span(lo, hi), "revision": str(revision), "limit": str(page),
                                              "sort_target": "KEY", "sort_order": "DESCEND" if reverse else "ASCEND"})
            kvs = reply.get("kvs") or []
            rows.extend((_unb64(i["key"])[len(self.data_prefix):], _unb64(i.get("value", ""))) for i in kvs)
            if not reply.get("more") or not kvs or len(rows) == limit:
                break
            last = _unb64(kvs[-1]["key"])
            if reverse:
                hi = last
            else:
                lo = key_after(last)
        return rows

    async def commit(self, seen: tuple[int, int], read_version: int | None, reads: list[Range],
                     writes: WriteBuffer) -> int:
        """Commit `writes` if no commit after the first `seen[0]` wrote into `reads` (module docstring).
        `seen` is (commit count, counter mod_revision) at the read version."""
        ops = self._write_ops(writes)
        entry = _LOG_ENCODER.encode((self.clock(), writes.write_ranges()))
        begins = [r[0] for r in reads]
        async with self._commit_lock:  # racing our own commits on the counter would only waste round trips
            return await self._commit_rounds(seen, read_version, reads, begins, ops, entry)

    async def _commit_rounds(self, seen: tuple[int, int], read_version: int | None, reads: list[Range],
                             begins: list[bytes], ops: list[dict[str, Any]], entry: bytes) -> int:
        count, counter_rev = seen
        # Fast path: if nobody committed since our read version, nothing can conflict; the counter compare
        # proves it, so the log need not be read (one round trip). Otherwise, and when a GC is due, check.
        fast = self.clock() < self._gc_next_s
        for _ in range(COMMIT_ATTEMPTS_MAX):
            gc_end = None
            if not fast:
                count, counter_rev, gc_end = await self._check_log(count, read_version, reads, begins)
            fast = False
            success = [{"request_put": {"key": _b64(self.counter_key), "value": _b64(struct.pack(">Q", count + 1))}},
                       {"request_put": {"key": _b64(self.log_key(count + 1)), "value": _b64(entry)}}, *ops]
            if gc_end is not None:
                success.append({"request_delete_range": _span(self.log_prefix, gc_end)})
            compare = [{"key": _b64(self.counter_key), "target": "MOD", "result": "EQUAL",
                        "mod_revision": str(counter_rev)}]
            reply = await self.call("txn", {"compare": compare, "success": success})
            if reply.get("succeeded"):
                return int(reply["header"]["revision"])
            await asyncio.sleep(random.uniform(0, COMMIT_BACKOFF_S_MAX))  # another commit got in first
        raise KVConflictError(StatusCode.KV_CONFLICT, f"KV commit lost {COMMIT_ATTEMPTS_MAX} rounds to concurrent "
                              f"commits; retry")

    async def _check_log(self, seen: int, read_version: int | None, reads: list[Range],
                         begins: list[bytes]) -> tuple[int, int, bytes | None]:
        """Read the counter and log entries after `seen` at one revision; raise on a conflict. Returns (commit
        count, counter mod_revision, end of the log range to collect or None)."""
        ops = [_range_op({"key": _b64(self.counter_key)}),
               _range_op(_span(self.log_key(seen + 1), key_after(self.log_key(2**64 - 1))))]
        gc = self.clock() >= self._gc_next_s
        if gc:
            self._gc_next_s = self.clock() + GC_INTERVAL_S
            ops.append(_range_op({**_span(self.log_prefix, self.log_key(seen + 1)), "limit": str(GC_SCAN_MAX)}))
        reply = await self.call("txn", {"success": ops})
        responses = reply.get("responses") or []
        count, counter_rev = self._counter_of(responses[0].get("response_range") or {})
        entries = _kvs(responses[1])
        if read_version is not None and count > seen:
            first = struct.unpack(">Q", _unb64(entries[0]["key"])[len(self.log_prefix):])[0] if entries else None
            if first != seen + 1:
                raise status_error(StatusCode.KV_TOO_OLD, f"etcd KV: the write log after commit {seen} was "
                                   f"already collected; the transaction is too old, retry with a new one")
            for item in entries:
                for begin, end in _LOG_DECODER.decode(_unb64(item["value"]))[1]:
                    hit = find_overlap(reads, begins, begin, end)
                    if hit is not None:
                        raise KVConflictError(StatusCode.KV_CONFLICT, f"KV conflict: range [{hit[0][:64]!r}, "
                                              f"{hit[1][:64]!r}) read at version {read_version} was written by "
                                              f"commit {int(item['create_revision'])}")
        return count, counter_rev, self._gc_end(_kvs(responses[2])) if gc else None

    def _gc_end(self, oldest: list[dict[str, Any]]) -> bytes | None:
        """The end of the run of log entries older than LOG_KEEP_S at the start of `oldest`, if any."""
        cutoff_s = self.clock() - LOG_KEEP_S
        end = None
        for item in oldest:
            if _LOG_DECODER.decode(_unb64(item["value"]))[0] >= cutoff_s:
                break
            end = key_after(_unb64(item["key"]))
        return end

    def _write_ops(self, writes: WriteBuffer) -> list[dict[str, Any]]:
        """The etcd ops of `writes`. etcd refuses a put inside a delete_range of the same Txn, so each cleared
        range is cut around the keys set after it."""
        ops: list[dict[str, Any]] = []
        set_keys = sorted(writes.ops)
        for begin, end in writes.cleared:
            cursor = begin
            for key in set_keys:
                if cursor <= key < end:
                    if cursor < key:
                        ops.append({"request_delete_range": _span(self.stored(cursor), self.stored(key))})
                    cursor = key_after(key)
            if cursor < end:
                ops.append({"request_delete_range": _span(self.stored(cursor), self.stored(end))})
        for key, value in writes.ops.items():
            if value is None:
                ops.append({"request_delete_range": {"key": _b64(self.stored(key))}})
            else:
                ops.append({"request_put": {"key": _b64(self.stored(key)), "value": _b64(value)}})
        return ops


class _EtcdTransaction(BufferedTransaction):
    """The read version comes from the cluster, which needs a network round trip: the async entry points take
    it before the shared logic runs. The synchronous `read_version` / add_read_conflict_* paths (rarely the
    first call of a transaction) fall back to a blocking request."""

    def __init__(self, engine: EtcdEngine):
        super().__init__(clock=engine.clock, window_s=engine.window_s)
        self._engine = engine
        self._seen: tuple[int, int] | None = None  # (commit count, counter mod_revision) at the read version

    async def _take_read_version(self) -> None:
        if self._read_version is None:
            self._read_version, self._seen = await self._engine.read_version()
            self._read_time_s = self._clock()

    async def get(self, key: bytes, *, snapshot: bool = False) -> bytes | None:
        self._check_open()
        await self._take_read_version()
        return await super().get(key, snapshot=snapshot)

    async def get_range(
        self, begin: bytes, end: bytes, *, limit: int = 0, reverse: bool = False, snapshot: bool = False
    ) -> list[tuple[bytes, bytes]]:
        self._check_open()
        await self._take_read_version()
        return await super().get_range(begin, end, limit=limit, reverse=reverse, snapshot=snapshot)

    async def commit(self) -> int:
        self._check_open()
        await self._take_read_version()
        return await super().commit()

    def _engine_read_version(self) -> int:
        version, self._seen = self._engine.read_version_blocking()
        return version

    async def _engine_get(self, key: bytes, version: int) -> bytes | None:
        return await self._engine.get_at(key, version)

    async def _engine_range(
        self, begin: bytes, end: bytes, version: int, limit: int, reverse: bool
    ) -> list[tuple[bytes, bytes]]:
        return await self._engine.range_at(begin, end, version, limit, reverse)

    async def _engine_commit(self, read_version: int | None, reads: list[Range], writes: WriteBuffer) -> int:
        assert self._seen is not None
        return await self._engine.commit(self._seen, read_version, reads, writes)


def parse_etcd_url(url: str) -> tuple[list[str], str]:
    """"etcd://h1:p1,h2:p2/prefix" -> (["h1:p1", "h2:p2"], "prefix"); prefix defaults to DEFAULT_PREFIX."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "etcd" or not parts.netloc or parts.query or parts.fragment:
        raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"bad etcd KV URL {url!r}; use "
                           f"etcd://host:port[,host:port...][/prefix]")
    endpoints = [e.strip() for e in parts.netloc.split(",") if e.strip()]
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"bad etcd endpoint {endpoint!r} in {url!r}; "
                               f"each must be host:port")
    prefix = parts.path.strip("/") or DEFAULT_PREFIX
    return endpoints, prefix


async def open_etcd(url: str) -> KVEngine:
    """`etcd://host:port[,host:port...][/prefix]`: keys live under `prefix/` (default "threefs") on that
    cluster. Checks that a member answers, so a wrong address fails here with UNAVAILABLE."""
    endpoints, prefix = parse_etcd_url(url)
    engine = EtcdEngine(endpoints, prefix)
    try:
        await engine.read_version()
    except BaseException:
        await engine.close()
        raise
    return engine
