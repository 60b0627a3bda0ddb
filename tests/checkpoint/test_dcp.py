"""torch.distributed.checkpoint on threefs with 2 real processes on gloo: dcp.save and dcp.async_save
of a DTensor sharded on dim 0, loaded back resharded on dim 1 (2 ranks) and as plain tensors in
one process (another world size); a damaged item is reported by name."""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from threefs.checkpoint.dcp import METADATA, ThreeFSStorageReader
from threefs.common.net import free_port

WORKER = str(Path(__file__).with_name("dcp_worker.py"))


def _run(cluster, root, mode, world, worker=WORKER) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, worker, str(cluster.client_config_path), root, mode, str(r),
                               str(world), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rc, out, err in outs:
        assert rc == 0 and out.strip().endswith("ok"), f"{mode} failed (rc {rc}):\n{err[-3000:]}"
    return [out for _, out, _ in outs]


def test_dcp_two_ranks_save_and_resharded_loads(fs, d, cluster):
    root = f"{d}/dcp"
    _run(cluster, root, "save", 2)
    names = fs.listdir(root)
    assert METADATA in names and sum(n.endswith(".distcp") for n in names) == 2, names
    _run(cluster, root, "load_sharded_cols", 2)
    _run(cluster, root, "load_single", 1)
    # dcp.async_save over it replaces the files of the old save (atomic: metadata renamed last)
    _run(cluster, root, "async_save", 2)
    names = fs.listdir(root)
    assert sum(n.endswith(".distcp") for n in names) == 2 and not any(n.endswith(".tmp") for n in names), names
    _run(cluster, root, "load_single", 1)


def test_dcp_damaged_item_is_named(fs, d, cluster):
    import torch.distributed.checkpoint as dcp

    from threefs.checkpoint.dcp import ThreeFSStorageWriter

    root = f"{d}/dcp"
    state = {"alpha": torch.arange(100, dtype=torch.float32), "beta": torch.ones(50)}
    dcp.save(state, storage_writer=ThreeFSStorageWriter(root, fs), no_dist=True)
    reader = ThreeFSStorageReader(root, fs)
    md = reader.read_metadata()
    key = next(k for k in md.storage_data if k.fqn == "beta")
    info = md.storage_data[key]
    path = f"{root}/{info.relative_path}"
    buf = bytearray(1)
    fs.batch_read([(path, info.offset + 5, buf)])
    fs.batch_write([(path, info.offset + 5, bytes([buf[0] ^ 1]))])
    dest = {"alpha": torch.zeros(100), "beta": torch.zeros(50)}
    from torch.distributed.checkpoint.api import CheckpointException  # DCP wraps storage errors

    with pytest.raises(CheckpointException, match="'beta' failed its checksum"):
        dcp.load(dest, storage_reader=ThreeFSStorageReader(root, fs), no_dist=True)
    with pytest.raises(CheckpointException, match="no DCP checkpoint"):
        dcp.load(dest, storage_reader=ThreeFSStorageReader(f"{d}/none", fs), no_dist=True)


MANAGER_WORKER = str(Path(__file__).with_name("ckpt_worker.py"))


def test_manager_two_ranks_publish_after_all_finish(fs, d, cluster):
    """Each rank writes its own shard; rank 0 publishes one index once all ranks are done; a save
    where one rank fails is published by nobody and fails on every rank."""
    from threefs.checkpoint import CheckpointManager

    root = f"{d}/mgr"
    _run(cluster, root, "save", 2, worker=MANAGER_WORKER)
    m = CheckpointManager(fs, root)
    assert m.steps() == [2, 3]
    idx = m.index(3)
    assert len(idx.ranks) == 2 and {t.file for _, t in idx.all_tensors()} == {"data-r00000.bin", "data-r00001.bin"}
    for r in (0, 1):  # any process can read any rank's part
        out = m.load(3, rank=r)
        assert out["rank"] == r and torch.equal(out["shard"], torch.arange(1000, dtype=torch.float32) + 1000 * r + 3)
    outs = _run(cluster, root, "one_rank_fails", 2, worker=MANAGER_WORKER)
    assert "failed:" in outs[0] and "rank 1" in outs[0] and "not published" in outs[0], outs
    assert "failed:" in outs[1] and "cannot save 'bad'" in outs[1], outs
    assert m.steps() == [2, 3]


def _comm_threads() -> list[str]:
    names = (Path(p).read_text().strip() for p in glob.glob("/proc/self/task/*/comm"))
    return sorted(n for n in names if n in ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv"))


def test_release_process_groups_frees_a_dtensor_jobs_gloo_group():
    """After dist.destroy_process_group() a DTensor job's gloo group is still held by the DeviceMesh
    that DTensor's caches keep: release_process_groups() frees it now (its threads joined), so
    interpreter finalisation has nothing of it to tear down."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from threefs.checkpoint.dcp import release_process_groups

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        t = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(1)])
        assert torch.equal(t.full_tensor(), torch.arange(12.0).reshape(3, 4))
        assert release_process_groups() == 0  # the group is in use: left alone
    finally:
        dist.destroy_process_group()
    del mesh, t
    assert _comm_threads(), "the destroyed group's threads are gone already: nothing left to test"
    assert release_process_groups() >= 1
    assert _comm_threads() == []
    assert release_process_groups() == 0  # idempotent
