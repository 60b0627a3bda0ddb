"""mgmtd in one process: lease election, redirects, the lease guard, heartbeats and failure detection.

Two MgmtdService objects share one in-memory KV and one fake clock (time is passed in, DESIGN principle 1),
so every step is deterministic. The redirect test serves them over real TCP.
"""

from __future__ import annotations

import asyncio

import pytest

from threefs.cluster.mgmtd_client import MgmtdClient
from threefs.common.config import ServiceConfig
from threefs.common.status import StatusCode, ThreeFSError
from threefs.kv.memory import MemoryEngine
from threefs.mgmtd.admin import MgmtdAdmin
from threefs.mgmtd.service import PRIMARY, STANDBY, MgmtdService
from threefs.mgmtd.store import MgmtdStore
from threefs.rpc.auth import CLUSTER, TokenAuthenticator
from threefs.rpc.client import RpcClient
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas.common import Empty
from threefs.rpc.server import CallContext, RpcServer
from threefs.storage import craq

TOKEN = "t" * 64


class Clock:
    def __init__(self):
        self.t = 1000.0

    def mono(self) -> float:
        return self.t

    def wall_ns(self) -> int:
        return int(self.t * 1e9)


def make(kv, clock: Clock, node_id: int, port: int = 0) -> MgmtdService:
    config = ServiceConfig(type="mgmtd", name=f"mgmtd-{node_id}", node_id=node_id, port=port or 9000 + node_id,
                           heartbeat_timeout_s=3.0, mgmtd_lease_s=1.5, mgmtd_lease_renew_s=0.5)
    return MgmtdService(config, MgmtdStore(kv), auth=TokenAuthenticator(TOKEN), clock=clock.mono,
                        wall_ns=clock.wall_ns)


def ctx() -> CallContext:
    return CallContext("m", "peer", CLUSTER, "test", None, 1e18)


def run(coro):
    return asyncio.run(coro)


async def pair():
    clock, kv = Clock(), MemoryEngine()
    a, b = make(kv, clock, 1), make(kv, clock, 2)
    await a.start()
    await b.start()
    return clock, a, b


def test_first_mgmtd_wins_the_lease_and_the_other_redirects():
    async def main():
        clock, a, b = await pair()
        assert (a.role, b.role) == (PRIMARY, STANDBY)
        with pytest.raises(ThreeFSError) as e:
            await b.get_routing(ctx(), ms.GetRoutingReq())
        assert e.value.code == StatusCode.NOT_PRIMARY
        assert ms.primary_from_message(e.value.message) == a.config.addr
        rsp = await b.get_primary(ctx(), Empty())
        assert not rsp.is_primary and rsp.primary_id == 1 and rsp.primary_addr == a.config.addr
        clock.t += 1.0  # renewals keep the lease
        await a.lease_pass()
        await b.lease_pass()
        clock.t += 1.0
        await b.lease_pass()
        assert (a.role, b.role) == (PRIMARY, STANDBY)

    run(main())


def test_standby_takes_over_an_expired_lease_and_the_old_primary_cannot_write():
    async def main():
        clock, a, b = await pair()
        await a.register(ctx(), ms.RegisterReq(101, ms.STORAGE, "s:1", targets=[10101]))
        version = a.routing.version
        clock.t += 1.6  # a stops renewing (stalled or dead): its lease ends
        await b.lease_pass()
        assert b.role == PRIMARY
        assert b.routing.version > version and 101 in b.routing.nodes  # reloaded from the KV
        assert b.bootstrapping
        # a still believes it is primary until its own lease pass, but the lease guard stops its writes
        a.lease.lease_end_ns = clock.wall_ns() + 10**9  # even with a (wrongly) extended local view
        with pytest.raises(ThreeFSError) as e:
            await a.register(ctx(), ms.RegisterReq(102, ms.STORAGE, "s:2"))
        assert e.value.code == StatusCode.NOT_PRIMARY
        await a.lease_pass()
        assert a.role == STANDBY
        assert 102 not in (await MgmtdStore(b.store.kv).load()).nodes

    run(main())


def test_clean_release_hands_over_at_the_next_pass():
    async def main():
        clock, a, b = await pair()
        await a.release()
        await b.lease_pass()
        assert b.role == PRIMARY and a.role == STANDBY

    run(main())


