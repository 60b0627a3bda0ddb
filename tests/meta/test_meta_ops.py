"""MetaStore operations one at a time: init, mkdir, open/close, truncate, readdir, timestamps, layouts."""

import errno
import os
from collections import Counter

import pytest
from meta_helpers import N_CHAINS, FakeClock, errno_of, run

from threefs.common import limits
from threefs.common.layout import chain_positions
from threefs.common.status import StatusCode, ThreeFSError
from threefs.meta import schema
from threefs.meta.schema import DIRECTORY, FILE
from threefs.meta.ops_attr import Changes, LengthUpdate
from threefs.rpc.schemas.meta import UserCred
from threefs.meta.ops_create import Replan
from threefs.meta.store import Caller, MetaStore

KiB = 1024
WRITE_NEW = os.O_CREAT | os.O_WRONLY


async def create(store, path, **kwargs):
    rsp = await store.open(path, WRITE_NEW, **kwargs)
    return await store.close(rsp.attr.inode, rsp.session, -1)


def test_init_creates_root_once(meta):
    async def main():
        async with meta.store() as store:
            root = await store.stat("/")
            assert (root.inode, root.type, root.mode) == (0, DIRECTORY, 0o755)
            assert root.layout.chunk_size == limits.CHUNK_SIZE_BYTES_DEFAULT
            assert root.layout.stripe == min(N_CHAINS, 16)
            await store.mkdir("/keep")
            root = await store.stat("/")
            again = MetaStore(store._kv, table_info=lambda table_id: (table_id, 1, N_CHAINS))
            await again.init()  # a second server starting: changes nothing
            assert await again.stat("/") == root
            assert [e.name for e in (await again.readdir("/"))[0]] == ["keep"]

    run(main())


def test_root_default_stripe_follows_chain_count(meta):
    async def main():
        async with meta.store(n_chains=3) as store:
            assert (await store.stat("/")).layout.stripe == 3

    run(main())


def test_create_sets_times_and_touches_parent(meta):
    clock = FakeClock()

    async def main():
        async with meta.store(clock_ns=clock) as store:
            d = await store.mkdir("/d", mode=0o700)
            assert d.mode == 0o700 and d.atime_ns == d.mtime_ns == d.ctime_ns
            rsp = await store.open("/d/f", WRITE_NEW, mode=0o600)
            f = rsp.attr
            assert (f.type, f.mode, f.nlink, f.length) == (FILE, 0o600, 1, 0)
            assert f.atime_ns == f.mtime_ns == f.ctime_ns > d.ctime_ns
            d2 = await store.stat("/d")
            assert d2.mtime_ns == d2.ctime_ns == f.ctime_ns  # an entry was added
            assert d2.atime_ns == d.atime_ns
            await store.unlink("/d/f")
            d3 = await store.stat("/d")
            assert d3.mtime_ns > d2.mtime_ns and d3.ctime_ns > d2.ctime_ns

    run(main())


def test_close_publishes_length_and_ends_session(meta):
    async def main():
        async with meta.store() as store:
            rsp = await store.open("/f", WRITE_NEW, caller=Caller(client_id="c1"))
            assert rsp.session and not rsp.truncated
            ino = rsp.attr.inode
            session_key = schema.session_key(ino, rsp.session)
            assert await store._kv.run(lambda tr: tr.get(session_key)) is not None
            closed = await store.close(ino, rsp.session, 5000, client_id="c1")
            assert closed.length == 5000 and closed.mtime_ns > rsp.attr.mtime_ns
            assert await store._kv.run(lambda tr: tr.get(session_key)) is None
            again = await store.close(ino, rsp.session, 5000, client_id="c1")  # a retried close
            assert again.length == 5000
            rsp2 = await store.open("/f", os.O_RDWR, caller=Caller(client_id="c2"))
            shorter = await store.close(ino, rsp2.session, 10, client_id="c2")
            assert shorter.length == 5000  # the length only grows on close
            unchanged = await store.close(ino, "", -1)
            assert unchanged.mtime_ns == shorter.mtime_ns  # nothing written: times stay

    run(main())


