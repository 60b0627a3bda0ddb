"""An unclean mgmtd failover fences no healthy storage node and fails no client write (issue 23, item 2).

With the derived defaults (T = 12 s, so the fence F = 6 s; lease L = 2.5 s; docs/architecture.md, "The
margins, derived"), the heartbeat gap of an unclean failover, H + L + R + 0.25 s + 3C + 2 rtt, stays under F:
storage sends each heartbeat to every mgmtd at once, so the copy to the standby that takes over is accepted
as soon as it is primary, whatever the old primary does (dead: kill -9; stalled past its lease: SIGSTOP).
Asserted: no storage fence event (`threefs_storage_fence_events`), no failed client write, every node alive.
No timing is asserted; waits have deadlines.
"""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request

from threefs.client.client import Client
from threefs.common.config import ServiceConfig
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas.common import Empty
from threefs.testing import checks


DEADLINE_S = 60.0


def status(fs: Client) -> ms.MgmtdStatusRsp:
    return fs.run(fs.aio.mgmtd.call("status", Empty(), ms.MgmtdStatusRsp))


def probe(fs: Client, addr: str) -> ms.PrimaryRsp | None:
    try:
        rsp, _ = fs.run(fs.aio.rpc.call(addr, "mgmtd.get_primary", Empty(), ms.PrimaryRsp, timeout=1.0))
        return rsp
    except OSError:
        return None


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(m.group(2)) for line in text.splitlines()
               if (m := re.match(r"^([a-zA-Z_:]+)(?:\{.*\})? ([0-9.e+-]+)$", line)) and m.group(1) == name)


DEFAULTS = ServiceConfig(type="storage", name="x", node_id=1)
STORAGE = ("storage-1", "storage-2", "storage-3")


def fences(cluster) -> float:
    return sum(metric(cluster.metrics_url(n), "threefs_storage_fence_events") for n in STORAGE)


class Writer:
    """Writes small files without pause on its own thread; counts what failed."""

    def __init__(self, fs: Client, prefix: str):
        self.fs, self.prefix = fs, prefix
        self.ok, self.failed = 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        self.fs.mkdir(self.prefix, exist_ok=True)
        i = 0
        while not self.stop.is_set():
            data = i.to_bytes(4, "little") * 2048
            try:
                self.fs.write_bytes(f"{self.prefix}/f{i}", data)
                assert self.fs.read_bytes(f"{self.prefix}/f{i}") == data
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is the test's finding
                self.failed.append(repr(e))
            i += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=DEADLINE_S)


def failover(cluster, fs: Client, fault) -> None:
    before = status(fs)
    old = before.primary
    survivor = next(a for a in fs.aio.config.mgmtd if a != old.addr)
    fenced_before = fences(cluster)
    with Writer(fs, f"/uf{old.node_id}") as w:
        checks.wait_for(lambda: w.ok >= 3, "writes before the fault", DEADLINE_S)
        fault(f"mgmtd-{old.node_id}")
        checks.wait_for(lambda: (p := probe(fs, survivor)) is not None and p.is_primary,
                        "the standby to become primary", DEADLINE_S)
        done = w.ok
        checks.wait_for(lambda: w.ok >= done + 3, "writes after the takeover", DEADLINE_S)
    assert w.failed == []
    assert fences(cluster) == fenced_before  # no storage node fenced itself, not even for a moment
    after = status(fs)
    assert after.primary.node_id != old.node_id
    assert all(n.alive for n in after.routing.nodes.values())
    assert all(t.public_state == ms.SERVING for c in after.routing.chains.values() for t in c.targets)


def test_unclean_failovers_fence_nobody(private_cluster):
    cluster = private_cluster(heartbeat_timeout_s=DEFAULTS.heartbeat_timeout_s,
                              mgmtd_lease_s=DEFAULTS.mgmtd_lease_s)
    with Client.connect(str(cluster.client_config_path)) as fs:
        # 1. the primary stalls for longer than its lease (SIGSTOP), then wakes up as a deposed primary
        lease = DEFAULTS.mgmtd_lease_s + DEFAULTS.mgmtd_lease_renew_s

        def stall(name: str) -> None:
            cluster.kill(name, signal.SIGSTOP)
            timer = threading.Timer(lease + 2.0, cluster.kill, args=(name, signal.SIGCONT))
            timer.start()
            timers.append(timer)

        timers: list[threading.Timer] = []
        old_addr = status(fs).primary.addr
        try:
            failover(cluster, fs, stall)
        finally:
            for timer in timers:
                timer.join(timeout=DEADLINE_S)
        checks.wait_for(lambda: (p := probe(fs, old_addr)) is not None and not p.is_primary,
                        "the woken mgmtd to serve as a standby", DEADLINE_S)
        # 2. the new primary dies (kill -9)
        failover(cluster, fs, lambda name: cluster.kill(name))
        assert fs.run(fs.aio.mgmtd.call("get_primary", Empty(), ms.PrimaryRsp)).is_primary
    print(f"\nMEASURED unclean failovers (SIGSTOP {lease + 2.0:.1f} s, then kill -9): 0 fences, 0 failed writes "
          f"at {time.strftime('%H:%M:%S')}")
