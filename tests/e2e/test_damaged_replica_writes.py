"""Partial writes over a replica whose chunk file holds a flipped bit (real processes, R=3).

Before: a write into the committed extent of a chunk (or a truncate that cuts it) was applied by every
replica on its own copy; the copy with the flipped bit computed a different checksum, the head could not
tell whose copy was bad, and the write failed with CHECKSUM_MISMATCH (8 of ~11k writes in the 30-minute
soak), or, worse, a damaged copy was carried into the new version under a fresh checksum. Now each
replica verifies its committed copy before applying such a delta: a damaged successor asks for the
whole new chunk, a damaged head fails the attempt with a retried status while the chunk is repaired
from a verified replica (storage/craq.py: check_base, check_newest). Each test damages every replica in
turn, so the head, the middle and the tail each hold the damage once.
"""

from __future__ import annotations

from pathlib import Path

from threefs.client.client import Client
from threefs.common.ids import chunk_id
from threefs.common.layout import chain_of_chunk
from threefs.rpc.schemas import storage as ss
from threefs.testing.checks import replica_differences
from threefs.testing.chunk_files import chunk_replicas, flip_bit

ROUNDS = 3  # one per replica


def chunk_files(cluster, inode: int, index: int) -> list[tuple[Path, int]]:
    """Where the chunk's committed bytes are on each replica (file, offset of byte 0), by service
    (either chunk engine: testing/chunk_files.py)."""
    found = chunk_replicas(Path(cluster.dir, "data"), chunk_id(inode, index))
    assert len(found) == 3, found
    return found


def replicas(fs: Client, path: str, index: int = 0) -> dict[int, bytes]:
    """Every replica's committed bytes of chunk `index` of `path`, checked against its checksum."""
    attr = fs.stat(path)

    async def read():
        info = await fs.aio.mgmtd.refresh(force=True)
        chain = info.chain(chain_of_chunk(attr.layout, index, info.table(attr.layout.table_id).chains))
        out = {}
        for t in chain.targets:
            io = ss.ReadIO(chain.chain_id, t.target_id, chunk_id(attr.inode, index), 0, attr.layout.chunk_size)
            rsp, payload = await fs.aio.rpc.call(info.target_addr(t.target_id), "storage.batch_read",
                                                 ss.BatchReadReq([io]), ss.BatchReadRsp)
            r = rsp.results[0]
            assert r.status == 0, (t.target_id, r.status, r.message)
            out[t.target_id] = bytes(payload[:r.length]) if payload is not None else b""
        return out

    return fs.run(read())


def assert_all_replicas_hold(fs: Client, path: str, expected: bytes) -> None:
    held = replicas(fs, path)
    wrong = {t: len(b) for t, b in held.items() if b != expected}
    assert not wrong, f"replicas {sorted(wrong)} differ from the acknowledged bytes"
    assert replica_differences(fs, path) == []
    assert fs.read_bytes(path) == expected


def test_partial_writes_and_truncates_succeed_while_a_replica_holds_a_flipped_bit(private_cluster, rng):
    cluster = private_cluster()
    with Client.connect(str(cluster.client_config_path)) as fs:
        # writes into the committed extent of a chunk
        cs = 1 << 20
        expected = bytearray(rng.randbytes(cs))
        fs.write_bytes("/w", bytes(expected))
        inode = fs.stat("/w").inode
        assert fs.stat("/w").layout.chunk_size == cs
        for victim in range(ROUNDS):
            damaged = 1000 + 4096 * victim  # outside every write below: must read back as written
            flip_bit(chunk_files(cluster, inode, 0)[victim], damaged)
            offset, patch = 300_000 + 10_000 * victim, rng.randbytes(4096)
            with fs.open("/w", "r+b", buffering=0) as f:
                f.seek(offset)
                assert f.write(patch) == len(patch)  # acknowledged despite the damaged replica
            expected[offset:offset + len(patch)] = patch
            assert_all_replicas_hold(fs, "/w", bytes(expected))
        # truncates that cut a chunk
        expected = rng.randbytes(900_000)
        fs.write_bytes("/t", expected)
        inode = fs.stat("/t").inode
        for victim in range(ROUNDS):
            flip_bit(chunk_files(cluster, inode, 0)[victim], 500 + victim)
            expected = expected[:len(expected) - 100_000]
            fs.truncate("/t", len(expected))
            assert_all_replicas_hold(fs, "/t", expected)
