"""A rank of the DCP tests (run as a subprocess: python dcp_worker.py CONFIG ROOT MODE RANK WORLD PORT).

Ends the way a user's script does (barrier, dist.destroy_process_group(), fs.close()) and checks at
exit, after threefs's own exit hooks, that no gloo or TCPStore thread is left for interpreter
finalisation to tear down: a group left alive there aborted a rank at exit (rc -6, "terminate
called without an active exception"), about one run in four."""

import atexit
import glob
import os
import sys

TORCH_COMM_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def _no_comm_threads_at_exit():
    left = sorted(n for n in (open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm"))
                  if n in TORCH_COMM_THREADS)
    if left:
        print(f"torch.distributed threads still alive at exit: {left}", file=sys.stderr, flush=True)
        os._exit(70)


atexit.register(_no_comm_threads_at_exit)  # first registered: runs after every other exit hook

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import threefs
from threefs.checkpoint.dcp import ThreeFSStorageReader, ThreeFSStorageWriter


def full_state():
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g).to(torch.bfloat16),
            "extra": {"epoch": 3, "name": "run-a"}}


def main():
    config, root, mode, rank, world, port = sys.argv[1:7]
    rank, world = int(rank), int(world)
    fs = threefs.connect(config)
    want = full_state()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
    if mode in ("save", "async_save"):
        state = {"w": distribute_tensor(want["w"], mesh, [Shard(0)]), "b": want["b"], "extra": want["extra"]}
        writer = ThreeFSStorageWriter(f"threefs://{root}", fs)
        if mode == "save":
            dcp.save(state, storage_writer=writer)
        else:
            dcp.async_save(state, storage_writer=writer).result()
    elif mode == "load_sharded_cols":  # same world size, another placement: resharding
        state = {"w": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)]), "b": torch.zeros(6, dtype=torch.bfloat16),
                 "extra": {"epoch": 0, "name": ""}}
        dcp.load(state, storage_reader=ThreeFSStorageReader(f"threefs://{root}", fs))
        assert torch.equal(state["w"].full_tensor(), want["w"]), "w"
        assert torch.equal(state["b"], want["b"]) and state["extra"] == want["extra"]
    elif mode == "load_single":  # one process, plain tensors: another world size
        state = {"w": torch.zeros(8, 6), "b": torch.zeros(6, dtype=torch.bfloat16), "extra": {"epoch": 0, "name": ""}}
        dcp.load(state, storage_reader=ThreeFSStorageReader(f"threefs://{root}", fs), no_dist=True)
        assert torch.equal(state["w"], want["w"]) and torch.equal(state["b"], want["b"])
        assert state["extra"] == want["extra"], state["extra"]
    else:
        raise SystemExit(f"unknown mode {mode}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    fs.close()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
