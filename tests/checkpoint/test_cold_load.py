"""Cold checkpoint loads: the storage services' data files evicted from the page cache before the load, so each
whole chunk is read with O_DIRECT by storage (tests/storage/test_direct_reads.py) and received straight into
the loaded tensors' buffer; the whole-file loader keeps several groups of chunks in flight.

What they prove: a cold load returns exactly the saved tensors with 1, 2 and 3 groups in flight (groups made
small so that a small checkpoint has many); the chunks really came past the page cache (none of their pages
is cached after the load); a chunk damaged on disk in two of three replicas still loads right cold (caught
on arrival, read from the good replica) and the damaged copies are repaired."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from threefs.checkpoint import CheckpointManager, tensor_io
from threefs.client.client import Client
from threefs.common.ids import chunk_id
from threefs.testing.checks import replica_differences, wait_for
from threefs.testing.chunk_files import chunk_replicas, flip_bit
from threefs.testing.page_cache import drop_cache, skip_unless_cold_reads

MiB = 1 << 20


def _state(seed: int, n: int = 6) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sd = {f"layer{i}.w": torch.randint(-2**15, 2**15, (512 + 97 * i, 1024), dtype=torch.int16, generator=gen)
          .view(torch.bfloat16) for i in range(n)}
    sd["norm"] = torch.ones(1000)
    sd["step"] = torch.tensor(7)
    return sd


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def _data_chunks(fs, mgr, step: int) -> list[bytes]:
    files = {e.file for _, e in mgr.index(step).all_tensors()}
    out = []
    for name in sorted(files):
        attr = fs.stat(f"{mgr.path_of(step)}/{name}")
        cs = attr.layout.chunk_size
        # every chunk but the last: the load reads that one only up to the last tensor's end (not the whole
        # chunk: the ordinary way, through the page cache), and so would a short one (< ZERO_COPY_BYTES_MIN)
        out += [chunk_id(attr.inode, k) for k in range(attr.length // cs) if (k + 1) * cs < attr.length]
    return out


def _cached_pages(data_dir: Path, cids: list[bytes]) -> int:
    from threefs.storage.service import page_cache_holds

    cached = 0
    for cid in cids:
        for path, base in chunk_replicas(data_dir, cid):
            fd = os.open(path, os.O_RDONLY)
            try:
                # the chunk's first 64 KiB page by page (cachestat: no IO, unlike a probing read)
                cached += sum(bool(page_cache_holds(fd, at, 1)) for at in range(base, base + 64 * 1024, 4096))
            finally:
                os.close(fd)
    return cached


def test_cold_load_with_groups_in_flight(cluster, fs, d, monkeypatch):
    sd = _state(21)
    mgr = CheckpointManager(fs, f"{d}/ck", chunk_size=MiB)
    mgr.save(sd, step=1)
    data_dir = Path(cluster.dir, "data")
    skip_unless_cold_reads(data_dir)
    cids = _data_chunks(fs, mgr, 1)
    assert len(cids) >= 8
    monkeypatch.setattr(tensor_io, "READ_PIECE_BYTES", 2 * MiB)  # pieces of 2 chunks, groups of 2 pieces
    monkeypatch.setattr(tensor_io, "WHOLE_GROUP_BYTES", 4 * MiB)
    for in_flight in (1, 2, 3):
        monkeypatch.setattr(tensor_io, "WHOLE_GROUPS_IN_FLIGHT", in_flight)
        drop_cache(data_dir)
        out = mgr.load(1)
        assert _same(out, sd), f"{in_flight} groups in flight"
        assert _cached_pages(data_dir, cids) == 0, "chunks came through the page cache"
    out = mgr.load(1)  # warm (read again while cached by a plain read of the files: sendfile)
    assert _same(out, sd)
    mgr.close()


def test_cold_load_of_a_damaged_chunk_reads_the_good_replica_and_repairs(private_cluster):
    cluster = private_cluster()
    data_dir = Path(cluster.dir, "data")
    with Client.connect(str(cluster.client_config_path)) as fs:
        sd = _state(22, n=3)
        mgr = CheckpointManager(fs, "/ck", chunk_size=MiB)
        mgr.save(sd, step=1)
        cids = _data_chunks(fs, mgr, 1)
        victim = cids[len(cids) // 2]
        replicas = chunk_replicas(data_dir, victim)
        assert len(replicas) == 3
        for where in replicas[:2]:
            flip_bit(where, 12345)
        for _ in range(3):
            drop_cache(data_dir)
            assert _same(mgr.load(1), sd), "a damaged chunk was loaded"
        file = next(e.file for _, e in mgr.index(1).all_tensors())
        wait_for(lambda: replica_differences(fs, f"{mgr.path_of(1)}/{file}") == [], "the damaged copies repaired", 60)
        mgr.close()
