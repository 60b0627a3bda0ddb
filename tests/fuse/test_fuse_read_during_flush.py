"""A read through the mount sees every write the daemon took, even one a flush of another handle has taken
out of its buffer and not yet sent (it waits for an earlier write of the same bytes to land).

The kernel of a `--writeback` mount rewrites the page a `>>` appends to: a handle's write-behind held
[0, 992), the next write [0, 1002) sent that out first and buffered itself; a flush then took the buffer
and waited for the [0, 992) write to land. Once it had, nothing was buffered and nothing in flight, so a
read of the page through another handle (the other shell's `>>`, which the kernel fills a page with before
writing into it) did not wait for the flush: it read [992, 1002) from storage as zeros (within the length
the daemon knew), and the kernel wrote the zeros back with its own line (two shells appending 300 lines
each: 598 of 600 lines in 1 run of 6, a trace of the FUSE requests in docs/fuse.md).

Real parts: the daemon's operations (no kernel: the requests are called as pyfuse3 would) over the shared
cluster's meta and storage. The instruments: a gate in front of the storage writes, and a done-callback on
the first: it starts the read at the step that write is over, before the flush resumes (asyncio runs a
future's done-callbacks in the order they were added, each with call_soon: the write-behind's own, this
test's, then the flush's wake-up). The second write waits for the read when the read went on without the
flush, so without the fix the read finds the old bytes on every run, not only when it wins the race."""

from __future__ import annotations

import asyncio
import os

from fuse_helpers import run_on_daemon_ops

from threefs.client.fuse import FUSE_ROOT, MountOptions


def test_a_read_waits_for_a_flush_that_has_not_sent_its_bytes_yet(cluster, d):
    run_on_daemon_ops(cluster, lambda aio, ops, ctx: _scenario(aio, ops, ctx, d.lstrip("/")),
                      MountOptions(writeback_cache=True))


async def _scenario(aio, ops, ctx, dirname: str) -> None:
    gate, sent = asyncio.Event(), []
    real_write_at = aio.write_at

    async def gated_write_at(attr, offset, buf):
        sent.append((offset, len(buf)))
        if len(sent) == 1:
            await gate.wait()  # the first write stays in flight until the test lets it go
        elif ops.stats["reads"]:  # the read went past the flush: it reads storage before this lands
            await asyncio.wait(reads)
        return await real_write_at(attr, offset, buf)

    try:
        parent = (await ops.lookup(FUSE_ROOT, dirname.encode(), ctx)).st_ino
        info, entry = await ops.create(parent, b"f", 0o100644, os.O_WRONLY | os.O_APPEND, ctx)
        writer_fh, ino = info.fh, entry.st_ino
        reader_fh = (await ops.open(ino, os.O_RDONLY, ctx)).fh
        old = b"".join(b"line-%d-%d\n" % (1 + i % 2, 1 + i // 2) for i in range(100))
        new = old + b"line-1-51\n"  # the kernel writes the whole page again, one line longer
        aio.write_at = gated_write_at

        await ops.write(writer_fh, 0, old)  # buffered
        await ops.write(writer_fh, 0, new)  # not contiguous: the buffered bytes go out (gated), it buffers
        writer = ops._handles[writer_fh].writer
        (first,) = writer._tasks
        reads: list[asyncio.Task] = []
        first.add_done_callback(lambda _t: reads.append(asyncio.ensure_future(ops.read(reader_fh, 0, 4096))))
        flush = asyncio.ensure_future(ops.flush(writer_fh))
        while not writer._lock.locked():  # the flush has taken the buffer and waits for the first write
            await asyncio.sleep(0)
        assert sent == [(0, len(old))] and not flush.done() and not first.done()
        gate.set()
        await flush
        got = bytes(await reads[0])
        assert sent == [(0, len(old)), (0, len(new))]
        assert got == new, f"read {len(got)} bytes ending {got[-24:]!r}, not the flushed {new[-24:]!r}"
        await ops.release(reader_fh)
        await ops.release(writer_fh)
        await ops.end_deferred()
    finally:
        aio.write_at = real_write_at
