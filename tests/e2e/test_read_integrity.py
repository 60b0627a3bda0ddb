"""End-to-end read integrity: bytes damaged between a storage service's disk read and the caller's
buffer are caught by the client (ReadResult.data_crc) and read again from another replica.

The damage is real: storage-1 advertises 127.0.0.2, where a TCP proxy forwards to it and flips a byte
in the middle of a read's payload on its way back (threefs/testing/proxy.py)."""

from __future__ import annotations

import signal

import pytest

from threefs.client.client import Client
from threefs.testing.checks import all_serving, routing, wait_for
from threefs.testing.proxy import FaultProxy

CS = 1 << 20


@pytest.fixture
def proxied(private_cluster):
    cluster = private_cluster(storage=3, replicas=3)
    config = cluster.config_of("storage-1")
    cluster.kill("storage-1", signal.SIGTERM)
    wait_for(lambda: cluster.pid_of("storage-1") is None, "storage-1 to stop")
    proxy = FaultProxy(("127.0.0.2", config.port), ("127.0.0.1", config.port)).start()
    config.advertise_host = "127.0.0.2"
    cluster.start_service(config)
    fs = Client.connect(str(cluster.client_config_path))
    wait_for(lambda: routing(fs).nodes[config.node_id].addr == f"127.0.0.2:{config.port}" and all_serving(fs),
             "storage-1 to serve behind the proxy", timeout=60)
    yield fs, proxy
    fs.close()
    proxy.stop()


def test_damaged_bytes_are_caught_and_read_from_another_replica(proxied, rng):
    fs, proxy = proxied
    fs.mkdir("/i")
    data = rng.randbytes(2 * CS)
    fs.write_bytes("/i/f", data)
    whole, part = bytearray(CS), bytearray(64 * 1024)
    for _ in range(200):  # bounded: reads spread over the replicas, a third of them via the proxy
        if fs.aio.storage.damaged_reads >= 4:
            break
        proxy.corrupt_next(1)
        fs.batch_read([("/i/f", CS, whole)])  # a whole chunk: checked against its write-time crc
        assert whole == data[CS:], "a damaged whole-chunk read reached the caller"
        fs.batch_read([("/i/f", 4096, part)])  # a partial read: checked against the sent crc
        assert part == data[4096:4096 + len(part)], "a damaged partial read reached the caller"
    assert proxy.flipped >= 4 and fs.aio.storage.damaged_reads >= 4, (proxy.flipped,
                                                                      fs.aio.storage.damaged_reads)