def test_close_checks(meta):
    async def main():
        async with meta.store() as store:
            rsp = await store.open("/f", WRITE_NEW, caller=Caller(client_id="c1"))
            ino = rsp.attr.inode
            assert await errno_of(store.close(ino, rsp.session, 1, client_id="other")) == errno.EBADF
            assert await errno_of(store.close(ino, rsp.session, -2)) == errno.EINVAL
            assert await errno_of(store.close(ino, rsp.session, 1 << 62)) == errno.EFBIG
            assert await errno_of(store.close(999_999, "", 1)) == errno.ENOENT

    run(main())


def test_read_only_open_has_no_session(meta):
    async def main():
        async with meta.store() as store:
            await create(store, "/f")
            rsp = await store.open("/f", os.O_RDONLY)
            assert rsp.session == ""
            rsp = await store.open("/g", os.O_CREAT | os.O_RDONLY)
            assert rsp.session == "" and rsp.attr.type == FILE
            begin, end = schema.session_range(rsp.attr.inode)
            assert await store._kv.run(lambda tr: tr.get_range(begin, end)) == []

    run(main())


def test_o_trunc_and_truncate_versions(meta):
    async def main():
        async with meta.store() as store:
            rsp = await store.open("/f", WRITE_NEW)
            await store.close(rsp.attr.inode, rsp.session, 3 * 1024 * KiB)
            rsp2 = await store.open("/f", os.O_WRONLY | os.O_TRUNC)
            assert rsp2.truncated and rsp2.attr.length == 0
            assert rsp2.attr.truncate_ver == rsp.attr.truncate_ver + 1
            rsp3 = await store.open("/f", os.O_WRONLY | os.O_TRUNC)  # already empty: nothing removed
            assert not rsp3.truncated and rsp3.attr.truncate_ver == rsp2.attr.truncate_ver + 1
            # a plan for another version of the file is refused: the service must remove chunks again
            with pytest.raises(Replan):
                await store.open("/f", os.O_WRONLY | os.O_TRUNC, trunc_plan=(rsp.attr.inode, 0))
            plan = await store.truncate_plan("/f", 0)
            assert plan.key == (rsp.attr.inode, rsp3.attr.truncate_ver) and plan.has_sessions
            await store.open("/f", os.O_WRONLY | os.O_TRUNC, trunc_plan=plan.key)

    run(main())


def test_truncate(meta):
    async def main():
        async with meta.store() as store:
            rsp = await store.open("/f", WRITE_NEW)
            await store.close(rsp.attr.inode, rsp.session, 1000)
            plan = await store.truncate_plan("/f", 4000)
            assert not plan.needs_job(4000) and plan.needs_job(999)  # growing without writers: no job
            attr = await store.truncate("/f", 4000, plan=plan.key)  # growing leaves a hole
            assert attr.length == 4000 and attr.mtime_ns > rsp.attr.mtime_ns
            with pytest.raises(Replan):
                await store.truncate("/f", 10, plan=plan.key)  # the version moved on
            attr = await store.truncate("/f", 10)
            assert attr.length == 10 and (await store.stat("/f")).length == 10
            assert await errno_of(store.truncate("/f", 1 << 62)) == errno.EFBIG

    run(main())


def test_hints_from_before_a_truncate_are_ignored(meta):
    """A writer's hint cannot bring back data a truncate removed; an exact length measured across a
    truncate is refused; a hint for the current version is taken."""

    async def main():
        async with meta.store() as store:
            rsp = await store.open("/f", WRITE_NEW, caller=Caller(client_id="w"))
            ino = rsp.attr.inode
            grown = await store.sync(ino, rsp.session, LengthUpdate(hint=100), client_id="w")
            assert grown.length == 100
            await store.truncate("/f", 0)
            stale = await store.sync(ino, rsp.session, LengthUpdate(hint=5000), client_id="w")
            assert stale.length == 0
            with pytest.raises(Replan):
                await store.sync(ino, rsp.session, LengthUpdate(exact_end=5000, exact_ver=0), client_id="w")
            fresh = await store.sync(ino, rsp.session, LengthUpdate(hint=70, hint_ver=stale.truncate_ver))
            assert fresh.length == 70
            exact = await store.close(ino, rsp.session, 80, "w", exact_end=90, exact_ver=fresh.truncate_ver)
            assert exact.length == 90

    run(main())


