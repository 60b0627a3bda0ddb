"""Real-process fault tests: restart the whole cluster, kill -9 a storage service."""

from __future__ import annotations

import socket

import pytest

from threefs.client.client import Client
from threefs.common.net import ephemeral_range, free_port
from threefs.common.status import ThreeFSError
from threefs.rpc.schemas import mgmtd as ms
from threefs.testing.checks import routing, wait_for

CS = 1 << 20


def _write_files(fs, rng, n=6):
    files = {}
    fs.mkdir("/keep", exist_ok=True)
    for i in range(n):
        data = rng.randbytes(rng.randrange(0, 3 * CS))
        fs.write_bytes(f"/keep/f{i}", data)
        files[f"/keep/f{i}"] = data
    return files


def test_down_then_up_keeps_every_byte(private_cluster, rng):
    cluster = private_cluster()
    with Client.connect(str(cluster.client_config_path)) as fs:
        files = _write_files(fs, rng)
    running = cluster.running()
    assert len(running) >= 5 and sorted(cluster.down()) == sorted(running)
    assert cluster.running() == {}
    cluster.up()
    with Client.connect(str(cluster.client_config_path)) as fs:
        for path, data in files.items():
            assert fs.read_bytes(path) == data
        assert sorted(fs.listdir("/keep")) == sorted(p.rsplit("/", 1)[1] for p in files)


def test_kill9_storage_reads_stay_correct_and_target_resyncs(private_cluster, rng):
    cluster = private_cluster()
    with Client.connect(str(cluster.client_config_path)) as fs:
        files = _write_files(fs, rng)
        cluster.kill("storage-2")
        # right away (before mgmtd notices) and after: reads fail over to live replicas
        for path, data in files.items():
            assert fs.read_bytes(path) == data
        dead = 102
        wait_for(lambda: all(t.public_state != ms.SERVING for t in routing(fs).targets.values()
                          if t.node_id == dead), "targets of the killed node to leave SERVING", 20, interval=0.2)
        # writes continue on the shortened chains
        fs.write_bytes("/keep/during", b"written while storage-2 is down" * 1000)
        files["/keep/during"] = b"written while storage-2 is down" * 1000
        for path, data in files.items():
            assert fs.read_bytes(path) == data
        cluster.up()  # restarts only the missing process, same identity
        wait_for(lambda: all(t.public_state == ms.SERVING for t in routing(fs).targets.values()),
                 "the restarted targets to resync and return to SERVING", 60, interval=0.2)
        for path, data in files.items():
            assert fs.read_bytes(path) == data


def test_taken_port_fails_start_up_with_the_services_own_words(private_cluster):
    """A port taken while the cluster was down: `up` fails at once, quoting the service's log (which port,
    why); once the port is free again, `up` brings the same cluster back."""
    cluster = private_cluster()
    cluster.down()
    port = cluster.existing_spec().metrics_ports["meta-1"]
    with socket.create_server(("127.0.0.1", port)):
        with pytest.raises(ThreeFSError) as e:
            cluster.up()
        assert "meta-1 exited during start-up" in e.value.message
        assert f"cannot listen for metrics on 127.0.0.1:{port}: Address already in use" in e.value.message
        cluster.down()
    cluster.up()
    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.write_bytes("/after-restart", b"ok")
        assert fs.read_bytes("/after-restart") == b"ok"


def test_free_ports_are_outside_the_ephemeral_range():
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(not low <= p <= high for p in ports)
    with socket.create_server(("127.0.0.1", ports[0])):  # free means bindable
        pass
