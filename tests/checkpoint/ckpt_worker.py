"""A rank of the distributed CheckpointManager tests (python ckpt_worker.py CONFIG ROOT MODE RANK WORLD PORT)."""

import sys

import torch
import torch.distributed as dist

import threefs
from threefs.checkpoint import CheckpointManager


def shard(rank: int):
    return torch.arange(1000, dtype=torch.float32) + 1000 * rank


def main():
    config, root, mode, rank, world, port = sys.argv[1:7]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    fs = threefs.connect(config)
    m = CheckpointManager(fs, root, keep_last=2)
    if mode == "save":
        for step in (1, 2, 3):
            state = {"shard": shard(rank) + step, "rank": rank}
            if step == 3:
                m.async_save(state, step=step).result()
            else:
                m.save(state, step=step)
        out = m.load()  # this rank's part of the newest step
        assert out["rank"] == rank and torch.equal(out["shard"], shard(rank) + 3), out
        assert m.steps() == [2, 3], m.steps()
    elif mode == "one_rank_fails":
        state = {"shard": shard(rank), "bad": object() if rank == 1 else 0}
        try:
            m.save(state, step=9)
        except Exception as e:
            print("failed:", type(e).__name__, str(e).replace("\n", " "), flush=True)
        else:
            raise SystemExit("save with a failing rank returned normally")
    dist.barrier()
    m.close()
    dist.destroy_process_group()
    fs.close()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
