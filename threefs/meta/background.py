"""The meta service's background work: GC of unlinked files and removed trees, client liveness (and the
pruning of write sessions of clients that went away), and pruning of idempotency records.

Client sessions (why this shape). 3FS clients renew a session with mgmtd every 10 s and meta prunes the file
sessions of clients mgmtd no longer lists. Here clients do not register anywhere; instead every meta call
counts as a sign of life: a server notes (in memory) the client id of each call and writes the last-seen
times to the KV every CLIENT_FLUSH_S (one small transaction for all clients seen, not a write per call).
Opening a file for writing also stamps the client's record in the open's own transaction (unless this
server stamped it less than a quarter timeout ago, so the record is fresh anyway), so a session never
exists without a live record. Clients call `meta.keepalive` every 10 s (AsyncClient does) so an idle
writer stays alive. One meta server (the lowest live node id) prunes: it scans the session table for the
sessions of clients silent for longer than the timeout, measures the exact length of every file they had
open for writing (the data is on storage even if the close never came), then drops the sessions, which
frees unlinked files for GC. A server that started less than one timeout ago does not prune: clients may
not have reached it yet. (No per-client index of sessions: open files are few, and the table is scanned
only when some client has gone silent.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.meta.data import DataOps
from threefs.meta.ops_attr import LengthUpdate
from threefs.meta.schema import DIRECTORY, GcEntry
from threefs.meta.store import MetaStore

log = logging.getLogger(__name__)

GC_BATCH = 128  # entries taken per GC pass (their files' chunks go in one request per chain)
GC_PARALLEL = 8  # removed trees stepped through at once
GC_DIR_STEPS_PER_PASS = 64  # pages of one removed tree moved per pass (others get their turn)
CLIENT_FLUSH_S = 2.0
CLIENT_FLUSH_BATCH = 512  # client records written per transaction
STAMPED_CLIENTS_MAX = 100_000  # clients remembered as recently stamped
SESSIONS_PER_DROP = 256  # sessions of one client dropped per transaction
IDEM_TTL_S = 600.0  # how long a mutation's reply is kept for retries (3FS: 30 min; our retries take < 1 min)
IDEM_PRUNE_S = 30.0
CLIENT_PRUNE_S = 5.0


class GcWorker:
    """Collects queued entries: removed trees page by page, files after `delay_s` without writers."""

    def __init__(self, store: MetaStore, data: DataOps, delay_s: float,
                 owns: Callable[[], Callable[[int], bool]], clock_ns: Callable[[], int] = time.time_ns):
        self.store, self.data, self.delay_s, self.owns, self.clock_ns = store, data, delay_s, owns, clock_ns
        self.collected_files = 0

    async def run(self, interval_s: float) -> None:
        """Runs for the service's lifetime; a pass that found work is followed by another at once."""
        while True:
            busy = False
            try:
                busy = await self.pass_once() > 0
            except ThreeFSError as e:
                log.warning("GC pass failed (will retry): %s", e)
            except Exception:
                log.exception("GC pass failed (will retry)")
            if not busy:
                await asyncio.sleep(interval_s)

    async def pass_once(self) -> int:
        """One pass over the ready part of the queue; returns the number of entries worked on. The files of
        a pass lose their chunks together (one request per chain for all of them, DataOps.remove_files) and
        are forgotten GC_DONE_PER_TXN per transaction; a file a chain failed for stays queued, and the pass
        then raises that error (after the rest is done), so the next pass comes after the usual pause."""
        cutoff_ns = self.clock_ns() - int(self.delay_s * 1e9)
        owns = self.owns()
        entries = [e for e in await self.store.gc_pending(GC_BATCH, cutoff_ns) if owns(e.inode)]
        dirs = [e for e in entries if e.type == DIRECTORY]
        files = [e for e in entries if e.type != DIRECTORY]
        limit = asyncio.Semaphore(GC_PARALLEL)

        async def one_dir(entry: GcEntry) -> None:
            async with limit:
                for _ in range(GC_DIR_STEPS_PER_PASS):
                    if await self.store.gc_dir_step(entry):
                        return

        await asyncio.gather(*(one_dir(e) for e in dirs))
        failed = await self.data.remove_files([(e.inode, e.layout) for e in files if e.layout is not None])
        dropped, left = await self.store.gc_done_many([e for e in files if e.inode not in failed])
        self.collected_files += dropped
        if left:
            entry, why = left[0]
            raise status_error(StatusCode.INTERNAL, f"GC left {len(left)} files queued (inode {entry.inode}: {why})")
        if failed:
            inode, error = next(iter(failed.items()))
            raise status_error(error.code, f"chunks of {len(failed)} of {len(files)} files not removed "
                               f"(inode {inode}: {error.message}); they stay queued")
        return len(entries)