def test_heartbeats_failure_detection_and_chain_states():
    async def main():
        clock, a, _ = await pair()
        admin = MgmtdAdmin(a)
        for n in (101, 102):
            await a.register(ctx(), ms.RegisterReq(n, ms.STORAGE, f"s:{n}", failure_domain=str(n),
                                                   targets=[n * 100 + 1]))
        await admin.create_chain_table(ctx(), ms.CreateChainTableReq(1, 2))
        hb = {101: 0, 102: 0}

        async def beat(node: int, local: str = ms.UPTODATE, **kw):
            hb[node] += 1
            targets = [ms.LocalTarget(node * 100 + 1, local)]
            await a.heartbeat(ctx(), ms.HeartbeatReq(node, hb[node], targets, **kw))

        for _ in range(4):  # through bootstrapping: heartbeats every 1 s
            clock.t += 1.0
            await beat(101)
            await beat(102)
            await a.lease_pass()
            await a.check_heartbeats()
            await a.update_chains()
        chain = a.routing.chains[1]
        assert [t.public_state for t in chain.targets] == [ms.SERVING, ms.SERVING]
        # a stale (reordered) heartbeat is ignored; a bad local state is refused
        await a.heartbeat(ctx(), ms.HeartbeatReq(101, 1, [ms.LocalTarget(10101, ms.LOCAL_OFFLINE)]))
        assert a.local_states[10101] == ms.UPTODATE
        with pytest.raises(ThreeFSError, match="unknown local state"):
            await beat(101, "SLEEPY")
        # 102 goes silent past the timeout: failed, its target OFFLINE, chain version bumped
        for _ in range(4):
            clock.t += 1.0
            await beat(101, syncs=[ms.SyncProgress(10201, 10101, 3, 10)])
            await a.lease_pass()
            await a.check_heartbeats()
            await a.update_chains()
        assert not a.routing.nodes[102].alive
        assert [(t.target_id, t.public_state) for t in a.routing.chains[1].targets] == [
            (10101, ms.SERVING), (10201, ms.OFFLINE)]
        assert a.routing.chains[1].version == chain.version + 1
        assert a.current_syncs() == [ms.SyncProgress(10201, 10101, 3, 10)]
        # it comes back ONLINE: SYNCING; sync_done: SERVING
        await beat(102, ms.ONLINE)
        await a.update_chains()
        assert a.routing.nodes[102].alive and a.routing.chains[1].targets[1].public_state == ms.SYNCING
        syncing = a.routing.chains[1]
        # a resync that started under an older chain version proves nothing about the writes since
        with pytest.raises(ThreeFSError) as stale:
            await a.sync_done(ctx(), ms.SyncDoneReq(10201, 1, syncing.version - 1))
        assert stale.value.code == StatusCode.CHAIN_VERSION_MISMATCH and "starts over" in str(stale.value)
        await a.update_chains()
        assert a.routing.chains[1].targets[1].public_state == ms.SYNCING
        await a.sync_done(ctx(), ms.SyncDoneReq(10201, 1, syncing.version))
        await beat(102, ms.ONLINE)  # a heartbeat racing sync_done does not undo it
        await a.update_chains()
        assert a.routing.chains[1].targets[1].public_state == ms.SERVING

    run(main())


