"""A meta server that has restarted but not yet registered with mgmtd (it listens first) must not serve
calls: it has no routing, so a create it served failed for good with CHAIN_TABLE_NOT_FOUND (5 failed
operations in a 30-minute soak, right after a meta restart). It answers UNAVAILABLE until registered, and
clients take the call to another meta server."""

from __future__ import annotations

import socket

from threefs.client.client import Client
from threefs.testing.checks import wait_for


def _listens(addr: str) -> bool:
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def test_calls_to_an_unregistered_meta_server_go_to_another(private_cluster):
    cluster = private_cluster(storage=1, replicas=1)
    names = sorted(cluster.running())
    mgmtds = [n for n in names if n.startswith("mgmtd")]
    assert "meta-1" in names and "meta-2" in names
    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.write_bytes("/before", b"b")
        # meta-2 restarts while no mgmtd runs: it listens, and cannot register until one is back
        for name in mgmtds:
            cluster.kill(name)
        cluster.kill("meta-2")
        meta2 = cluster.config_of("meta-2")
        cluster.start_service(meta2)
        wait_for(lambda: _listens(meta2.addr), "meta-2 listening", 60)
        # Creates need only meta (and the chain table it holds); storage is fenced while no mgmtd runs.
        for i in range(8):  # the client alternates between the two meta servers
            with fs.open(f"/during-{i}", "wb"):
                pass
            assert fs.stat(f"/during-{i}").length == 0
        for name in mgmtds:
            cluster.start_service(cluster.config_of(name))
        for i in range(8):
            fs.write_bytes(f"/during-{i}", bytes([i]) * 100)  # retried until storage serves again
            assert fs.read_bytes(f"/during-{i}") == bytes([i]) * 100
        assert fs.read_bytes("/before") == b"b"
