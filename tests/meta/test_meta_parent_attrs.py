"""The calls that change a directory's entries return the directory's attributes as their transaction
committed them (`dirs`; on the wire `parents`): what a stat of the directory right after says, nothing for
a call that changed no directory, and under races the records that really committed."""

from __future__ import annotations

import asyncio
import os

import msgspec
from meta_helpers import MetaEnv, run

from threefs.meta.schema import FIFO
from threefs.meta.store import Caller
from threefs.rpc.schemas import meta as m

WRITE_NEW = os.O_CREAT | os.O_WRONLY


def test_each_entry_change_returns_its_directory_as_stat_sees_it(meta: MetaEnv):
    async def main():
        async with meta.store() as store:
            await store.mkdir("/a")
            await store.mkdir("/b")

            async def check(call, *paths):
                dirs: list[m.InodeAttr] = []
                await call(dirs)
                assert [d.inode for d in dirs] == [(await store.stat(p)).inode for p in paths], call
                for d, p in zip(dirs, paths):
                    assert d == await store.stat(p), (call, p)  # mtime, ctime, nlink: all of it
                return dirs

            async def create(dirs):
                rsp = await store.open("/a/f", WRITE_NEW, dirs=dirs)
                await store.close(rsp.attr.inode, rsp.session, -1)

            before = await store.stat("/a")
            (after,) = await check(create, "/a")
            assert after.mtime_ns > before.mtime_ns and after.ctime_ns > before.ctime_ns
            await check(lambda dirs: store.mkdir("/a/sub", dirs=dirs), "/a")
            assert (await store.stat("/a")).nlink == 3
            await check(lambda dirs: store.mkdir("/a/x/y/z", parents=True, dirs=dirs), "/a", "/a/x", "/a/x/y")
            await check(lambda dirs: store.symlink("/a/l", "f", dirs=dirs), "/a")
            await check(lambda dirs: store.mknod("/a/p", FIFO, 0o600, dirs=dirs), "/a")
            await check(lambda dirs: store.link("/a/f", "/b/f2", dirs=dirs), "/b")
            await check(lambda dirs: store.rename("/a/f", "/a/g", dirs=dirs), "/a")
            (a, b) = await check(lambda dirs: store.rename("/a/sub", "/b/sub", dirs=dirs), "/a", "/b")
            assert (a.nlink, b.nlink) == (3, 3)  # /a keeps x; /b got sub
            await check(lambda dirs: store.unlink("/a/g", dirs=dirs), "/a")
            await check(lambda dirs: store.rmdir("/b/sub", dirs=dirs), "/b")
            assert (await store.stat("/b")).nlink == 2
            await check(lambda dirs: store.remove("/a/x", recursive=True, dirs=dirs), "/a")
            # the root's nlink is not counted (1), its times move all the same
            await check(lambda dirs: store.mkdir("/c", dirs=dirs), "/")

    run(main())


def test_calls_that_change_no_directory_return_none(meta: MetaEnv):
    async def main():
        async with meta.store() as store:
            await store.mkdir("/d")
            rsp = await store.open("/d/f", WRITE_NEW)
            await store.close(rsp.attr.inode, rsp.session, -1)
            dirs = [m.InodeAttr(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)]  # replaced, not appended to
            rsp = await store.open("/d/f", WRITE_NEW, dirs=dirs)  # the file exists: /d is not written
            await store.close(rsp.attr.inode, rsp.session, -1)
            assert dirs == []
            rsp = await store.open("/d/f", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dirs=dirs)
            await store.close(rsp.attr.inode, rsp.session, -1)
            assert dirs == []
            # a retried removal (same client, same request id) gets its first reply and no directory:
            # the directory may have changed since the first attempt
            caller = Caller(client_id="c1", request_id=7)
            await store.unlink("/d/f", caller=caller, dirs=dirs)
            assert [d.inode for d in dirs] == [(await store.stat("/d")).inode]
            await store.open("/d/other", WRITE_NEW)
            again: list[m.InodeAttr] = []
            await store.unlink("/d/f", caller=caller, dirs=again)
            assert again == []
            # a retried create (the dentry carries the request) likewise
            caller = Caller(client_id="c1", request_id=8)
            await store.mkdir("/d/s", caller=caller, dirs=dirs)
            assert len(dirs) == 1
            await store.mkdir("/d/s", caller=caller, dirs=again)
            assert again == []

    run(main())


def test_racing_entry_changes_return_what_they_committed(meta: MetaEnv):
    # Two servers on one KV, transactions that yield at every read. An entry change writes the directory's
    # record from a snapshot; a subdirectory count change also writes the directory's dentry, so those
    # serialise. What each returns must be what it wrote: the mkdirs' returned link counts are then each
    # count from 3 to 2 + n once (a snapshot-read or re-read record would repeat or skip some), and the
    # directory's final record is one of the returned ones (the last to commit).
    async def main():
        async with meta.store(yielding=True) as one:
            two = ALT(one)
            await one.mkdir("/d")
            results: list[tuple[str, list[m.InodeAttr]]] = []

            async def mkdir(store, name):
                dirs: list[m.InodeAttr] = []
                await store.mkdir(f"/d/{name}", dirs=dirs)
                results.append(("mkdir", dirs))

            async def create(store, name):
                dirs: list[m.InodeAttr] = []
                rsp = await store.open(f"/d/{name}", WRITE_NEW, dirs=dirs)
                await store.close(rsp.attr.inode, rsp.session, -1)
                results.append(("create", dirs))

            n = 10
            ops = []
            for i in range(n):
                ops.append(mkdir(one if i % 2 else two, f"sub{i}"))
                ops.append(create(two if i % 2 else one, f"file{i}"))
            await asyncio.gather(*ops)
            assert one._kv.stats["conflicts"] > 0  # they really raced
            d = await one.stat("/d")
            assert all(len(dirs) == 1 and dirs[0].inode == d.inode for _, dirs in results)
            counts = sorted(dirs[0].nlink for kind, dirs in results if kind == "mkdir")
            assert counts == list(range(3, 3 + n))
            assert d.nlink == 2 + n
            assert d in [dirs[0] for _, dirs in results]

    run(main())


def ALT(store):
    from threefs.meta.store import MetaStore

    return MetaStore(store._kv, table_info=lambda table_id: (table_id, 1, 16))


def test_the_wire_fields_interoperate_with_older_peers():
    attr = m.InodeAttr(5, m.DIRECTORY, 0o755, 0, 0, 3, 0, 1, 2, 3)
    new = msgspec.msgpack.encode(m.ChangedRsp([attr]))
    assert msgspec.msgpack.decode(new, type=m.OkRsp) == m.OkRsp()  # an older client reads unlink's reply
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(m.OkRsp()), type=m.ChangedRsp).parents == []

    class OldAttrRsp(msgspec.Struct):
        attr: m.InodeAttr

    class OldOpenRsp(msgspec.Struct):
        attr: m.InodeAttr
        session: str = ""
        truncated: bool = False

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(m.AttrRsp(attr, [attr])), type=OldAttrRsp).attr == attr
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(m.OpenRsp(attr, "s", True, [attr])), type=OldOpenRsp)
    assert (old.session, old.truncated) == ("s", True)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(OldOpenRsp(attr, "s")), type=m.OpenRsp)
    assert back.parents == [] and back.session == "s"
    # nothing extra on the wire when there is nothing to say
    assert msgspec.msgpack.encode(m.AttrRsp(attr)) == msgspec.msgpack.encode(OldAttrRsp(attr))
