"""A directory's link count is 2 + its subdirectories, as on ext4 (pjdfstest rename/24.t checks it): kept by
mkdir (also -p), rmdir, rename (within and across directories, replacing an empty directory) and recursive
remove. Directories stored before the count existed say 1 ("unknown", as btrfs) and keep saying it."""

import msgspec
from meta_helpers import run

from threefs.meta import schema
from threefs.meta.schema import Inode


async def nlink(store, path: str) -> int:
    return (await store.stat(path)).nlink


def test_directory_link_counts_follow_their_subdirectories(meta):
    async def main():
        async with meta.store() as store:
            assert await nlink(store, "/") == 2
            await store.mkdir("/a")
            assert await nlink(store, "/a") == 2 and await nlink(store, "/") == 3
            await store.mkdir("/a/b")
            await store.mkdir("/a/c")
            await store.mkdir("/a/x/y/z", parents=True)
            rsp = await store.open("/a/f", 0o101, mode=0o644)  # O_CREAT|O_WRONLY: files do not count
            await store.close(rsp.attr.inode, rsp.session, -1)
            assert await nlink(store, "/a") == 5 and await nlink(store, "/a/x") == 3
            assert await nlink(store, "/a/x/y/z") == 2 and await nlink(store, "/a/f") == 1
            await store.rename("/a/b", "/a/b2")  # within one directory: unchanged
            assert await nlink(store, "/a") == 5
            await store.rename("/a/b2", "/b")  # across: one less there, one more here
            assert await nlink(store, "/a") == 4 and await nlink(store, "/") == 4
            await store.rename("/b", "/a/c")  # replaces the empty /a/c: two became one
            assert await nlink(store, "/a") == 4 and await nlink(store, "/") == 3
            await store.rename("/a/f", "/f")  # a file moving changes no count
            assert await nlink(store, "/a") == 4
            await store.rmdir("/a/c")
            assert await nlink(store, "/a") == 3
            assert await store.remove("/a/x", recursive=True)  # a tree handed to GC
            assert await nlink(store, "/a") == 2
            await store.rmdir("/a")
            assert await nlink(store, "/") == 2

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
            assert await nlink(store, "/") == 3

    run(main())
