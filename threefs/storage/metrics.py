"""A storage service's Prometheus gauges, read at scrape time (common/metrics.py serves them)."""

from __future__ import annotations

from threefs.common.metrics import GaugeSource, Sample
from threefs.storage.fence import sync_reports


def storage_gauges(svc) -> GaugeSource:
    """Fencing, per-target used bytes and local state, resync progress of the syncs this node runs."""
    def samples() -> list[Sample]:
        out = [Sample("threefs_storage_fenced", "1 while cut off from mgmtd (refusing IO)", {},
                      1.0 if svc.fence.fenced else 0.0),
               Sample("threefs_storage_fence_events", "times the fence closed", {}, svc.fence.fence_count),
               Sample("threefs_storage_fenced_seconds", "time spent fenced (closed fences)", {},
                      svc.fence.fenced_s_total),
               Sample("threefs_storage_heartbeat_rtt_seconds_max", "longest heartbeat send to accepted reply",
                      {}, svc.fence.rtt_s_max),
               Sample("threefs_storage_heartbeat_gap_seconds_max", "longest time without an accepted heartbeat",
                      {}, svc.fence.gap_s_max)]
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