def test_an_admin_offlined_serving_target_leaves_its_chain_once_its_node_has_seen_it():
    """The simulator's seed 98733: dropping a SERVING target at once let the chain acknowledge writes
    without it while it still served reads on its old routing. It now stays SERVING (and takes writes)
    until a heartbeat of its node carries the routing version that set admin_offline, or the node fails."""
    async def main():
        clock, a, _ = await pair()
        admin = MgmtdAdmin(a)
        nodes = (101, 102, 103)
        for n in nodes:
            await a.register(ctx(), ms.RegisterReq(n, ms.STORAGE, f"s:{n}", failure_domain=str(n),
                                                   targets=[n * 100 + 1]))
        await admin.create_chain_table(ctx(), ms.CreateChainTableReq(1, 3))
        hb = dict.fromkeys(nodes, 0)
        seen = dict.fromkeys(nodes, a.routing.version)  # each node's routing version

        async def beat(node: int):
            hb[node] += 1
            tid = node * 100 + 1  # reported as a storage service does (from the chain: it is current here)
            local = craq.local_state(next((t.public_state for t in a.routing.chains[1].targets
                                           if t.target_id == tid), None) if a.routing.chains else ms.SERVING)
            await a.heartbeat(ctx(), ms.HeartbeatReq(node, hb[node], [ms.LocalTarget(tid, local)],
                                                     routing_version=seen[node]))

        async def tick(silent=()):
            clock.t += 1.0
            for n in nodes:
                if n not in silent:
                    await beat(n)
            await a.lease_pass()
            await a.check_heartbeats()
            await a.update_chains()

        for _ in range(4):  # through bootstrapping
            await tick()
        states = lambda: {t.target_id: t.public_state for t in a.routing.chains[1].targets}  # noqa: E731
        assert set(states().values()) == {ms.SERVING}
        await admin.offline_target(ctx(), ms.TargetAdminReq(10101, True))
        offline_ver = a.routing.targets[10101].admin_offline_ver
        assert a.routing.targets[10101].admin_offline and offline_ver == a.routing.version
        for _ in range(3):  # its node heartbeats with the routing it had before: it keeps serving
            await tick()
        assert states()[10101] == ms.SERVING
        # a second target may go (the third still serves); the third, the last not leaving, may not
        await admin.offline_target(ctx(), ms.TargetAdminReq(10201, True))
        with pytest.raises(ThreeFSError, match="only SERVING target"):
            await admin.offline_target(ctx(), ms.TargetAdminReq(10301, True))
        # node 101 fetches the routing and heartbeats with it: its target leaves the chain
        seen[101] = a.routing.version
        await tick()
        assert states() == {10101: ms.OFFLINE, 10201: ms.SERVING, 10301: ms.SERVING}
        # node 102 never sees it, but goes silent past the timeout: failed, so its target leaves too
        for _ in range(4):
            await tick(silent=(102,))
        assert not a.routing.nodes[102].alive
        assert states() == {10101: ms.OFFLINE, 10201: ms.OFFLINE, 10301: ms.SERVING}
        # back online: it resyncs (SYNCING) as before
        await admin.offline_target(ctx(), ms.TargetAdminReq(10101, False))
        seen[101] = a.routing.version
        await tick(silent=(102,))
        assert states()[10101] == ms.SYNCING

    run(main())


def test_services_and_admin_calls_need_the_cluster_token():
    async def main():
        _, a, _ = await pair()
        user = CallContext("m", "peer", "user:alice#0123", "test", None, 1e18)
        for call in (a.register(user, ms.RegisterReq(5, ms.STORAGE, "x:1")),
                     a.heartbeat(user, ms.HeartbeatReq(5, 1)),
                     MgmtdAdmin(a).create_chain_table(user, ms.CreateChainTableReq(1, 1)),
                     MgmtdAdmin(a).user_add(user, ms.UserReq("bob", 1))):
            with pytest.raises(ThreeFSError) as e:
                await call
            assert e.value.code == StatusCode.PERMISSION_DENIED
        assert (await a.get_routing(user, ms.GetRoutingReq())).routing is not None

    run(main())


def test_client_follows_the_redirect_over_tcp():
    async def main():
        clock, kv = Clock(), MemoryEngine()
        servers, services = [], []
        for node_id in (1, 2):
            server = RpcServer(f"mgmtd-{node_id}", TokenAuthenticator(TOKEN))
            port = await server.start("127.0.0.1", 0)
            svc = make(kv, clock, node_id, port)
            svc.config.listen_host = "127.0.0.1"
            server.add_service("mgmtd", svc)
            servers.append(server)
            services.append(svc)
        await services[1].start()  # mgmtd-2 is primary
        await services[0].start()
        rpc = RpcClient(TOKEN)
        stubborn = MgmtdClient(rpc, [services[0].config.addr], follow_redirects=False)
        with pytest.raises(ThreeFSError) as e:  # behind a proxy: never calls an address it was not given
            await stubborn.refresh()
        assert e.value.code == StatusCode.UNAVAILABLE and "primary is at" in e.value.message
        client = MgmtdClient(rpc, [services[0].config.addr])  # knows only the standby
        routing = await client.refresh()
        assert routing.info.primary_addr == services[1].config.addr
        assert client.addrs[0] == services[1].config.addr  # remembered
        await services[1].release()
        await servers[1].stop()
        clock.t += 2
        await services[0].lease_pass()  # the standby takes over; the client finds it again
        assert (await client.refresh(force=True)).info.primary_addr == services[0].config.addr
        await rpc.close()
        for server in servers:
            await server.stop()

    run(main())
