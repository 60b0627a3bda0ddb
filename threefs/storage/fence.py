"""Storage's side of heartbeats: the fence that makes a heartbeat a lease, and resync reports.

mgmtd fails a node that has been silent for `heartbeat_timeout_s` (T) and lets its chains go on without
it. So a storage service that has not had a heartbeat accepted for T/2 must stop serving by itself
(3FS design notes): otherwise, cut off from mgmtd but not from clients, it could keep acting as a head
while mgmtd has already given its chain a new one. Timing: a heartbeat counts from the moment it was
*sent*, which is no later than the moment mgmtd received it, so the fence (sent + T/2) always closes
before mgmtd can fail the node (received + T), whatever the network delay.
"""

from __future__ import annotations

import asyncio
import logging
import time

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.schemas import mgmtd as ms

log = logging.getLogger(__name__)

HEARTBEAT_CALL_TIMEOUT_S_MIN = 0.2
HEARTBEAT_RESEND_S = 0.25  # a mgmtd that answered NOT_PRIMARY (or could not be reached) is asked again this soon
_NOT_THE_PRIMARY = (StatusCode.NOT_PRIMARY, StatusCode.UNAVAILABLE, StatusCode.TIMEOUT)


async def heartbeat_every_mgmtd(mgmtd, req, rsp_type, timeout_s: float, clock=time.monotonic,
                                resend_s: float = HEARTBEAT_RESEND_S):
    """Send one heartbeat to every known mgmtd at once; returns (the primary's reply, when that copy was sent).

    One copy per address, each asked again every `resend_s` while it answers NOT_PRIMARY or fails, until
    one is accepted by a primary or `timeout_s` has passed. So a stalled old primary (whose connection
    hangs until a timeout) never delays the copy to the standby that is taking over, and the copy sent
    right after its takeover is the one accepted (docs/architecture.md, "The margins, derived"). The
    primary drops duplicates by `hb_version`. Any other error of a primary (NODE_NOT_FOUND, ...) is raised.
    """
    deadline = clock() + timeout_s
    addrs = list(dict.fromkeys(mgmtd.addrs))
    errors: dict[str, str] = {}

    async def one(addr: str):
        while True:
            left = deadline - clock()
            if left <= 0:
                raise status_error(StatusCode.TIMEOUT, f"{addr}: no answer within {timeout_s:.1f} s")
            sent = clock()
            try:
                rsp, _ = await mgmtd.rpc.call(addr, "mgmtd.heartbeat", req, rsp_type, timeout=left)
                return addr, rsp, sent
            except ThreeFSError as e:
                if e.code not in _NOT_THE_PRIMARY:
                    raise
                errors[addr] = e.message
            await asyncio.sleep(min(resend_s, max(0.0, deadline - clock())))

    tasks = [asyncio.ensure_future(one(a)) for a in addrs]
    try:
        for fut in asyncio.as_completed(tasks):
            try:
                addr, rsp, sent = await fut
            except ThreeFSError as e:
                if e.code not in _NOT_THE_PRIMARY:
                    raise
                continue
            if addr != mgmtd.addrs[0]:
                mgmtd._prefer(addr)  # the primary: routing refreshes go there first
            return rsp, sent
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    raise status_error(StatusCode.UNAVAILABLE, "no primary mgmtd accepted the heartbeat: "
                       + "; ".join(f"{a}: {m}" for a, m in errors.items()))


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
        self.fenced_s_total = 0.0  # time spent fenced, summed over fence events (metrics)
        # What was late (metrics): the longest a heartbeat took from send to its accepted reply, and the
        # longest time without an accepted heartbeat (measured when one is accepted again).
        self.rtt_s_max = 0.0
        self.gap_s_max = 0.0

    def now(self) -> float:
        return self.clock()

    @property
    def fenced(self) -> bool:
        return self.last_ok is None or self.clock() - self.last_ok > self.limit_s

    def succeeded(self, sent_at: float) -> None:
        """A heartbeat (or registration) sent at `sent_at` was accepted by the primary mgmtd."""
        now = self.clock()
        self.rtt_s_max = max(self.rtt_s_max, now - sent_at)
        if self.last_ok is not None:
            self.gap_s_max = max(self.gap_s_max, now - self.last_ok)
        if self.last_ok is None or sent_at > self.last_ok:
            self.last_ok = sent_at
        if self.fenced_since is not None and not self.fenced:
            self.fenced_s_total += now - self.fenced_since
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
