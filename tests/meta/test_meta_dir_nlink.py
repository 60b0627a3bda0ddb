"""A directory's link count is 2 + its subdirectories, as on ext4 (pjdfstest rename/24.t checks it): kept by
mkdir (also -p), rmdir, rename (within and across directories, replacing an empty directory) and recursive
remove, also when they race with each other and with file creates in the same directory (two servers).
Directories stored before the count existed, and the root, say 1 ("unknown", as btrfs) and keep saying it."""

import asyncio
import os

import msgspec
from meta_helpers import run

from threefs.meta.store import MetaStore

from threefs.meta import schema
from threefs.meta.schema import Inode


async def nlink(store, path: str) -> int:
    return (await store.stat(path)).nlink


def test_directory_link_counts_follow_their_subdirectories(meta):
    async def main():
        async with meta.store() as store:
            assert await nlink(store, "/") == 1  # the root is not counted (it has no dentry)
            await store.mkdir("/top")
            await store.mkdir("/top/a")
            assert await nlink(store, "/top/a") == 2 and await nlink(store, "/top") == 3 and await nlink(store, "/") == 1
            await store.mkdir("/top/a/b")
            await store.mkdir("/top/a/c")
            await store.mkdir("/top/a/x/y/z", parents=True)
            rsp = await store.open("/top/a/f", 0o101, mode=0o644)  # O_CREAT|O_WRONLY: files do not count
            await store.close(rsp.attr.inode, rsp.session, -1)
            assert await nlink(store, "/top/a") == 5 and await nlink(store, "/top/a/x") == 3
            assert await nlink(store, "/top/a/x/y/z") == 2 and await nlink(store, "/top/a/f") == 1
            await store.rename("/top/a/b", "/top/a/b2")  # within one directory: unchanged
            assert await nlink(store, "/top/a") == 5
            await store.rename("/top/a/b2", "/top/b")  # across: one less there, one more here
            assert await nlink(store, "/top/a") == 4 and await nlink(store, "/top") == 4
            await store.rename("/top/b", "/top/a/c")  # replaces the empty /a/c: two became one
            assert await nlink(store, "/top/a") == 4 and await nlink(store, "/top") == 3
            await store.rename("/top/a/f", "/top/f")  # a file moving changes no count
            assert await nlink(store, "/top/a") == 4
            await store.rmdir("/top/a/c")
            assert await nlink(store, "/top/a") == 3
            assert await store.remove("/top/a/x", recursive=True)  # a tree handed to GC
            assert await nlink(store, "/top/a") == 2
            await store.rmdir("/top/a")
            assert await nlink(store, "/top") == 2

    run(main())


def test_a_directory_stored_before_the_count_keeps_link_count_one(meta):
    async def main():
        async with meta.store() as store:
            d = await store.mkdir("/old")
            await store.mkdir("/old/sub")
            # as an older meta wrote it: no subdirs field
            key = schema.inode_key(d.inode)
            fields = msgspec.structs.asdict(schema.decode_inode(await store._kv.run(lambda tr: tr.get(key))))
            del fields["subdirs"]
            raw = msgspec.msgpack.encode({k: v for k, v in fields.items() if v not in (None, 0, b"", "")
                                          or k in ("type", "mode", "uid", "gid", "nlink")})

            async def put(tr):
                tr.set(key, raw)
            await store._kv.run(put)
            assert schema.decode_inode(raw).subdirs == -1 and isinstance(schema.decode_inode(raw), Inode)
            assert await nlink(store, "/old") == 1
            await store.mkdir("/old/more")
            await store.rmdir("/old/sub")
            await store.rmdir("/old/more")
            assert await nlink(store, "/old") == 1  # never a made-up count

    run(main())


def test_racing_mkdirs_rmdirs_and_creates_in_one_directory_count_right(meta):
    # Two servers on one KV, transactions that yield at every read (so they interleave and conflict). An
    # entry change rewrites the directory's record from a snapshot read: without the dentry write that goes
    # with every count change, a create beside a mkdir (or two mkdirs) would undo the other's count.
    async def main():
        async with meta.store(yielding=True) as one:
            two = MetaStore(one._kv, table_info=lambda table_id: (table_id, 1, 16))
            await one.mkdir("/d")
            await one.mkdir("/d/gone0")
            await one.mkdir("/d/gone1")

            async def create(store, name):
                rsp = await store.open(f"/d/{name}", os.O_CREAT | os.O_WRONLY, mode=0o644)
                await store.close(rsp.attr.inode, rsp.session, -1)

            ops = []
            for i in range(12):
                store = one if i % 2 else two
                ops.append(store.mkdir(f"/d/sub{i}"))
                ops.append(create(store, f"file{i}"))
            ops += [one.rmdir("/d/gone0"), two.rmdir("/d/gone1")]
            await asyncio.gather(*ops)
            assert await nlink(one, "/d") == 2 + 12
            assert one._kv.stats["conflicts"] > 0  # they really raced
            entries, _ = await one.readdir("/d", limit=100)
            assert len(entries) == 24

    run(main())
