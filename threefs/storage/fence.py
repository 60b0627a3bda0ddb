"""Storage's side of heartbeats: the fence that makes a heartbeat a lease, and resync reports.

mgmtd fails a node that has been silent for `heartbeat_timeout_s` (T) and lets its chains go on without
it. So a storage service that has not had a heartbeat accepted for T/2 must stop serving by itself
(3FS design notes): otherwise, cut off from mgmtd but not from clients, it could keep acting as a head
while mgmtd has already given its chain a new one. Timing: a heartbeat counts from the moment it was
*sent*, which is no later than the moment mgmtd received it, so the fence (sent + T/2) always closes
before mgmtd can fail the node (received + T), whatever the network delay.
"""

from __future__ import annotations

import logging
import time

from threefs.common.status import StatusCode, status_error
from threefs.rpc.schemas import mgmtd as ms

log = logging.getLogger(__name__)

HEARTBEAT_CALL_TIMEOUT_S_MIN = 0.2


class HeartbeatFence:
    def __init__(self, node_id: int, heartbeat_timeout_s: float, heartbeat_interval_s: float,
                 clock=time.monotonic):
        self.node_id = node_id
        self.limit_s = heartbeat_timeout_s / 2
        self.clock = clock
        # A reply that comes late but inside the fence limit still keeps the fence open: under CPU
        # overload (a storage process busy with a burst of big writes on a shared 2-core machine)
        # heartbeats are answered in over a second, and a shorter timeout turned every one of them
        # into a failure, fencing a live node for good. Longer than the limit is useless.
        self.call_timeout_s = max(HEARTBEAT_CALL_TIMEOUT_S_MIN,
                                  min(max(heartbeat_interval_s, self.limit_s * 0.8), self.limit_s))
        self.last_ok: float | None = None  # clock() when the last accepted heartbeat was sent
        self.fenced_since: float | None = None
        self.fence_count = 0  # times the fence closed (metrics, tests)

    def now(self) -> float:
        return self.clock()

    @property
    def fenced(self) -> bool:
        return self.last_ok is None or self.clock() - self.last_ok > self.limit_s

    def succeeded(self, sent_at: float) -> None:
        """A heartbeat (or registration) sent at `sent_at` was accepted by the primary mgmtd."""
        if self.last_ok is None or sent_at > self.last_ok:
            self.last_ok = sent_at
        if self.fenced_since is not None and not self.fenced:
            log.warning("node %d: heartbeats accepted again after %.1f s fenced: serving", self.node_id,
                        self.clock() - self.fenced_since)
            self.fenced_since = None

    def note(self) -> bool:
        """Whether we are fenced now; logs and counts the moment the fence closes."""
        fenced = self.fenced
        if fenced and self.fenced_since is None and self.last_ok is not None:
            self.fenced_since = self.clock()
            self.fence_count += 1
            log.warning("node %d: no heartbeat accepted by mgmtd for %.1f s (limit %.1f s): fenced, "
                        "refusing reads and writes", self.node_id, self.silent_s(), self.limit_s)
        return fenced

    def check(self) -> None:
        """Raise TARGET_OFFLINE while fenced (called on every update and read)."""
        if self.note():
            raise status_error(StatusCode.TARGET_OFFLINE,
                               f"storage node {self.node_id} has not reached mgmtd for {self.silent_s():.1f} s "
                               f"(limit {self.limit_s:.1f} s) and stopped serving until it does; retry "
                               "another replica")

    def silent_s(self) -> float:
        return float("inf") if self.last_ok is None else self.clock() - self.last_ok


def sync_reports(resync, routing, engines) -> list[ms.SyncProgress]:
    """The resyncs this storage node runs now (`Resyncer.active`/`.progress`), for its heartbeat."""
    if resync is None or routing is None:
        return []
    out = []
    for target in list(resync.active):
        done, total = resync.progress.get(target, (0, 0))
        source = 0
        info = routing.info.targets.get(target)
        chain = routing.info.chains.get(info.chain_id) if info else None
        if chain is not None:
            source = next((t.target_id for t in chain.targets if t.target_id in engines), 0)
        out.append(ms.SyncProgress(target, source, done, total))
    return out
