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
import collections
import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

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


class ServiceMetrics:
    def __init__(self, service: str, node_id: int = 0):
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("threefs_rpc_requests", "RPC requests served, by method and status",
                                ["method", "status"], registry=self.registry)
        self.latency = Histogram("threefs_rpc_latency_seconds", "RPC handling time, by method", ["method"],
                                 buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.payload = Counter("threefs_rpc_payload_bytes", "bulk payload bytes, by method and direction",
                               ["method", "direction"], registry=self.registry)
        self._methods: set[str] = set()
        self._children: dict[tuple, object] = {}  # bounded: METHODS_MAX methods x statuses x directions
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
        """`RpcServer.metrics_hook`."""
        if code == StatusCode.UNKNOWN_METHOD or (method not in self._methods
                                                 and len(self._methods) >= METHODS_MAX):
            method = "other"
        self._methods.add(method)
        self._child(self.requests, method, code.name if code is not None else "OK").inc()
        self._child(self.latency, method).observe(seconds)
        if bytes_in:
            self._child(self.payload, method, "in").inc(bytes_in)
        if bytes_out:
            self._child(self.payload, method, "out").inc(bytes_out)

    def _child(self, metric, *labels):
        """metric.labels(*labels), cached: .labels() validates and locks on every call (hot path)."""
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

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
