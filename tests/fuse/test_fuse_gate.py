"""The gate in front of storage reads (client/fuse.py KernelQueueGate): a read with nothing else held and
nothing queued in the kernel goes to storage at once, in its own task, as a batch of one (queue depth 1:
no loop turns spent waiting for reads that will not come); reads that arrive while the kernel still has
requests queued are held and go together, as one storage batch.

Real parts: the daemon's operations (no kernel: the requests are called as pyfuse3 would) over the shared
cluster's meta and storage. The kernel's queue is what the gate polls: here the read end of a pipe, with a
byte in it while "requests are queued"."""

from __future__ import annotations

import asyncio
import os
import random

from fuse_helpers import run_on_daemon_ops

from threefs.client.fuse import FUSE_ROOT, GATE_IDLE_TURNS


def test_a_lone_read_goes_at_once_and_reads_behind_a_queue_go_together(cluster, d):
    run_on_daemon_ops(cluster, lambda aio, ops, ctx: _scenario(ops, ctx, d.lstrip("/")))


async def _scenario(ops, ctx, dirname: str) -> None:
    queue_r, queue_w = os.pipe()
    data = random.Random(23).randbytes(4 << 20)
    try:
        ops.watch_kernel_queue(queue_r)
        gate, coalescer = ops._gate, ops._coalescer
        parent = (await ops.lookup(FUSE_ROOT, dirname.encode(), ctx)).st_ino
        info, entry = await ops.create(parent, b"f", 0o100644, os.O_WRONLY, ctx)
        await ops.write(info.fh, 0, data)
        await ops.release(info.fh)
        fh = (await ops.open(entry.st_ino, os.O_RDONLY | os.O_DIRECT, ctx)).fh

        # nothing queued, nothing held: each read is its own gate opening and storage batch, at once
        for off in (8192, 3 << 20, 1 << 20):
            before = (gate.batches, coalescer.batches)
            read = asyncio.ensure_future(ops.read(fh, off, 4096))
            batch_tasks = 0  # the coalescer's batch tasks seen while it ran: none, it reads in its own task
            while not read.done():
                batch_tasks = max(batch_tasks, len(coalescer._tasks))
                await asyncio.sleep(0)
            assert bytes(read.result()) == data[off:off + 4096]
            assert (gate.batches, coalescer.batches, batch_tasks) == (before[0] + 1, before[1] + 1, 0)

        # requests queued in the kernel: reads started meanwhile wait for each other
        os.write(queue_w, b"x")
        opened, batches = gate.batches, coalescer.batches
        offs = [k * 100_000 // 4096 * 4096 for k in range(1, 6)]
        reads = [asyncio.ensure_future(ops.read(fh, off, 4096)) for off in offs]
        for _ in range(GATE_IDLE_TURNS // 2):  # held while the queue has requests (and reads join)
            await asyncio.sleep(0)
        assert not any(r.done() for r in reads) and len(gate._waiters) == len(offs)
        os.read(queue_r, 1)  # the kernel's queue is empty: the held reads go, together
        got = await asyncio.gather(*reads)
        assert [bytes(g) for g in got] == [data[o:o + 4096] for o in offs]
        assert (gate.batches, coalescer.batches) == (opened + 1, batches + 1)
        await ops.release(fh)
        await ops.end_deferred()
    finally:
        os.close(queue_r)
        os.close(queue_w)
