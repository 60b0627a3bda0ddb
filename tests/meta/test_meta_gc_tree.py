"""Recursive remove (a tree handed to GC in one transaction, emptied page by page) and the write sessions of
clients that went away."""

import errno
import os

from meta_helpers import errno_of, run

from threefs.meta import ops_gc, schema
from threefs.meta.ops_attr import Changes
from threefs.meta.schema import DIRECTORY, FILE
from threefs.meta.store import Caller
from threefs.rpc.schemas.meta import UserCred

WRITE_NEW = os.O_CREAT | os.O_WRONLY


async def create(store, path, length=-1, **kwargs):
    rsp = await store.open(path, WRITE_NEW, **kwargs)
    return await store.close(rsp.attr.inode, rsp.session, length)


async def drain_gc(store) -> list[int]:
    """Run GC as the service does (without storage): empty removed trees, forget files. Returns the files
    collected, in order."""
    files = []
    for _ in range(1000):  # bounded: each round removes at least one entry
        pending = await store.gc_pending(limit=64)
        if not pending:
            return files
        for entry in pending:
            if entry.type == DIRECTORY:
                await store.gc_dir_step(entry)
            else:
                files.append(entry.inode)
                await store.gc_done(entry)
    raise AssertionError("GC did not finish")


async def count_keys(store, prefix: bytes) -> int:
    rows = await store._kv.run(lambda tr: tr.get_range(prefix, schema.strinc(prefix)))
    return len(rows)


def test_recursive_remove_hands_the_tree_to_gc(meta):
    async def main():
        async with meta.store() as store:
            await store.mkdir("/keep")
            inside = []
            for i in range(3):
                await store.mkdir(f"/t/d{i}/deeper", parents=True)
                for j in range(ops_gc.GC_DIR_PAGE // 2 + 5):  # more than a page in some directories
                    inside.append((await create(store, f"/t/d{i}/f{j}", 10)).inode)
                inside.append((await create(store, f"/t/d{i}/deeper/x", 1)).inode)
            shared = await create(store, "/t/shared", 5)
            await store.link("/t/shared", "/keep/shared")
            await store.symlink("/t/sym", "/keep")
            inodes_before = await count_keys(store, schema.INODE_PREFIX)
            assert await errno_of(store.remove("/t")) == errno.ENOTEMPTY  # not recursive
            assert await store.remove("/t", recursive=True) is True
            assert await errno_of(store.stat("/t")) == errno.ENOENT
            assert [e.name for e in (await store.readdir("/"))[0]] == ["keep"]
            collected = await drain_gc(store)
            assert sorted(collected) == sorted(inside)  # every file once; the shared one keeps a name
            assert (await store.stat("/keep/shared")).inode == shared.inode
            assert (await store.stat("/keep/shared")).nlink == 1
            # nothing of the tree is left: 3 x (d, deeper) + t, its files and the symlink
            tree_inodes = 1 + 6 + len(inside) + 1
            assert await count_keys(store, schema.INODE_PREFIX) == inodes_before - tree_inodes
            assert await count_keys(store, schema.GC_PREFIX) == 0

    run(main())


def test_remove_plain_entries_and_non_root_checks(meta):
    async def main():
        async with meta.store() as store:
            user = Caller(UserCred(1000, 1000))
            await store.mkdir("/pub", 0o777)
            await store.mkdir("/pub/mine", caller=user)
            await create(store, "/pub/mine/f", caller=user)
            await store.mkdir("/pub/mine/locked")  # root's, inside the user's directory
            await create(store, "/pub/mine/locked/g")
            await store.setattr("/pub/mine/locked", Changes(mode=0o755))
            assert await errno_of(store.remove("/pub/mine", recursive=True, caller=user)) == errno.EACCES
            assert (await store.stat("/pub/mine/locked/g")).type == FILE  # nothing happened
            await store.setattr("/pub/mine/locked", Changes(mode=0o777))
            assert await store.remove("/pub/mine", recursive=True, caller=user)
            await create(store, "/f")
            await store.mkdir("/empty")
            assert await store.remove("/f") is False
            assert await store.remove("/empty", recursive=True) is False  # empty: removed at once
            assert await errno_of(store.remove("/missing")) == errno.ENOENT

    run(main())


def test_sessions_of_clients_without_a_record_are_found(meta):
    async def main():
        async with meta.store() as store:
            rsp = await store.open("/a", WRITE_NEW, caller=Caller(client_id="never-stamped"),
                                   stamp_client=False)
            assert await store.stale_clients(1 << 62) == []
            found, _ = await store.sessions_of(set(), opened_before_ns=1 << 62)
            assert found == [(rsp.attr.inode, rsp.session, "never-stamped")]
            assert (await store.sessions_of(set(), opened_before_ns=0))[0] == []  # too recent to judge

    run(main())


def test_sessions_of_silent_clients_are_pruned(meta):
    async def main():
        async with meta.store() as store:
            gone, alive = Caller(client_id="gone"), Caller(client_id="alive")
            a = await store.open("/a", WRITE_NEW, caller=gone)
            b = await store.open("/b", WRITE_NEW, caller=gone)
            c = await store.open("/c", WRITE_NEW, caller=alive)
            await store.unlink("/a")
            assert await store.gc_pending() == []  # held by the writer
            now = store._clock_ns()
            await store.touch_clients({"alive": now + 10})
            stale = await store.stale_clients(silent_since_ns=now + 5)
            assert stale == ["gone"]
            sessions, complete = await store.sessions_of({"gone"}, opened_before_ns=0)
            assert complete
            expected = [(a.attr.inode, a.session, "gone"), (b.attr.inode, b.session, "gone")]
            assert sorted(sessions) == sorted(expected)
            pairs = [(inode, session) for inode, session, _ in sessions]
            await store.touch_clients({"gone": now + 20})  # it spoke up: nothing is dropped
            assert not await store.drop_sessions("gone", pairs, now + 5, forget=True)
            assert await store.drop_sessions("gone", pairs, now + 30, forget=True)
            assert [e.inode for e in await store.gc_pending()] == [a.attr.inode]
            assert await store.stale_clients(now + 30) == ["alive"]  # "gone" left with its last session
            assert await store.sessions_of({"gone"}, 0) == ([], True)
            closed = await store.close(c.attr.inode, c.session, 3, "alive")
            assert closed.length == 3

    run(main())
