"""The node heartbeat loop (threefs/cluster/heartbeat.py), with a real mgmtd over real TCP.

The bug it pins: a beat answered NODE_NOT_FOUND made the loop re-register, and a registration that
failed then (mgmtd failing over) ended the loop with the exception, so the node stayed unregistered and
(storage) fenced for good while its process looked alive.
"""

from __future__ import annotations

import asyncio

from threefs.cluster.mgmtd_client import MgmtdClient
from threefs.common.config import ServiceConfig, TargetConfig
from threefs.common.status import StatusCode, status_error
from threefs.kv.memory import MemoryEngine
from threefs.mgmtd.service import MgmtdService
from threefs.mgmtd.store import MgmtdStore
from threefs.rpc.auth import TokenAuthenticator
from threefs.rpc.client import RpcClient
from threefs.rpc.server import RpcServer
from threefs.storage.service import StorageService

TOKEN = "h" * 64


async def _mgmtd() -> tuple[RpcServer, MgmtdService]:
    server = RpcServer("mgmtd-1", TokenAuthenticator(TOKEN))
    port = await server.start("127.0.0.1", 0)
    config = ServiceConfig(type="mgmtd", name="mgmtd-1", node_id=1, listen_host="127.0.0.1", port=port,
                           heartbeat_timeout_s=3.0)
    svc = MgmtdService(config, MgmtdStore(MemoryEngine()), auth=server.authenticate)
    await svc.start()
    server.add_service("mgmtd", svc)
    return server, svc


def test_storage_heartbeat_loop_survives_a_failed_re_registration(tmp_path):
    async def main():
        server, mgmtd = await _mgmtd()
        rpc = RpcClient(TOKEN, client_id="storage-1")
        client = MgmtdClient(rpc, [mgmtd.config.addr])
        config = ServiceConfig(type="storage", name="storage-1", node_id=101, mgmtd=[mgmtd.config.addr],
                               targets=[TargetConfig(10101, str(tmp_path / "t1"))],
                               heartbeat_interval_s=0.1, heartbeat_timeout_s=3.0)
        svc = StorageService(config, rpc, client)
        svc.open_targets()
        # Fault injection: mgmtd has never seen this node (NODE_NOT_FOUND on the first beat), and the
        # first registration is lost as in a mgmtd failover (TIMEOUT). Later calls reach mgmtd as usual.
        real_call, failures = client.call, []

        async def call(method, req, rsp_type, **kw):
            if method == "register" and not failures:
                failures.append(method)
                raise status_error(StatusCode.TIMEOUT, "injected: mgmtd failing over")
            return await real_call(method, req, rsp_type, **kw)

        client.call = call
        loop = asyncio.ensure_future(svc.heartbeat_loop())
        try:
            for _ in range(100):  # bounded: 10 s
                await asyncio.sleep(0.1)
                assert not loop.done(), f"the heartbeat loop ended: {loop.exception()!r}"
                node = mgmtd.routing.nodes.get(101)
                if node is not None and node.alive and not svc.fence.fenced:
                    break
            assert failures == ["register"], "the injected fault must have been hit"
            assert 101 in mgmtd.routing.nodes and not svc.fence.fenced
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            svc.close()
            await rpc.close()
            await server.stop()

    asyncio.run(main())