def test_layout_inheritance(meta):
    async def main():
        async with meta.store() as store:
            big = await store.mkdir("/small", chunk_size=64 * KiB)
            assert (big.layout.chunk_size, big.layout.stripe) == (64 * KiB, N_CHAINS)
            sub = await store.mkdir("/small/sub", stripe=4)
            assert (sub.layout.chunk_size, sub.layout.stripe) == (64 * KiB, 4)
            f = await create(store, "/small/f")
            assert (f.layout.chunk_size, f.layout.stripe, f.layout.table_id) == (64 * KiB, N_CHAINS, 1)
            g = await create(store, "/small/sub/g")
            assert (g.layout.chunk_size, g.layout.stripe) == (64 * KiB, 4)
            h = await create(store, "/small/h", chunk_size=4 * 1024 * KiB, stripe=2)
            assert (h.layout.chunk_size, h.layout.stripe) == (4 * 1024 * KiB, 2)
            assert f.layout.seed == f.inode  # the shuffle seed is stored with the file
            root_file = await create(store, "/r")
            assert root_file.layout.chunk_size == limits.CHUNK_SIZE_BYTES_DEFAULT

    run(main())


BAD_LAYOUTS = [(3000, 0), (2 * KiB, 0), (128 * 1024 * KiB, 0), (0, N_CHAINS + 1), (0, -1)]


@pytest.mark.parametrize("chunk_size, stripe", BAD_LAYOUTS)
def test_invalid_layouts(meta, chunk_size, stripe):
    async def main():
        async with meta.store() as store:
            with pytest.raises(ThreeFSError) as info:
                await store.mkdir("/bad", chunk_size=chunk_size, stripe=stripe)
            assert info.value.code == StatusCode.INVALID_ARGUMENT
            assert await errno_of(store.open("/bad", WRITE_NEW, chunk_size=chunk_size, stripe=stripe)) == \
                errno.EINVAL
            assert await errno_of(store.stat("/bad")) == errno.ENOENT

    run(main())


def test_round_robin_base_index(meta):
    """Consecutive files start on consecutive groups of chains, so data spreads over the whole table."""

    async def main():
        n_chains, stripe = 10, 3
        async with meta.store(n_chains=n_chains) as store:
            await store.mkdir("/d", stripe=stripe)
            layouts = [(await create(store, f"/d/f{i}")).layout for i in range(n_chains)]
            bases = [layout.base_index for layout in layouts]
            assert bases == [(i * stripe) % n_chains + 1 for i in range(n_chains)]
            uses = Counter()
            for layout in layouts:
                positions = chain_positions(layout.base_index, layout.stripe, layout.seed)
                uses.update((p - 1) % n_chains for p in positions)
            assert uses == {chain: stripe for chain in range(n_chains)}  # every chain used equally

    run(main())


def test_no_chains_no_files(meta):
    async def main():
        async with meta.store(n_chains=0) as store:
            await store.mkdir("/d")  # directories need no chains
            assert await errno_of(store.open("/d/f", WRITE_NEW)) == errno.EIO  # CHAIN_TABLE_NOT_FOUND

    run(main())


def test_mkdir_parents(meta):
    async def main():
        async with meta.store() as store:
            leaf = await store.mkdir("/a/b/c", mode=0o700, parents=True, chunk_size=64 * KiB)
            assert leaf.mode == 0o700 and leaf.layout.chunk_size == 64 * KiB
            middle = await store.stat("/a/b")
            assert middle.mode == 0o755 and middle.layout.chunk_size == limits.CHUNK_SIZE_BYTES_DEFAULT
            assert (await store.mkdir("/a/b/c", parents=True)).inode == leaf.inode
            assert (await store.mkdir("/", parents=True)).inode == 0
            assert await errno_of(store.mkdir("/a/b/c")) == errno.EEXIST

    run(main())


