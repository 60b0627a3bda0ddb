"""Prometheus metrics of a service process (`ServiceConfig.metrics_port`; 0 = none).

Every service exports RPC request counts by method and status, latency histograms, payload bytes in and
out (fed by `RpcServer.metrics_hook`), plus gauges that each service registers (`add_gauges`) and that are read at scrape time:
mgmtd/metrics.py (chain and target states, routing version), storage/metrics.py (fencing, target usage,
resync progress). Gauges are computed on scrape rather than kept up to date, so the data path pays
nothing for them.

Metric names: threefs_rpc_requests_total{method,status}, threefs_rpc_latency_seconds{method},
threefs_rpc_payload_bytes_total{method,direction}, the services' gauges,
and threefs_service_info{service,node_id} naming the process.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from threefs.common.status import StatusCode

log = logging.getLogger(__name__)

LOOP_LAG_INTERVAL_S = 0.1
LOOP_LAG_WINDOW_S = 60.0
LATENCY_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
METHODS_MAX = 256  # distinct method labels; callers can name any method, so bound the label set


class Sample(NamedTuple):
    name: str
    help: str
    labels: dict[str, str]
    value: float


GaugeSource = Callable[[], Iterable[Sample]]


class _Gauges:
    """A prometheus collector that asks its sources for samples at scrape time."""

    def __init__(self, sources: list[GaugeSource]):
        self.sources = sources

    def collect(self):
        families: dict[str, GaugeMetricFamily] = {}
        for source in self.sources:
            try:
                samples = list(source())
            except Exception:  # a scrape racing a state change must not kill the endpoint
                log.exception("metrics gauge source failed")
                continue
            for smp in samples:
                family = families.get(smp.name)
                if family is None:
                    family = families[smp.name] = GaugeMetricFamily(smp.name, smp.help,
                                                                    labels=sorted(smp.labels))
                family.add_metric([smp.labels[k] for k in sorted(smp.labels)], smp.value)
        yield from families.values()


class _MethodStats:
    """One method's RPC counters, kept as plain numbers by the event loop's thread and read at scrape time
    (prometheus_client's Counter and Histogram take a lock per increment: 2.6 µs of a request's ~8 µs of
    dispatch, measured without sockets)."""

    __slots__ = ("statuses", "buckets", "sum", "bytes_in", "bytes_out", "created")

    def __init__(self) -> None:
        self.statuses: dict[str, list] = {}  # status name -> [count, created]
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)  # per bucket (not cumulative); the last is +Inf
        self.sum = 0.0
        self.bytes_in = self.bytes_out = 0
        self.created = time.time()


class _RpcCollector:
    """threefs_rpc_requests_total, threefs_rpc_latency_seconds and threefs_rpc_payload_bytes_total, with their
    _created series, as prometheus_client's Counter and Histogram would export them."""

    def __init__(self, methods: dict[str, _MethodStats]):
        self.methods = methods

    def collect(self):
        methods = list(self.methods.items())  # the loop's thread may add one meanwhile
        requests = CounterMetricFamily("threefs_rpc_requests", "RPC requests served, by method and status",
                                       labels=["method", "status"])
        latency = HistogramMetricFamily("threefs_rpc_latency_seconds", "RPC handling time, by method",
                                        labels=["method"])
        latency_created = GaugeMetricFamily("threefs_rpc_latency_seconds_created", "RPC handling time, by "
                                            "method", labels=["method"])
        payload = CounterMetricFamily("threefs_rpc_payload_bytes", "bulk payload bytes, by method and "
                                      "direction", labels=["method", "direction"])
        for method, st in methods:
            for status, (count, created) in list(st.statuses.items()):
                requests.add_metric([method, status], count, created=created)
            if st.statuses:
                cumulative, buckets = 0, []
                for bound, count in zip(LATENCY_BUCKETS_S, st.buckets):
                    cumulative += count
                    buckets.append((repr(float(bound)), cumulative))
                buckets.append(("+Inf", cumulative + st.buckets[-1]))
                latency.add_metric([method], buckets, st.sum)
                latency_created.add_metric([method], st.created)
            for direction, nbytes in (("in", st.bytes_in), ("out", st.bytes_out)):
                if nbytes:
                    payload.add_metric([method, direction], nbytes, created=st.created)
        yield from (requests, latency, latency_created, payload)


class ServiceMetrics:
    def __init__(self, service: str, node_id: int = 0):
        self.registry = CollectorRegistry(auto_describe=False)
        # RPC counters by method (bounded: METHODS_MAX methods, then "other"), exported by _RpcCollector
        self._rpc: dict[str, _MethodStats] = {}
        self.registry.register(_RpcCollector(self._rpc))
        self.sources: list[GaugeSource] = [
            lambda: [Sample("threefs_service_info", "this process", {"service": service,
                                                                    "node_id": str(node_id)}, 1)]]
        self.loop_lag_recent_s = self.loop_lag_max_s = 0.0
        self.sources.append(lambda: [
            Sample("threefs_event_loop_lag_seconds", "largest event-loop stall of the last minute", {},
                   self.loop_lag_recent_s),
            Sample("threefs_event_loop_lag_seconds_max", "largest event-loop stall since start", {},
                   self.loop_lag_max_s)])
        self.registry.register(_Gauges(self.sources))
        self.port = 0

    def observe_rpc(self, method: str, seconds: float, code: StatusCode | None, bytes_in: int = 0,
                    bytes_out: int = 0) -> None:
        """`RpcServer.metrics_hook`. Called from the event loop's thread only."""
        st = self._rpc.get(method)
        if st is None or code == StatusCode.UNKNOWN_METHOD:
            st = self._method(method, code)
        status = "OK" if code is None else code.name
        counter = st.statuses.get(status)
        if counter is None:
            st.statuses[status] = [1, time.time()]
        else:
            counter[0] += 1
        st.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1  # le: the first bound >= seconds
        st.sum += seconds
        if bytes_in:
            st.bytes_in += bytes_in
        if bytes_out:
            st.bytes_out += bytes_out

    def _method(self, method: str, code: StatusCode | None) -> _MethodStats:
        """The counters of a method seen for the first time; callers can name any method, so unknown ones
        and any past METHODS_MAX count as "other"."""
        if code == StatusCode.UNKNOWN_METHOD or (method not in self._rpc and len(self._rpc) >= METHODS_MAX):
            method = "other"
        st = self._rpc.get(method)
        if st is None:
            st = self._rpc[method] = _MethodStats()
        return st

    async def watch_event_loop(self, interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
        """Runs for the process's lifetime: how late the event loop wakes a sleeper is how long
        something blocked it (a disk write throttled by writeback, a lock, a long computation).
        Exported as the largest lag of the last LOOP_LAG_WINDOW_S and since start."""
        loop = asyncio.get_running_loop()
        window: collections.deque = collections.deque()
        while True:
            t0 = loop.time()
            await asyncio.sleep(interval_s)
            lag = loop.time() - t0 - interval_s
            now = loop.time()
            window.append((now, lag))
            while window and window[0][0] < now - LOOP_LAG_WINDOW_S:
                window.popleft()
            self.loop_lag_recent_s = max(v for _, v in window)
            self.loop_lag_max_s = max(self.loop_lag_max_s, lag)

    def add_gauges(self, source: GaugeSource) -> None:
        self.sources.append(source)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint (a daemon thread); returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = server.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port
