"""The storage fence (fake clock), Prometheus metrics (a real HTTP scrape), `threefs status` wording."""

from __future__ import annotations

import urllib.request

import pytest

from threefs.cli.status import problems, recovering, render_text
from threefs.common.metrics import Sample, ServiceMetrics
from threefs.common.status import StatusCode, ThreeFSError
from threefs.storage.fence import HeartbeatFence
from threefs.rpc.schemas import mgmtd as ms


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def test_fence_closes_after_half_the_timeout_and_opens_on_success():
    clock = Clock()
    fence = HeartbeatFence(7, heartbeat_timeout_s=4.0, heartbeat_interval_s=1.0, clock=clock)
    assert fence.fenced  # nothing accepted yet: a starting service does not serve
    fence.succeeded(clock.t)
    clock.t += 2.0
    fence.check()  # exactly T/2: still open
    clock.t += 0.01
    with pytest.raises(ThreeFSError) as e:
        fence.check()
    assert e.value.code == StatusCode.TARGET_OFFLINE and "stopped serving" in e.value.message
    assert fence.fence_count == 1
    fence.succeeded(clock.t - 5.0)  # an old heartbeat's late answer does not reopen it
    assert fence.fenced
    sent = clock.t
    clock.t += 0.3  # the answer arrives later; the fence counts from when it was sent
    fence.succeeded(sent)
    fence.check()
    assert fence.fenced_since is None and fence.call_timeout_s <= fence.limit_s


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


def test_metrics_endpoint_serves_rpc_counters_and_gauges():
    m = ServiceMetrics("storage-9", 109)
    m.observe_rpc("storage.update", 0.002, None, 4096, 0)
    m.observe_rpc("storage.update", 0.003, StatusCode.TARGET_OFFLINE)
    m.observe_rpc("storage.batch_read", 0.001, None, 0, 8192)
    m.observe_rpc("evil.method.x", 0.001, StatusCode.UNKNOWN_METHOD)
    m.add_gauges(lambda: [Sample("threefs_targets", "targets", {"state": "SERVING"}, 3)])
    m.add_gauges(lambda: 1 / 0)  # a broken source must not break the endpoint
    port = m.serve("127.0.0.1", 0)
    text = scrape(f"http://127.0.0.1:{port}/metrics")
    assert 'threefs_rpc_requests_total{method="storage.update",status="OK"} 1.0' in text
    assert 'threefs_rpc_requests_total{method="storage.update",status="TARGET_OFFLINE"} 1.0' in text
    assert 'threefs_rpc_payload_bytes_total{direction="in",method="storage.update"} 4096.0' in text
    assert 'threefs_rpc_payload_bytes_total{direction="out",method="storage.batch_read"} 8192.0' in text
    assert 'threefs_rpc_latency_seconds_count{method="storage.update"} 2.0' in text
    assert 'method="other",status="UNKNOWN_METHOD"' in text and "evil" not in text
    assert 'threefs_targets{state="SERVING"} 3.0' in text
    assert 'threefs_service_info{node_id="109",service="storage-9"} 1.0' in text


def status_of(chains: dict[int, list[tuple[int, str]]], dead: tuple[int, ...] = (), syncs=(),
              bootstrapping=False) -> ms.MgmtdStatusRsp:
    nodes = {n: ms.NodeInfo(n, ms.STORAGE, f"h:{n}", alive=n not in dead) for n in (1, 2, 3)}
    targets = {tid: ms.TargetInfo(tid, tid // 100, cid, state, ms.LOCAL_OFFLINE if tid // 100 in dead else
                                  ms.ONLINE) for cid, members in chains.items() for tid, state in members}
    routing = ms.RoutingInfo(9, nodes, targets,
                             {cid: ms.ChainInfo(cid, 4, [ms.ChainTarget(t, s) for t, s in members])
                              for cid, members in chains.items()}, {}, bootstrapping)
    primary = ms.PrimaryRsp(1, "m:1", True, 1, "m:1", 0)
    return ms.MgmtdStatusRsp(routing, primary, [], {1: 0.5, 2: 0.4, 3: 7.0}, list(syncs), 0, 3.0)


def test_status_says_what_is_wrong_and_what_recovers():
    st = status_of({1: [(101, ms.SERVING), (201, ms.SYNCING), (301, ms.OFFLINE)],
                    2: [(102, ms.LASTSRV), (202, ms.WAITING)],
                    3: [(103, ms.SERVING), (203, ms.SERVING)]},
                   dead=(3,), syncs=[ms.SyncProgress(201, 101, 5, 20)])
    wrong = problems(st, [("m:2", "UNAVAILABLE: refused")])
    assert wrong[0] == "mgmtd at m:2 does not answer (UNAVAILABLE: refused)"
    assert any("storage node 3 at h:3 stopped sending heartbeats (last 7.0 s ago" in p for p in wrong)
    assert any(p.startswith("chain 1 is degraded: 1 of 3 targets SERVING") for p in wrong)
    assert any("chain 2 has no SERVING target" in p and "rotate-lastsrv 2" in p for p in wrong)
    assert not any("chain 3" in p for p in wrong)
    better = recovering(st)
    assert "target 201 (chain 1) is resyncing from target 101: 5 of 20 chunks (25%)" in better
    assert any(b.startswith("target 202 (chain 2) is WAITING") for b in better)
    text = render_text(st, [st.primary], [])
    assert "PROBLEMS" in text and "RECOVERING" in text and "chain    2 v4" in text


def test_status_ok_when_all_serving():
    st = status_of({1: [(101, ms.SERVING), (201, ms.SERVING)]})
    assert problems(st) == [] and recovering(st) == []
    assert render_text(st, [st.primary], []).endswith("OK: every node alive, every chain fully SERVING")
    assert "became primary recently" in recovering(status_of({}, bootstrapping=True))[0]
