"""Concurrent operations from two MetaStores on one KV. The engine yields at every read, so transactions
really interleave; the KV's conflict checks must then give every race exactly one serial outcome."""

import asyncio
import errno
import os

from meta_helpers import errno_of, run

from threefs.meta.store import MetaStore

WRITE_NEW = os.O_CREAT | os.O_WRONLY


def second_store(store):
    return MetaStore(store._kv, table_info=lambda: (1, 1, 16))


def test_racing_exclusive_creates_one_wins(meta):
    async def main():
        async with meta.store(yielding=True) as one:
            two = second_store(one)
            stores = [one, two] * 10
            results = await asyncio.gather(
                *(errno_of(s.open("/race", WRITE_NEW | os.O_EXCL)) for s in stores)
            )
            assert sorted(results) == [0] + [errno.EEXIST] * 19
            assert one._kv.stats["conflicts"] > 0  # the race really happened inside the KV
            entries, _ = await one.readdir("/")
            assert [e.name for e in entries] == ["race"]

    run(main())


def test_concurrent_creates_of_different_names_all_succeed(meta):
    async def main():
        async with meta.store(yielding=True) as one:
            two = second_store(one)
            await one.mkdir("/d")
            names = [f"f{i:03d}" for i in range(200)]
            rsps = await asyncio.gather(
                *((one if i % 2 else two).open(f"/d/{name}", WRITE_NEW) for i, name in enumerate(names))
            )
            entries, more = await one.readdir("/d", limit=1000)
            assert [e.name for e in entries] == names and not more
            inodes = {rsp.attr.inode for rsp, _ in rsps}
            assert inodes == {e.inode for e in entries} and len(inodes) == 200
            # Creates in one directory do not conflict with each other; the few conflicts left come from
            # the two stores reserving id blocks at the same moment.
            assert one._kv.stats["conflicts"] <= 4

    run(main())


def test_create_races_rmdir(meta):
    async def main():
        async with meta.store(yielding=True) as one:
            two = second_store(one)
            for i in range(10):
                await one.mkdir(f"/d{i}")
                created, removed = await asyncio.gather(
                    errno_of(one.open(f"/d{i}/x", WRITE_NEW)), errno_of(two.rmdir(f"/d{i}"))
                )
                assert (created, removed) in [(0, errno.ENOTEMPTY), (errno.ENOENT, 0)]
                exists = await errno_of(one.stat(f"/d{i}/x")) == 0
                assert exists == (created == 0)

    run(main())


def test_crossed_directory_renames_never_make_a_cycle(meta):
    async def main():
        async with meta.store(yielding=True) as one:
            two = second_store(one)
            for i in range(10):
                p, q = f"/p{i}", f"/q{i}"
                await one.mkdir(p)
                await one.mkdir(q)
                results = await asyncio.gather(
                    errno_of(one.rename(p, f"{q}/p")), errno_of(two.rename(q, f"{p}/q"))
                )
                assert sorted(results) == [0, errno.ENOENT]
                # both directories are still reachable from the root
                reachable = [await errno_of(one.stat(path)) for path in (f"{q}/p", f"{p}/q")]
                assert sorted(reachable) == [0, errno.ENOENT]

    run(main())


def test_rename_into_dir_races_rmdir(meta):
    async def main():
        async with meta.store(yielding=True) as one:
            two = second_store(one)
            for i in range(10):
                await one.mkdir(f"/d{i}")
                await one.open(f"/f{i}", WRITE_NEW)
                moved, removed = await asyncio.gather(
                    errno_of(one.rename(f"/f{i}", f"/d{i}/f")), errno_of(two.rmdir(f"/d{i}"))
                )
                assert (moved, removed) in [(0, errno.ENOTEMPTY), (errno.ENOENT, 0)]

    run(main())


def test_racing_unlinks_queue_one_gc_entry(meta):
    async def main():
        async with meta.store(yielding=True) as one:
            two = second_store(one)
            rsp, _ = await one.open("/f", WRITE_NEW)
            await one.close(rsp.attr.inode, rsp.session, 1)
            results = await asyncio.gather(*(errno_of(s.unlink("/f")) for s in [one, two] * 3))
            assert sorted(results) == [0] + [errno.ENOENT] * 5
            assert [e.inode for e in await one.gc_pending()] == [rsp.attr.inode]

    run(main())


def test_racing_init_and_mkdir_parents(meta):
    async def main():
        async with meta.engine(yielding=True) as kv:
            stores = [MetaStore(kv, table_info=lambda: (1, 1, 16)) for _ in range(4)]
            await asyncio.gather(*(s.init() for s in stores))
            root = await stores[0].stat("/")
            assert all([await s.stat("/") == root for s in stores])
            leaves = await asyncio.gather(
                *(s.mkdir(f"/x/y/z{i}", parents=True) for i, s in enumerate(stores))
            )
            entries, _ = await stores[0].readdir("/x/y")
            assert sorted(e.inode for e in entries) == sorted(leaf.inode for leaf in leaves)
            assert [e.name for e in (await stores[0].readdir("/x"))[0]] == ["y"]

    run(main())