class ClientSessions:
    """Last-seen times of clients, and pruning of the write sessions of silent ones (see module doc)."""

    def __init__(self, store: MetaStore, data: DataOps, timeout_s: float,
                 clock_ns: Callable[[], int] = time.time_ns):
        self.store, self.data, self.timeout_s, self.clock_ns = store, data, timeout_s, clock_ns
        self.started_ns = clock_ns()
        self._seen: dict[str, int] = {}
        self._stamped: dict[str, int] = {}  # client -> when an open last wrote its record (bounded below)
        self._idem_cursor = b""
        self.pruned_sessions = 0

    def seen(self, client_id: str) -> None:
        if client_id:
            self._seen[client_id] = self.clock_ns()

    def needs_stamp(self, client_id: str) -> bool:
        """Whether a write-open by this client should also write its record (see module doc)."""
        now = self.clock_ns()
        if now - self._stamped.get(client_id, 0) < self.timeout_s * 1e9 / 4:
            return False
        if len(self._stamped) >= STAMPED_CLIENTS_MAX:
            self._stamped.clear()  # forgetting only costs an extra write per client
        self._stamped[client_id] = now
        return True

    async def flush(self) -> None:
        seen, self._seen = self._seen, {}
        items = list(seen.items())
        for i in range(0, len(items), CLIENT_FLUSH_BATCH):
            await self.store.touch_clients(dict(items[i:i + CLIENT_FLUSH_BATCH]))

    async def run(self, is_leader: Callable[[], bool]) -> None:
        """Runs for the service's lifetime: flush last-seen times; the leader prunes."""
        next_prune = next_idem = 0.0
        while True:
            await asyncio.sleep(CLIENT_FLUSH_S)
            try:
                await self.flush()
                now = time.monotonic()
                if is_leader() and now >= next_prune:
                    next_prune = now + min(CLIENT_PRUNE_S, self.timeout_s / 2)
                    await self.prune()
                if is_leader() and now >= next_idem:
                    next_idem = now + IDEM_PRUNE_S
                    await self.prune_idem()
            except ThreeFSError as e:
                log.warning("client session upkeep failed (will retry): %s", e)
            except Exception:
                log.exception("client session upkeep failed (will retry)")

    async def prune(self) -> int:
        """Drop the write sessions of clients silent past the timeout; returns sessions dropped."""
        now = self.clock_ns()
        timeout_ns = int(self.timeout_s * 1e9)
        if now - self.started_ns < timeout_ns:
            return 0
        silent_since = now - timeout_ns
        stale = set(await self.store.stale_clients(silent_since))
        if not stale:
            return 0
        sessions, complete = await self.store.sessions_of(stale, silent_since)
        by_client: dict[str, list[tuple[int, str]]] = {client: [] for client in stale}
        for inode, session, client_id in sessions:
            by_client.setdefault(client_id, []).append((inode, session))
        dropped = 0
        for client_id, mine in by_client.items():
            dropped += await self._prune_client(client_id, mine, silent_since, complete)
        self.pruned_sessions += dropped
        return dropped

    async def _prune_client(self, client_id: str, sessions: list[tuple[int, str]], silent_since: int,
                            complete: bool) -> int:
        for inode in sorted({inode for inode, _ in sessions}):
            try:  # the dead writer's data is on storage: make the length cover it before the session goes
                await self.data.sync_exact(inode, "", LengthUpdate(), "", end_session=False)
            except ThreeFSError as e:
                if e.code != StatusCode.NOT_FOUND:  # collected already
                    raise
        for i in range(0, max(len(sessions), 1), SESSIONS_PER_DROP):
            part = sessions[i:i + SESSIONS_PER_DROP]
            last = i + SESSIONS_PER_DROP >= len(sessions)
            if not await self.store.drop_sessions(client_id, part, silent_since, forget=complete and last):
                return i
        if sessions:
            log.info("pruned %d write sessions of client %s (silent for over %.0f s)", len(sessions),
                     client_id, self.timeout_s)
        return len(sessions)

    async def prune_idem(self) -> int:
        cutoff = self.clock_ns() - int(IDEM_TTL_S * 1e9)
        self._idem_cursor, dropped = await self.store.prune_idem(self._idem_cursor, cutoff)
        return dropped