def test_readdir_pagination(meta):
    """2,500 entries, pages of 1,000: every name once, in order, and no read returns more than a page + 1."""

    async def main():
        async with meta.store(yielding=True) as store:
            await store.mkdir("/big")
            names = [f"n{i:05d}" for i in range(2500)]
            for name in names:
                await store.open(f"/big/{name}", os.O_CREAT | os.O_RDONLY)
            store._kv.stats["range_rows_max"] = 0
            seen, pages, cursor, more = [], [], "", True
            while more:
                entries, more = await store.readdir("/big", start_after=cursor, limit=1000)
                pages.append(len(entries))
                seen += [e.name for e in entries]
                cursor = entries[-1].name if entries else cursor
            assert pages == [1000, 1000, 500]
            assert seen == names
            assert store._kv.stats["range_rows_max"] <= 1001
            entries, more = await store.readdir("/big", limit=100_000)
            assert len(entries) == limits.READDIR_PAGE_MAX and more  # the limit is capped
            entries, more = await store.readdir("/big", start_after="n02499x")
            assert entries == [] and not more
            entries, _ = await store.readdir("/big", start_after="n01000", limit=2)
            assert [e.name for e in entries] == ["n01001", "n01002"]
            assert await errno_of(store.readdir("/big", limit=0)) == errno.EINVAL

    run(main())


def test_readdir_entries(meta):
    async def main():
        async with meta.store() as store:
            d = await store.mkdir("/d")
            f = await create(store, "/f")
            entries, more = await store.readdir("/")
            expected = [("d", d.inode, DIRECTORY), ("f", f.inode, FILE)]
            assert [(e.name, e.inode, e.type) for e in entries] == expected
            assert not more
            assert await store.readdir("/d") == ([], False)

    run(main())


def test_directory_default_layout_can_be_changed(meta):
    """A directory's default (chunk size, stripe, chain table) applies to files created in it afterwards;
    files keep the layout they were created with."""
    tables = {1: 16, 2: 6}

    def table_info(table_id):
        if table_id not in tables:
            raise ThreeFSError(StatusCode.CHAIN_TABLE_NOT_FOUND, f"no chain table {table_id}")
        return table_id, 3, tables[table_id]

    async def main():
        async with meta.engine() as kv:
            store = MetaStore(kv, table_info=table_info, clock_ns=FakeClock())
            await store.init()
            await store.mkdir("/d")
            before = await create(store, "/d/before")
            d = await store.setattr("/d", Changes(chunk_size=64 * KiB, stripe=2, table_id=2))
            assert (d.layout.table_id, d.layout.chunk_size, d.layout.stripe) == (2, 64 * KiB, 2)
            after = await create(store, "/d/after")
            assert (after.layout.table_id, after.layout.table_version) == (2, 3)
            assert (after.layout.chunk_size, after.layout.stripe) == (64 * KiB, 2)
            assert 1 <= after.layout.base_index <= 6
            assert (await store.stat("/d/before")).layout == before.layout  # unchanged
            sub = await store.mkdir("/d/sub")  # inherited by subdirectories too
            assert sub.layout.table_id == 2
            assert await errno_of(store.setattr("/d/after", Changes(stripe=1))) == errno.EINVAL
            assert await errno_of(store.setattr("/d", Changes(stripe=7))) == errno.EINVAL  # > 6 chains
            assert await errno_of(store.setattr("/d", Changes(table_id=9))) == errno.EIO  # no such table
            user = Caller(UserCred(1000, 1000))
            assert await errno_of(store.setattr("/d", Changes(stripe=1), caller=user)) == errno.EPERM

    run(main())
