"""truncate(2) moves mtime and ctime as Linux does: also when the length does not change (ext4, xfs, btrfs
all do; POSIX requires it only when the size changes). Found by tests/fuse/posix_diff.py (seed 5100)."""

import os

from meta_helpers import FakeClock, run

WRITE_NEW = os.O_CREAT | os.O_WRONLY


def test_truncate_to_the_same_length_moves_mtime_and_ctime(meta):
    clock = FakeClock()

    async def main():
        async with meta.store(clock_ns=clock) as store:
            rsp = await store.open("/f", WRITE_NEW, mode=0o644)
            await store.close(rsp.attr.inode, rsp.session, -1)
            before = await store.stat("/f")
            same = await store.truncate("/f", 0)
            assert same.length == 0
            assert same.mtime_ns > before.mtime_ns and same.ctime_ns > before.ctime_ns
            assert same.atime_ns == before.atime_ns
            grown = await store.truncate("/f", 10)
            assert grown.length == 10 and grown.mtime_ns > same.mtime_ns and grown.ctime_ns > same.ctime_ns
            again = await store.truncate("/f", 10)
            assert again.mtime_ns > grown.mtime_ns and again.ctime_ns > grown.ctime_ns
            assert await store.stat("/f") == again

    run(main())
