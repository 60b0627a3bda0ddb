"""mgmtd's Prometheus gauges, read at scrape time (common/metrics.py serves them)."""

from __future__ import annotations

from threefs.common.metrics import GaugeSource, Sample
from threefs.rpc.schemas import mgmtd as ms


def mgmtd_gauges(svc) -> GaugeSource:
    """Primary or not, routing version, targets per public state, chains per health, nodes alive."""
    def samples() -> list[Sample]:
        out = [Sample("threefs_mgmtd_primary", "1 if this mgmtd is the primary", {},
                      1.0 if svc.role == "primary" else 0.0),
               Sample("threefs_mgmtd_lease_pass_seconds_max", "longest lease pass (one KV commit) since start",
                      {}, svc.lease_pass_s_max),
               Sample("threefs_mgmtd_lease_renew_gap_seconds_max", "longest time between two renewals of the "
                      "lease this mgmtd kept", {}, svc.lease_renew_gap_s_max),
               Sample("threefs_mgmtd_heartbeat_gap_seconds_max", "longest time a node went without a heartbeat "
                      "received by this mgmtd as primary", {}, svc.heartbeat_gap_s_max)]
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
