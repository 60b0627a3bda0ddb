"""A primary mgmtd that stalled (its lease lapsed, nobody took it over) does not fail the nodes it could not
hear meanwhile (docs/architecture.md, "The margins, derived"): in one process, fake clock, shared KV."""

from __future__ import annotations

import asyncio

from threefs.common.config import ServiceConfig
from threefs.kv.memory import MemoryEngine
from threefs.mgmtd.admin import MgmtdAdmin
from threefs.mgmtd.service import PRIMARY, MgmtdService
from threefs.mgmtd.store import MgmtdStore
from threefs.rpc.auth import CLUSTER, TokenAuthenticator
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.server import CallContext

TOKEN = "t" * 64
T = 3.0


class Clock:
    def __init__(self):
        self.t = 1000.0

    def mono(self) -> float:
        return self.t

    def wall_ns(self) -> int:
        return int(self.t * 1e9)


def ctx() -> CallContext:
    return CallContext("m", "peer", CLUSTER, "test", None, 1e18)


async def primary_with_two_nodes():
    clock = Clock()
    config = ServiceConfig(type="mgmtd", name="mgmtd-1", node_id=1, port=9001, heartbeat_timeout_s=T,
                           mgmtd_lease_s=1.5, mgmtd_lease_renew_s=0.5)
    a = MgmtdService(config, MgmtdStore(MemoryEngine()), auth=TokenAuthenticator(TOKEN), clock=clock.mono,
                     wall_ns=clock.wall_ns)
    await a.start()
    for n in (101, 102):
        await a.register(ctx(), ms.RegisterReq(n, ms.STORAGE, f"s:{n}", failure_domain=str(n),
                                               targets=[n * 100 + 1]))
    await MgmtdAdmin(a).create_chain_table(ctx(), ms.CreateChainTableReq(1, 2))
    hb = {101: 0, 102: 0}

    async def beat(node: int):
        hb[node] += 1
        await a.heartbeat(ctx(), ms.HeartbeatReq(node, hb[node], [ms.LocalTarget(node * 100 + 1, ms.UPTODATE)]))

    for _ in range(5):  # through bootstrapping: heartbeats and renewals every 1 s
        clock.t += 1.0
        await beat(101)
        await beat(102)
        await a.lease_pass()
        await a.check_heartbeats()
        await a.update_chains()
    assert a.role == PRIMARY and not a.bootstrapping
    return clock, a, beat


def test_a_primary_whose_lease_lapsed_judges_nobody_on_the_time_it_could_not_hear():
    async def main():
        clock, a, beat = await primary_with_two_nodes()
        clock.t += 2 * T  # stalled: no renewal, no heartbeat handled (they wait in its sockets)
        await a.lease_pass()  # nobody else took the lease: ours again
        assert a.role == PRIMARY
        await a.check_heartbeats()  # runs before the queued heartbeats: must not fail anyone
        assert all(n.alive for n in a.routing.nodes.values() if n.type == ms.STORAGE)
        await beat(101)  # 101's queued heartbeat; 102 really is gone from now on
        for _ in range(int(T) + 2):
            clock.t += 1.0
            await beat(101)
            await a.lease_pass()
            await a.check_heartbeats()
        assert a.routing.nodes[101].alive and not a.routing.nodes[102].alive  # detection still works

    asyncio.run(main())


def test_a_standby_polls_right_when_the_lease_ends():
    async def main():
        clock, a, _ = await primary_with_two_nodes()
        config = ServiceConfig(type="mgmtd", name="mgmtd-2", node_id=2, port=9002, heartbeat_timeout_s=T,
                               mgmtd_lease_s=1.5, mgmtd_lease_renew_s=0.5)
        b = MgmtdService(config, a.store, auth=TokenAuthenticator(TOKEN), clock=clock.mono, wall_ns=clock.wall_ns)
        await b.start()
        assert b.role != PRIMARY and a._next_pass_s() == 0.5  # the primary renews every R
        clock.t += 1.3  # a stopped renewing; its lease ends 0.2 s from now
        assert abs(b._next_pass_s() - 0.22) < 1e-6
        clock.t += 0.22
        await b.lease_pass()
        assert b.role == PRIMARY
        assert b.bootstrapping  # and judges nobody for T from now

    asyncio.run(main())
