"""Real-process fault tests: restart the whole cluster, kill -9 a storage service."""

from __future__ import annotations

import time


from threefs.client.client import Client
from threefs.rpc.schemas import mgmtd as ms

CS = 1 << 20


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _routing(fs: Client) -> ms.RoutingInfo:
    return fs._run(fs.aio.mgmtd.refresh(force=True)).info


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
        _wait(lambda: all(t.public_state != ms.SERVING for t in _routing(fs).targets.values()
                          if t.node_id == dead), 20, "targets of the killed node to leave SERVING")
        # writes continue on the shortened chains
        fs.write_bytes("/keep/during", b"written while storage-2 is down" * 1000)
        files["/keep/during"] = b"written while storage-2 is down" * 1000
        for path, data in files.items():
            assert fs.read_bytes(path) == data
        cluster.up()  # restarts only the missing process, same identity
        _wait(lambda: all(t.public_state == ms.SERVING for t in _routing(fs).targets.values()),
              60, "the restarted targets to resync and return to SERVING")
        for path, data in files.items():
            assert fs.read_bytes(path) == data
