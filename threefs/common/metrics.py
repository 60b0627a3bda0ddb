"""Prometheus metrics of a service process (`ServiceConfig.metrics_port`; 0 = none).

Every service exports RPC request counts by method and status, latency histograms, payload bytes in and
out (fed by `RpcServer.metrics_hook`), plus gauges read from the service at scrape time: chain and target
states and the routing version (mgmtd), fencing, target usage and resync progress (storage). Gauges are
computed on scrape rather than kept up to date, so the data path pays nothing for them.

Metric names: threefs_rpc_requests_total{method,status}, threefs_rpc_latency_seconds{method},
threefs_rpc_payload_bytes_total{method,direction}, the gauges of `mgmtd_gauges` and `storage_gauges`,
and threefs_service_info{service,node_id} naming the process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from threefs.common.status import StatusCode

log = logging.getLogger(__name__)

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

    def add_gauges(self, source: GaugeSource) -> None:
        self.sources.append(source)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint (a daemon thread); returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = server.server_port
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port


# -- gauges per service -----------------------------------------------------------------------------
def mgmtd_gauges(svc) -> GaugeSource:
    """Primary or not, routing version, targets per public state, chains per health, nodes alive."""
    from threefs.rpc.schemas import mgmtd as ms

    def samples() -> list[Sample]:
        out = [Sample("threefs_mgmtd_primary", "1 if this mgmtd is the primary", {},
                      1.0 if svc.role == "primary" else 0.0)]
        routing = svc.routing
        if routing is None or svc.role != "primary":  # a standby's copy is stale
            return out
        out.append(Sample("threefs_routing_version", "routing info version", {}, routing.version))
        targets = list(routing.targets.values())
        for state in ms.PUBLIC_STATES:
            n = sum(t.public_state == state for t in targets if t.chain_id)
            out.append(Sample("threefs_targets", "chain targets by public state", {"state": state}, n))
        chains = list(routing.chains.values())
        health = {"serving": 0, "degraded": 0, "down": 0}
        for c in chains:
            states = [t.public_state for t in c.targets]
            key = "down" if ms.SERVING not in states else "serving" if set(states) == {ms.SERVING} else "degraded"
            health[key] += 1
        out += [Sample("threefs_chains", "chains by health", {"health": k}, v) for k, v in health.items()]
        for node in list(routing.nodes.values()):
            out.append(Sample("threefs_node_alive", "1 while the node heartbeats",
                              {"node_id": str(node.node_id), "type": node.type}, 1.0 if node.alive else 0.0))
        for p in svc.current_syncs():
            out.append(Sample("threefs_resync_chunks_done", "chunks resynced so far",
                              {"target": str(p.target_id)}, p.chunks_done))
            out.append(Sample("threefs_resync_chunks_total", "chunks to resync",
                              {"target": str(p.target_id)}, p.chunks_total))
        return out

    return samples


def storage_gauges(svc) -> GaugeSource:
    """Fencing, per-target used bytes and local state, resync progress of the syncs this node runs."""
    from threefs.mgmtd.heartbeat import sync_reports

    def samples() -> list[Sample]:
        out = [Sample("threefs_storage_fenced", "1 while cut off from mgmtd (refusing IO)", {},
                      1.0 if svc.fence.fenced else 0.0),
               Sample("threefs_storage_fence_events", "times the fence closed", {}, svc.fence.fence_count)]
        routing = svc.mgmtd.routing
        for tid, engine in list(svc.engines.items()):
            labels = {"target": str(tid)}
            out.append(Sample("threefs_target_used_bytes", "bytes used by a target", labels,
                              engine.used_bytes()))
            state = svc.local_state(routing, tid)
            out.append(Sample("threefs_target_uptodate", "1 if the target reports UPTODATE", labels,
                              1.0 if state == "UPTODATE" else 0.0))
        for p in sync_reports(svc.resync, routing, svc.engines):
            labels = {"target": str(p.target_id), "source": str(p.source_id)}
            out.append(Sample("threefs_resync_chunks_done", "chunks resynced so far", labels, p.chunks_done))
            out.append(Sample("threefs_resync_chunks_total", "chunks to resync", labels, p.chunks_total))
        return out

    return samples
