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


def test_rpc_latency_histogram_buckets_and_the_method_bound():
    """The RPC counters are plain numbers exported at scrape time (common/metrics.py): the histogram's
    buckets are Prometheus's (le: at most the bound, cumulative, +Inf = count), the counters carry their
    _created series, and past METHODS_MAX methods new names count as "other"."""
    from prometheus_client import generate_latest

    from threefs.common.metrics import LATENCY_BUCKETS_S, METHODS_MAX

    m = ServiceMetrics("meta-1", 1)
    for seconds in (0.0001, 0.00010001, 0.0005, 0.003, 10.0, 11.0):  # on a bound, just above, past the last
        m.observe_rpc("meta.stat", seconds, None)
    m.observe_rpc("meta.stat", 0.002, StatusCode.NOT_FOUND)
    text = generate_latest(m.registry).decode()
    expect = {0.0001: 1, 0.0005: 3, 0.001: 3, 0.0025: 4, 0.005: 5, 10.0: 6}
    for bound, count in expect.items():
        assert f'threefs_rpc_latency_seconds_bucket{{le="{bound!r}",method="meta.stat"}} {float(count)!r}' in text
    assert 'threefs_rpc_latency_seconds_bucket{le="+Inf",method="meta.stat"} 7.0' in text
    assert 'threefs_rpc_latency_seconds_count{method="meta.stat"} 7.0' in text
    total = 0.0001 + 0.00010001 + 0.0005 + 0.003 + 10.0 + 11.0 + 0.002
    line = next(ln for ln in text.splitlines() if ln.startswith('threefs_rpc_latency_seconds_sum{method="meta.stat"}'))
    assert abs(float(line.split()[-1]) - total) < 1e-9
    assert 'threefs_rpc_requests_total{method="meta.stat",status="OK"} 6.0' in text
    assert 'threefs_rpc_requests_total{method="meta.stat",status="NOT_FOUND"} 1.0' in text
    assert 'threefs_rpc_requests_created{method="meta.stat",status="OK"}' in text
    assert 'threefs_rpc_latency_seconds_created{method="meta.stat"}' in text
    assert len(LATENCY_BUCKETS_S) + 1 == text.count('threefs_rpc_latency_seconds_bucket{le=')
    for i in range(METHODS_MAX + 5):
        m.observe_rpc(f"svc.m{i}", 0.001, None)
    text = generate_latest(m.registry).decode()
    methods = {ln.split('method="')[1].split('"')[0] for ln in text.splitlines()
               if ln.startswith("threefs_rpc_requests_total{")}
    assert len(methods) == METHODS_MAX + 1 and "other" in methods  # meta.stat, 255 more, then "other"
    assert 'threefs_rpc_requests_total{method="other",status="OK"} 6.0' in text


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
