"""Storage under faults with real processes (R=3): kill -9 under a write load, bit flips."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from threefs.client.client import Client
from threefs.common.ids import chunk_id
from threefs.storage.scrub import ScrubReq, ScrubRsp
from threefs.testing.checks import all_serving, replica_differences, routing, wait_for
from threefs.testing.chunk_files import chunk_replicas

CS = 1 << 20


class WriteLoad:
    """A thread writing new files until stopped; remembers what was acknowledged."""

    def __init__(self, fs: Client, rng, prefix: str):
        self.fs, self.rng, self.prefix = fs, rng, prefix
        self.acked: dict[str, bytes] = {}
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            path = f"{self.prefix}/f{i}"
            data = self.rng.randbytes(self.rng.randrange(1, 3 * CS))
            try:
                self.fs.write_bytes(path, data)
                self.acked[path] = data
            except OSError:
                self.failed += 1  # not acknowledged: allowed to be lost
            i += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive()


@pytest.mark.parametrize("victim", ["storage-1", "storage-2"])
def test_kill9_under_write_load_loses_no_acknowledged_write(private_cluster, rng, victim):
    """Each storage process is head of some chains, middle of others and tail of the rest, so one
    kill exercises all three roles."""
    cluster = private_cluster()
    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.mkdir("/load")
        with WriteLoad(fs, rng, "/load") as load:
            wait_for(lambda: len(load.acked) >= 3, "a few writes before the kill", 60)
            cluster.kill(victim)
            node = 100 + int(victim.split("-")[1])
            wait_for(lambda: not any(t.public_state == "SERVING" for t in routing(fs).targets.values()
                                     if t.node_id == node), f"{victim}'s targets to leave SERVING", 30)
            n = len(load.acked)
            wait_for(lambda: len(load.acked) >= n + 3, "writes to continue without the victim", 60)
            cluster.up()  # restart the victim with its old identity
            wait_for(lambda: all_serving(fs), "the restarted targets to resync to SERVING", 90)
            n = len(load.acked)
            wait_for(lambda: len(load.acked) >= n + 2, "writes after the rejoin", 60)
        assert len(load.acked) >= 8
        for path, data in load.acked.items():
            assert fs.read_bytes(path) == data, f"acknowledged {path} changed"
        for path in list(load.acked)[:: max(1, len(load.acked) // 6)]:
            assert replica_differences(fs, path) == []


def _chunk_files(cluster, inode: int, index: int) -> list[tuple[Path, int]]:
    """(data file, offset of the chunk in it) per replica, for either chunk engine."""
    return chunk_replicas(Path(cluster.dir, "data"), chunk_id(inode, index))


def _flip(where: tuple[Path, int], offset: int) -> None:
    path, base = where
    offset += base
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_bit_flips_are_detected_and_repaired(private_cluster, rng):
    cluster = private_cluster()
    with Client.connect(str(cluster.client_config_path)) as fs:
        data = rng.randbytes(3 * CS)
        fs.write_bytes("/flip", data)
        inode = fs.stat("/flip").inode
        # chunk 0: flip a bit in every replica but one; whole-chunk reads detect it and fail over
        files = _chunk_files(cluster, inode, 0)
        assert len(files) == 3
        for f in files[:2]:
            _flip(f, 1000)
        for _ in range(6):  # whole-chunk reads are verified (partial ones rely on the scrub)
            buf = bytearray(len(data))
            with fs.open("/flip", "rb", buffering=0) as f:
                assert f.readinto(buf) == len(data)
            assert buf == data
        wait_for(lambda: replica_differences(fs, "/flip") == [], "read-found corruption repaired", 30)
        # chunk 2: partial reads check the whole chunk the first time they read a version, so damage on
        # disk is never served (without that, these reads returned the flipped byte from 2 replicas)
        for f in _chunk_files(cluster, inode, 2)[:2]:
            _flip(f, 5000)
        for _ in range(12):
            with fs.open("/flip", "rb", buffering=0) as f:
                f.seek(2 * CS + 4096)
                assert f.read(4096) == data[2 * CS + 4096:2 * CS + 8192]
        wait_for(lambda: replica_differences(fs, "/flip") == [], "partial-read-found corruption repaired", 30)
        # chunk 1: a flip that no read touches is found by the scrub
        _flip(_chunk_files(cluster, inode, 1)[1], 5)

        async def scrub_everything():
            info = await fs.aio.mgmtd.refresh(force=True)
            total = ScrubRsp(0, 0, 0)
            for node in info.nodes_of_type("storage"):
                rsp, _ = await fs.aio.rpc.call(node.addr, "storage.scrub", ScrubReq(), ScrubRsp)
                total = ScrubRsp(total.checked + rsp.checked, total.corrupted + rsp.corrupted,
                                 total.repaired + rsp.repaired)
            return total

        result = fs.run(scrub_everything())
        assert result.corrupted == 1 and result.repaired == 1 and result.checked >= 9
        assert replica_differences(fs, "/flip") == []
        assert fs.read_bytes("/flip") == data
        assert fs.run(scrub_everything()).corrupted == 0
