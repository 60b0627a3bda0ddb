"""rename edge cases beyond the Linux table, and the GC queue (unlink, rename-replace, write sessions)."""

import errno
import os

import msgspec

from meta_helpers import errno_of, run

from threefs.meta import schema
from threefs.meta.schema import DIRECTORY
from threefs.meta.store import Caller

WRITE_NEW = os.O_CREAT | os.O_WRONLY


async def create(store, path, length=-1):
    rsp = await store.open(path, WRITE_NEW)
    return await store.close(rsp.attr.inode, rsp.session, length)


async def raw_inode(store, inode_id):
    raw = await store._kv.run(lambda tr: tr.get(schema.inode_key(inode_id)))
    return None if raw is None else schema.decode_inode(raw)


def test_rename_file_keeps_inode_and_moves_times(meta):
    async def main():
        async with meta.store() as store:
            await store.mkdir("/a")
            await store.mkdir("/b")
            f = await create(store, "/a/f", 10)
            a0, b0 = await store.stat("/a"), await store.stat("/b")
            await store.rename("/a/f", "/b/g")
            g = await store.stat("/b/g")
            assert g.inode == f.inode and g.length == 10
            assert g.ctime_ns > f.ctime_ns and g.mtime_ns == f.mtime_ns  # rename changes ctime only
            a1, b1 = await store.stat("/a"), await store.stat("/b")
            assert a1.mtime_ns > a0.mtime_ns and b1.mtime_ns > b0.mtime_ns
            assert await errno_of(store.stat("/a/f")) == errno.ENOENT

    run(main())


def test_rename_dir_updates_parent_pointer(meta):
    async def main():
        async with meta.store() as store:
            await store.mkdir("/a/b/c", parents=True)
            x = await store.mkdir("/x")
            b = await store.stat("/a/b")
            await store.rename("/a/b", "/x/moved")
            record = await raw_inode(store, b.inode)
            assert (record.parent, record.name) == (x.inode, b"moved")
            assert (await store.stat("/x/moved/c/..")).inode == b.inode
            assert (await store.stat("/x/moved/..")).inode == x.inode
            # the moved directory's new place is what the subtree check sees
            assert await errno_of(store.rename("/x", "/x/moved/c/x")) == errno.EINVAL
            await store.rename("/x/moved/c", "/top")
            assert (await raw_inode(store, (await store.stat("/top")).inode)).parent == 0

    run(main())


def test_rename_noreplace(meta):
    async def main():
        async with meta.store() as store:
            await create(store, "/f")
            await create(store, "/g")
            assert await errno_of(store.rename("/f", "/g", noreplace=True)) == errno.EEXIST
            assert await errno_of(store.rename("/f", "/f", noreplace=True)) == errno.EEXIST  # Linux too
            await store.rename("/f", "/h", noreplace=True)
            assert [e.name for e in (await store.readdir("/"))[0]] == ["g", "h"]

    run(main())


def test_rename_replaces_empty_dir_only(meta):
    async def main():
        async with meta.store() as store:
            src = await store.mkdir("/src")
            await create(store, "/src/keep")
            empty = await store.mkdir("/empty")
            await store.mkdir("/full/x", parents=True)
            assert await errno_of(store.rename("/src", "/full")) == errno.ENOTEMPTY
            await store.rename("/src", "/empty")
            assert (await store.stat("/empty")).inode == src.inode
            assert (await store.stat("/empty/keep")).type != DIRECTORY
            assert await raw_inode(store, empty.inode) is None  # the replaced directory is gone, not queued
            assert await store.gc_pending() == []

    run(main())


def test_root_cannot_be_removed_or_moved(meta):
    async def main():
        async with meta.store() as store:
            await store.mkdir("/d")
            assert await errno_of(store.rmdir("/")) == errno.EBUSY
            assert await errno_of(store.unlink("/")) == errno.EISDIR
            assert await errno_of(store.mkdir("/")) == errno.EEXIST
            assert await errno_of(store.rename("/", "/d/x")) == errno.EBUSY
            assert await errno_of(store.rename("/d", "/")) == errno.EBUSY
            assert await errno_of(store.open("/", os.O_WRONLY)) == errno.EISDIR
            assert (await store.stat("/")).type == DIRECTORY

    run(main())


