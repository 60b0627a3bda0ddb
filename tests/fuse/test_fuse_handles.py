"""The daemon's open handles, found per file: what a read or a getattr of one file looks at is that file's
handles only (every read used to go through all the daemon's open handles, twice: with thousands of files
open, hundreds of microseconds per read), and the index follows opens and releases exactly.

Real parts: the daemon's operations (no kernel: the requests are called as pyfuse3 would) over the shared
cluster's meta and storage, as tests/fuse/test_fuse_read_during_flush.py does."""

from __future__ import annotations

import os

from fuse_helpers import run_on_daemon_ops

from threefs.client.fuse import FUSE_ROOT


def test_writes_through_one_handle_are_read_through_another_among_many_open_files(cluster, d):
    run_on_daemon_ops(cluster, lambda aio, ops, ctx: _scenario(ops, ctx, d.lstrip("/")))


async def _scenario(ops, ctx, dirname: str) -> None:
    parent = (await ops.lookup(FUSE_ROOT, dirname.encode(), ctx)).st_ino
    others = []  # handles of other files, open throughout (each written: its own length to keep)
    for i in range(20):
        info, entry = await ops.create(parent, b"o%d" % i, 0o100644, os.O_RDWR, ctx)
        await ops.write(info.fh, 0, b"o" * (100 + i))
        others.append((info.fh, entry.st_ino))
    info, entry = await ops.create(parent, b"f", 0o100644, os.O_WRONLY, ctx)
    writer, ino = info.fh, entry.st_ino
    readers = [(await ops.open(ino, os.O_RDONLY, ctx)).fh for _ in range(3)]
    assert [h.ino for h in ops._ino_handles[ino]] == [ino] * 4
    await ops.write(writer, 0, b"x" * 5000)  # not published yet: the daemon's own length counts
    for fh in readers:
        assert bytes(await ops.read(fh, 0, 8192)) == b"x" * 5000
    assert (await ops.getattr(ino, ctx)).st_size == 5000
    for fh, _ in others[::2]:  # other files' handles going away touch nothing of this one
        await ops.release(fh)
    await ops.release(readers[1])
    assert sorted(h.ino for h in ops._ino_handles[ino]) == [ino] * 3
    await ops.write(writer, 5000, b"y" * 1000)
    assert bytes(await ops.read(readers[0], 0, 8192)) == b"x" * 5000 + b"y" * 1000
    await ops.release(writer)  # its length is published; it keeps counting once the handle is gone
    assert bytes(await ops.read(readers[2], 4000, 8192)) == b"x" * 1000 + b"y" * 1000
    for fh in (readers[0], readers[2]):
        await ops.release(fh)
    assert ino not in ops._ino_handles
    for fh, other in others[1::2]:
        assert (await ops.getattr(other, ctx)).st_size == 100 + others.index((fh, other))
        await ops.release(fh)
    assert ops._ino_handles == {} and ops._handles == {}
    await ops.end_deferred()
