"""`threefs status [--json] [--watch [SECONDS]]`: the cluster as mgmtd sees it, and in plain words what
is wrong and what is recovering.

The primary mgmtd's `status` call gives routing (nodes, targets with public and local state, chains),
heartbeat ages and the resyncs storage services report; each configured mgmtd is also asked who it is, so
a dead or partitioned standby shows too. `problems()` and `recovering()` are pure functions of that.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import msgspec

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas.common import Empty

WATCH_INTERVAL_S_MIN = 0.2
MGMTD_PROBE_TIMEOUT_S = 1.0


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(st: ms.MgmtdStatusRsp, node_id: int) -> str:
    age = st.heartbeat_age_s.get(node_id)
    return "never (since this primary started)" if age is None else f"{age:.1f} s ago"


def _percent(p: ms.SyncProgress) -> str:
    if p.chunks_total == 0:
        return "comparing chunk lists"
    return f"{p.chunks_done} of {p.chunks_total} chunks ({100 * p.chunks_done // p.chunks_total}%)"


def problems(st: ms.MgmtdStatusRsp, unreachable: list[str] = (), mgmtds: list[ms.PrimaryRsp] = ()) -> list[str]:
    """What is wrong, each as one sentence an operator can act on."""
    r = st.routing
    out = [f"mgmtd at {addr} does not answer ({why})" for addr, why in unreachable]
    if st.kv_error:
        out.append(f"mgmtd {st.primary.node_id} cannot write its KV: {st.kv_error}; it loses the primary "
                   "lease when that lasts past the lease time. Check the KV's disk (full? read-only?) or "
                   "the etcd cluster")
    for m in mgmtds:
        if m.kv_error and m.node_id != st.primary.node_id:
            out.append(f"mgmtd {m.node_id} at {m.addr} cannot write its KV: {m.kv_error}")
    for node_id, problems in sorted(st.node_problems.items()):
        node = r.nodes.get(node_id)
        who = f"{node.type} node {node_id} at {node.addr}" if node else f"node {node_id}"
        out.extend(f"{who}: {p}" for p in problems)
    for node_id, n in sorted(st.failures.items()):
        node = r.nodes.get(node_id)
        if n >= ms.FLAPPING_FAILURES and node is not None:
            out.append(f"{node.type} node {node_id} at {node.addr} keeps flapping: marked failed {n} times in "
                       f"the last {st.flap_window_s / 60:.0f} min; look at its host (CPU, memory, network) and "
                       f"its log")
    for node in sorted(r.nodes.values(), key=lambda n: n.node_id):
        if not node.alive:
            n_targets = sum(t.node_id == node.node_id for t in r.targets.values())
            what = f": its {n_targets} targets are OFFLINE" if n_targets else ""
            out.append(f"{node.type} node {node.node_id} at {node.addr} stopped sending heartbeats "
                       f"(last {_age(st, node.node_id)}, timeout {st.heartbeat_timeout_s:.0f} s){what}; "
                       f"restart it (`threefs up` restarts missing local services)")
    for t in sorted(r.targets.values(), key=lambda t: t.target_id):
        if t.admin_offline:
            leaving = (f"; it still SERVES and takes writes until node {t.node_id} has seen that (its next "
                       "heartbeats), then it leaves its chain") if t.public_state == ms.SERVING else ""
            out.append(f"target {t.target_id} was taken offline by an admin "
                       f"(`threefs admin online-target {t.target_id}` returns it){leaving}")
    for chain in sorted(r.chains.values(), key=lambda c: c.chain_id):
        out.extend(_chain_problems(chain))
    return out


def _chain_problems(chain: ms.ChainInfo) -> list[str]:
    states = [t.public_state for t in chain.targets]
    desc = ", ".join(f"{t.target_id} {t.public_state}" for t in chain.targets)
    if ms.SERVING in states:
        if states.count(ms.SERVING) == len(states):
            return []
        return [f"chain {chain.chain_id} is degraded: {states.count(ms.SERVING)} of {len(states)} "
                f"targets SERVING ({desc})"]
    if ms.LASTSRV in states:
        last = chain.targets[states.index(ms.LASTSRV)].target_id
        return [f"chain {chain.chain_id} has no SERVING target: IO to it waits for target {last} "
                f"(LASTSRV: the last to serve, it holds the newest data) to come back; if it never will, "
                f"`threefs admin rotate-lastsrv {chain.chain_id}` serves from the next target and loses "
                f"writes only {last} had"]
    return [f"chain {chain.chain_id} has no SERVING target: IO to it fails ({desc})"]


def recovering(st: ms.MgmtdStatusRsp) -> list[str]:
    """What is getting better by itself."""
    r = st.routing
    out = []
    if r.bootstrapping:
        out.append(f"mgmtd {st.primary.node_id} became primary recently: it waits one heartbeat timeout "
                   f"({st.heartbeat_timeout_s:.0f} s) before judging nodes dead")
    progress = {p.target_id: p for p in st.syncs}
    for chain in sorted(r.chains.values(), key=lambda c: c.chain_id):
        for t in chain.targets:
            if t.public_state == ms.SYNCING:
                p = progress.get(t.target_id)
                how = (f"from target {p.source_id}: {_percent(p)}" if p is not None
                       else "(its resync is starting)")
                out.append(f"target {t.target_id} (chain {chain.chain_id}) is resyncing {how}")
            elif t.public_state == ms.WAITING:
                local = r.targets[t.target_id].local_state if t.target_id in r.targets else "?"
                out.append(f"target {t.target_id} (chain {chain.chain_id}) is WAITING ({local}): it resyncs "
                           "once its chain has a SERVING target and no other resync")
    return out


async def _no_primary(rpc, addrs: list[str], error: ThreeFSError) -> str:
    """What each configured mgmtd says when none answers as primary (a KV it cannot write, ...)."""
    addrs = sorted(set(addrs))
    probes = await asyncio.gather(*(_probe(rpc, a) for a in addrs))
    said = [f"mgmtd {p.node_id} at {p.addr}: "
            + (f"cannot write its KV: {p.kv_error}" if p.kv_error else
               "primary" if p.is_primary else f"standby (primary {p.primary_id or 'none'})")
            if isinstance(p, ms.PrimaryRsp) else f"{a} does not answer ({p})" for a, p in zip(addrs, probes)]
    if not any(isinstance(p, ms.PrimaryRsp) for p in probes):
        return f"no mgmtd answers ({error.message})"
    return "no primary mgmtd: " + "; ".join(said)


def no_primary_report(config, error: ThreeFSError) -> str:
    """`_no_primary` for a client that could not even start (it needs a primary to fetch routing)."""
    from threefs.rpc.client import RpcClient

    async def run() -> str:
        rpc = RpcClient(config.token, client_id="threefs-status")
        try:
            return await _no_primary(rpc, config.mgmtd, error)
        finally:
            await rpc.close()

    return asyncio.run(run())


async def _probe(rpc, addr: str) -> ms.PrimaryRsp | str:
    try:
        rsp, _ = await rpc.call(addr, "mgmtd.get_primary", Empty(), ms.PrimaryRsp,
                                timeout=MGMTD_PROBE_TIMEOUT_S)
        return rsp
    except ThreeFSError as e:
        return f"{e.code.name}: {e.message}"


async def gather(aio) -> tuple[ms.MgmtdStatusRsp, list[ms.PrimaryRsp], list[tuple[str, str]]]:
    """(primary's status, each answering mgmtd's identity, [(address, why)] of those that did not).
    With no primary, raises UNAVAILABLE saying what each mgmtd answered (a KV it cannot write, ...)."""
    try:
        st = await aio.mgmtd.call("status", Empty(), ms.MgmtdStatusRsp)
    except ThreeFSError as e:
        raise status_error(StatusCode.UNAVAILABLE, await _no_primary(aio.rpc, aio.config.mgmtd, e)) from None
    addrs = sorted(set(aio.config.mgmtd) | {m.addr for m in st.members})
    probes = await asyncio.gather(*(_probe(aio.rpc, a) for a in addrs))
    ok = [p for p in probes if isinstance(p, ms.PrimaryRsp)]
    bad = [(a, p) for a, p in zip(addrs, probes) if isinstance(p, str)]
    return st, ok, bad


def as_dict(st, mgmtds, unreachable) -> dict:
    return {"routing": msgspec.to_builtins(st.routing), "primary": msgspec.to_builtins(st.primary),
            "mgmtd": msgspec.to_builtins(mgmtds), "unreachable_mgmtd": [a for a, _ in unreachable],
            "heartbeat_age_s": st.heartbeat_age_s, "syncs": msgspec.to_builtins(st.syncs),
            "problems": problems(st, unreachable, mgmtds), "recovering": recovering(st)}


def render_text(st: ms.MgmtdStatusRsp, mgmtds: list[ms.PrimaryRsp], unreachable) -> str:
    r = st.routing
    lines = [f"routing v{r.version}; primary mgmtd {st.primary.node_id} at {st.primary.addr}"
             + (" (bootstrapping)" if r.bootstrapping else "")]
    lines.append("MGMTD")
    for m in sorted(mgmtds, key=lambda m: m.node_id):
        role = "PRIMARY" if m.is_primary else "standby"
        lines.append(f"  {m.node_id:>5} {m.addr:<22} {role}")
    for addr, why in unreachable:
        lines.append(f"  {'?':>5} {addr:<22} DOWN ({why})")
    lines.append("NODES")
    for n in sorted(r.nodes.values(), key=lambda n: n.node_id):
        lines.append(f"  {n.node_id:>5} {n.type:<8} {n.addr:<22} {'alive' if n.alive else 'FAILED':<7} "
                     f"heartbeat {_age(st, n.node_id)}")
    lines.append("TARGETS")
    lines.append(f"  {'target':>8} {'node':>5} {'chain':>6}  {'public':<8} {'local':<9} used")
    for t in sorted(r.targets.values(), key=lambda t: t.target_id):
        flag = "  (admin offline)" if t.admin_offline else ""
        lines.append(f"  {t.target_id:>8} {t.node_id:>5} {t.chain_id or '-':>6}  {t.public_state:<8} "
                     f"{t.local_state:<9} {_fmt_bytes(t.used_bytes)}{flag}")
    lines.append("CHAINS (head first)")
    for c in sorted(r.chains.values(), key=lambda c: c.chain_id):
        members = "  ".join(f"{t.target_id}:{t.public_state}" for t in c.targets)
        lines.append(f"  chain {c.chain_id:>4} v{c.version:<5} {members}")
    for t in sorted(r.tables.values(), key=lambda t: t.table_id):
        lines.append(f"TABLE {t.table_id} v{t.version}: {len(t.chains)} chains x {t.replicas} replicas")
    for title, items in (("RECOVERING", recovering(st)), ("PROBLEMS", problems(st, unreachable, mgmtds))):
        if items:
            lines.append(title)
            lines.extend(f"  - {item}" for item in items)
    if not problems(st, unreachable, mgmtds) and not recovering(st):
        lines.append("OK: every node alive, every chain fully SERVING")
    return "\n".join(lines)


def render_status(fs, as_json: bool = False) -> int:
    """Print the status once (exit 0); `fs` is a connected `threefs.Client`."""
    st, mgmtds, unreachable = fs.run(gather(fs.aio))
    kvcaches = _kvcache_stats(fs)
    if as_json:
        out = as_dict(st, mgmtds, unreachable)
        if kvcaches is not None:
            out["kvcache"] = kvcaches
        print(json.dumps(out, indent=2))
    else:
        print(render_text(st, mgmtds, unreachable))
        if isinstance(kvcaches, str):
            print(f"kvcache: {kvcaches}")
        elif kvcaches:
            from threefs.cli.kvcache_cmd import stats_lines

            print("kvcache:\n" + "\n".join("  " + line for line in stats_lines(kvcaches)))
    return 0


def _kvcache_stats(fs) -> list | str | None:
    """The kvcache service's per-cache figures; None: the cluster runs none; a str: why it does not answer."""
    from threefs.cli.kvcache_cmd import all_stats
    from threefs.common.status import StatusCode

    try:
        return all_stats(fs, timeout_s=2.0)
    except ThreeFSError as e:
        return None if e.code == StatusCode.NOT_FOUND else f"PROBLEM: the kvcache service does not answer: {e}"


def watch_status(fs, interval_s: float, as_json: bool = False, rounds_max: int = 0) -> int:
    """Redraw every `interval_s` until Ctrl-C (or `rounds_max` rounds, for scripts and tests)."""
    interval_s = max(interval_s, WATCH_INTERVAL_S_MIN)
    rounds = 0
    while True:
        if not as_json and sys.stdout.isatty():
            print("\x1b[H\x1b[2J", end="")  # clear the screen
        try:
            render_status(fs, as_json)
        except ThreeFSError as e:  # mgmtd failing over: say so and keep watching
            print(f"status unavailable: {e}")
        print(time.strftime("-- %H:%M:%S --"), flush=True)
        rounds += 1
        if rounds_max and rounds >= rounds_max:
            return 0
        time.sleep(interval_s)
