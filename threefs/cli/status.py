"""`threefs status`: nodes, targets and chains, and in plain words what is wrong."""

from __future__ import annotations

import json

import msgspec

from threefs.rpc.schemas import mgmtd as ms


def problems(routing: ms.RoutingInfo) -> list[str]:
    out = []
    for node in routing.nodes.values():
        if not node.alive:
            out.append(f"{node.type} node {node.node_id} at {node.addr} stopped sending heartbeats")
    for chain in routing.chains.values():
        states = [t.public_state for t in chain.targets]
        if ms.SERVING not in states:
            out.append(f"chain {chain.chain_id} has no SERVING target: reads and writes to it wait")
        elif states.count(ms.SERVING) < len(states):
            bad = ", ".join(f"target {t.target_id} {t.public_state}" for t in chain.targets
                            if t.public_state != ms.SERVING)
            out.append(f"chain {chain.chain_id} is degraded ({bad})")
    return out


def render_status(fs, as_json: bool = False) -> int:
    routing = fs._run(fs.aio.mgmtd.refresh(force=True)).info
    issues = problems(routing)
    if as_json:
        print(json.dumps({"routing": msgspec.to_builtins(routing), "problems": issues}, indent=2))
        return 0
    print(f"routing version {routing.version}{' (mgmtd bootstrapping)' if routing.bootstrapping else ''}")
    print("NODES")
    for n in sorted(routing.nodes.values(), key=lambda n: n.node_id):
        print(f"  {n.node_id:>5} {n.type:<8} {n.addr:<22} {'alive' if n.alive else 'FAILED'}")
    print("CHAINS")
    for c in sorted(routing.chains.values(), key=lambda c: c.chain_id):
        members = "  ".join(f"{t.target_id}:{t.public_state}/{routing.targets[t.target_id].local_state}"
                            for t in c.targets)
        print(f"  chain {c.chain_id:>3} v{c.version:<4} {members}")
    for t in routing.tables.values():
        print(f"TABLE {t.table_id} v{t.version}: {len(t.chains)} chains x {t.replicas} replicas")
    print("PROBLEMS" if issues else "no problems: every chain is fully SERVING")
    for p in issues:
        print(f"  - {p}")
    return 0