def test_unlink_queues_gc_and_gc_done_forgets(meta):
    async def main():
        async with meta.store() as store:
            f = await create(store, "/f", 12345)
            await store.unlink("/f")
            assert await errno_of(store.stat("/f")) == errno.ENOENT
            [entry] = await store.gc_pending()
            assert (entry.inode, entry.length, entry.layout) == (f.inode, 12345, f.layout)
            kept = await raw_inode(store, f.inode)
            assert kept is not None and kept.nlink == 0  # kept until the chunks are gone
            await store.gc_done(entry)
            assert await raw_inode(store, f.inode) is None
            assert await store.gc_pending() == []
            await store.gc_done(entry)  # idempotent

    run(main())


def test_gc_done_many_forgets_files_in_batches_and_leaves_a_linked_inode_queued(meta):
    async def main():
        async with meta.store() as store:
            files = [await create(store, f"/f{i}", i) for i in range(40)]
            for i in range(40):
                await store.unlink(f"/f{i}")
            entries = await store.gc_pending(64)
            assert sorted(e.inode for e in entries) == sorted(f.inode for f in files)
            # a queue entry whose inode has a name (which only a bug would make): reported, left queued
            live = await create(store, "/live", 1)
            bogus = schema.GcEntry(live.inode, live.layout, 1, entries[-1].queued_ns + 1)

            async def queue_bogus(tr):
                tr.set(schema.gc_key(bogus), msgspec.msgpack.encode(bogus))

            await store._kv.run(queue_bogus)
            dropped, left = await store.gc_done_many(entries[:25] + [bogus] + entries[25:])
            assert dropped == 40 and [(e.inode, "has names again" in why) for e, why in left] == [(live.inode, True)]
            for f in files:
                assert await raw_inode(store, f.inode) is None
            assert [e.inode for e in await store.gc_pending(64)] == [live.inode]
            assert (await store.stat("/live")).inode == live.inode
            assert await store.gc_done_many(entries) == (0, [])  # idempotent

    run(main())


def test_rename_replace_queues_old_file(meta):
    async def main():
        async with meta.store() as store:
            old = await create(store, "/old", 7)
            new = await create(store, "/new", 9)
            await store.rename("/new", "/old")
            assert (await store.stat("/old")).inode == new.inode
            assert [(e.inode, e.length) for e in await store.gc_pending()] == [(old.inode, 7)]

    run(main())


def test_o_trunc_is_not_gc(meta):
    async def main():
        async with meta.store() as store:
            await create(store, "/f", 100)
            rsp = await store.open("/f", os.O_WRONLY | os.O_TRUNC)
            assert rsp.truncated and rsp.attr.length == 0
            assert await store.gc_pending() == []

    run(main())


def test_gc_waits_for_write_sessions(meta):
    async def main():
        async with meta.store() as store:
            rsp = await store.open("/f", WRITE_NEW, caller=Caller(client_id="w"))
            done = await create(store, "/g", 1)
            await store.unlink("/f")
            await store.unlink("/g")
            assert [e.inode for e in await store.gc_pending()] == [done.inode]  # /f's writer is still busy
            closed = await store.close(rsp.attr.inode, rsp.session, 500, client_id="w")
            assert closed.nlink == 0 and closed.length == 500
            pending = await store.gc_pending()
            assert [e.inode for e in pending] == [rsp.attr.inode, done.inode]  # oldest inode first
            assert await store.gc_pending(limit=1) == pending[:1]

    run(main())


def test_gc_pending_filters_by_queue_time(meta):
    async def main():
        async with meta.store() as store:
            a = await create(store, "/a")
            await store.unlink("/a")
            [first] = await store.gc_pending()
            b = await create(store, "/b")
            await store.unlink("/b")
            assert [e.inode for e in await store.gc_pending(queued_before_ns=first.queued_ns)] == [a.inode]
            assert [e.inode for e in await store.gc_pending()] == [a.inode, b.inode]

    run(main())


def test_many_gc_entries_in_pages(meta):
    async def main():
        async with meta.store() as store:
            inodes = []
            for i in range(300):
                inodes.append((await create(store, f"/f{i}")).inode)
                await store.unlink(f"/f{i}")
            got = []
            while batch := await store.gc_pending(limit=128):
                got += [e.inode for e in batch]
                for e in batch:
                    await store.gc_done(e)
            assert got == sorted(inodes)

    run(main())
