"""Concurrent operations from two MetaStores on one KV. The engine yields at every read, so transactions
really interleave; the KV's conflict checks must then give every race exactly one serial outcome."""

import asyncio
import errno
import os

from meta_helpers import errno_of, run

from threefs.meta.store import MetaStore

WRITE_NEW = os.O_CREAT | os.O_WRONLY


def second_store(store):
    return MetaStore(store._kv, table_info=lambda table_id: (table_id, 1, 16))


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
            inodes = {rsp.attr.inode for rsp in rsps}
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
            rsp = await one.open("/f", WRITE_NEW)
            await one.close(rsp.attr.inode, rsp.session, 1)
            results = await asyncio.gather(*(errno_of(s.unlink("/f")) for s in [one, two] * 3))
            assert sorted(results) == [0] + [errno.ENOENT] * 5
            assert [e.inode for e in await one.gc_pending()] == [rsp.attr.inode]

    run(main())


def test_racing_init_and_mkdir_parents(meta):
    async def main():
        async with meta.engine(yielding=True) as kv:
            stores = [MetaStore(kv, table_info=lambda table_id: (table_id, 1, 16)) for _ in range(4)]
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


def test_racing_renames_onto_one_name(meta):
    """Two stores move different files onto one new name: with RENAME_NOREPLACE exactly one wins and the
    loser's file stays where it was; replacing, both succeed and the replaced file is queued for GC."""

    async def main():
        async with meta.store(yielding=True) as one:
            two = second_store(one)
            for i in range(8):
                a = await one.open(f"/a{i}", WRITE_NEW)
                b = await one.open(f"/b{i}", WRITE_NEW)
                for rsp in (a, b):
                    await one.close(rsp.attr.inode, rsp.session, -1)
                results = await asyncio.gather(errno_of(one.rename(f"/a{i}", f"/x{i}", noreplace=True)),
                                               errno_of(two.rename(f"/b{i}", f"/x{i}", noreplace=True)))
                assert sorted(results) == [0, errno.EEXIST]
                loser = f"/b{i}" if results[0] == 0 else f"/a{i}"
                assert await errno_of(one.stat(loser)) == 0  # nothing lost
                winner = await one.stat(f"/x{i}")
                assert winner.inode == (a if results[0] == 0 else b).attr.inode
            for i in range(8):
                c = await one.open(f"/c{i}", WRITE_NEW)
                d = await one.open(f"/d{i}", WRITE_NEW)
                for rsp in (c, d):
                    await one.close(rsp.attr.inode, rsp.session, -1)
                await asyncio.gather(one.rename(f"/c{i}", f"/y{i}"), two.rename(f"/d{i}", f"/y{i}"))
                survivor = (await one.stat(f"/y{i}")).inode
                assert survivor in (c.attr.inode, d.attr.inode)
            queued = {e.inode for e in await one.gc_pending(limit=64)}
            assert len(queued) == 8  # each replaced file exactly once

    run(main())


def test_concurrent_creates_by_parent_inode_all_appear(meta):
    async def main():
        async with meta.store(yielding=True) as one:
            two = second_store(one)
            d = await one.mkdir("/d")
            names = [f"n{i:03d}" for i in range(100)]
            await asyncio.gather(*((one if i % 2 else two).open(n, WRITE_NEW, parent=d.inode)
                                   for i, n in enumerate(names)))
            entries, _ = await one.readdir("", parent=d.inode)
            assert [e.name for e in entries] == names
            assert one._kv.stats["conflicts"] <= 4  # creates beside each other do not conflict

    run(main())


def test_create_by_inode_races_rename_of_its_directory(meta):
    """A create in a directory named by inode and a rename of that directory: both land, in either order,
    and the new file is found under the directory's new name."""

    async def main():
        async with meta.store(yielding=True) as one:
            two = second_store(one)
            for i in range(8):
                d = await one.mkdir(f"/d{i}")
                await asyncio.gather(one.open("f", WRITE_NEW, parent=d.inode), two.rename(f"/d{i}", f"/e{i}"))
                assert (await one.stat(f"/e{i}/f")).type == 1

    run(main())
