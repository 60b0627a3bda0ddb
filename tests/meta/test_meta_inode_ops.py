"""Operations named by inode (FUSE's view: lookup(parent, name), getattr(inode), create in a parent inode,
...), idempotent retries (request ids), batch stat."""

import errno
import os

from meta_helpers import errno_of, run

from threefs.common.status import ThreeFSError
from threefs.meta.ops_attr import Changes
from threefs.meta.store import Caller
from threefs.meta.schema import DIRECTORY, FILE, SYMLINK

WRITE_NEW = os.O_CREAT | os.O_WRONLY


def test_lookup_getattr_and_create_by_inode(meta):
    async def main():
        async with meta.store() as store:
            d = await store.mkdir("/d")
            f = (await store.open("f", WRITE_NEW, parent=d.inode)).attr
            assert (await store.stat("/d/f")).inode == f.inode
            assert (await store.stat("f", follow=False, parent=d.inode)).inode == f.inode  # lookup
            assert (await store.stat("", parent=f.inode)).type == FILE  # getattr of a file
            assert (await store.stat("", parent=d.inode)).type == DIRECTORY
            sub = await store.mkdir("sub", parent=d.inode)
            assert (await store.stat("sub/..", parent=d.inode)).inode == d.inode
            assert (await store.stat("..", parent=sub.inode)).inode == d.inode  # physical parent
            assert (await store.stat("../..", parent=sub.inode)).inode == 0
            entries, _ = await store.readdir("", parent=d.inode)
            assert [e.name for e in entries] == ["f", "sub"]
            link = await store.symlink("l", "f", parent=d.inode)
            assert link.type == SYMLINK and await store.readlink("", parent=link.inode) == "f"
            assert (await store.stat("l", parent=d.inode)).inode == f.inode  # followed, relative to d
            assert (await store.link("", "h", src_parent=f.inode, dst_parent=sub.inode)).nlink == 2
            rsp = await store.open("", os.O_RDWR, parent=f.inode)  # open(inode)
            assert rsp.session and rsp.attr.inode == f.inode
            attr = await store.setattr("", Changes(mode=0o600), parent=f.inode)
            assert attr.mode == 0o600

    run(main())


def test_inode_ops_errors(meta):
    async def main():
        async with meta.store() as store:
            d = await store.mkdir("/d")
            f = (await store.open("/d/f", WRITE_NEW)).attr
            assert await errno_of(store.open("x", WRITE_NEW, parent=f.inode)) == errno.ENOTDIR
            assert await errno_of(store.stat("", parent=999_999)) == errno.ENOENT
            assert await errno_of(store.unlink("", parent=f.inode)) == errno.EINVAL  # no name to remove
            assert await errno_of(store.stat("x", parent=-5)) == errno.EINVAL
            assert await errno_of(store.mkdir("relative")) == errno.EINVAL  # no parent: must be absolute
            e = await store.mkdir("/e")
            await store.rmdir("/e")
            assert await errno_of(store.open("x", WRITE_NEW, parent=e.inode)) == errno.ENOENT
            await store.open("/d/g", WRITE_NEW)
            await store.remove("/d", recursive=True)  # a tree handed to GC takes no new names
            assert await errno_of(store.mkdir("x", parent=d.inode)) == errno.ENOENT
            assert (await store.stat("", parent=f.inode)).nlink == 1  # still there until GC walks

    run(main())


def test_rename_by_inode_checks_subtrees(meta):
    async def main():
        async with meta.store() as store:
            a = await store.mkdir("/a")
            b = await store.mkdir("/a/b")
            c = await store.mkdir("/a/b/c")
            assert await errno_of(store.rename("b", "x", src_parent=a.inode, dst_parent=c.inode)) == \
                errno.EINVAL  # into its own subtree
            assert await errno_of(store.rename("c", "b", src_parent=b.inode, dst_parent=a.inode)) == \
                errno.ENOTEMPTY  # onto its own ancestor
            await store.rename("c", "c2", src_parent=b.inode, dst_parent=0)
            assert (await store.stat("/c2")).inode == c.inode
            assert (await store.stat("..", parent=c.inode)).inode == 0

    run(main())


def test_retried_mutations_return_the_first_reply(meta):
    async def main():
        async with meta.store() as store:
            def call(rid):
                return Caller(client_id="client-a", request_id=rid)

            first = await store.open("/x", WRITE_NEW | os.O_EXCL, caller=call(1))
            again = await store.open("/x", WRITE_NEW | os.O_EXCL, caller=call(1))  # a retry: no EEXIST
            assert again == first  # the same inode and the same write session
            assert await errno_of(store.open("/x", WRITE_NEW | os.O_EXCL, caller=call(2))) == errno.EEXIST
            d1 = await store.mkdir("/d", caller=call(3))
            assert await store.mkdir("/d", caller=call(3)) == d1
            await store.close(first.attr.inode, first.session, -1, "client-a")
            await store.rename("/x", "/y", caller=call(4))
            await store.rename("/x", "/y", caller=call(4))  # not ENOENT: it already happened
            await store.unlink("/y", caller=call(5))
            await store.unlink("/y", caller=call(5))
            assert [e.inode for e in await store.gc_pending()] == [first.attr.inode]  # queued once
            other = Caller(client_id="client-b", request_id=4)  # ids are per client
            assert await errno_of(store.rename("/x", "/y", caller=other)) == errno.ENOENT
            # removals keep their reply in a record, which expires: after pruning, the same id runs again
            _, dropped = await store.prune_idem(b"", created_before_ns=1 << 62)
            assert dropped == 2
            assert await errno_of(store.rename("/x", "/y", caller=call(4))) == errno.ENOENT
            # creates are recognised by the fingerprint their entry keeps, for as long as it exists
            assert await store.mkdir("/d", caller=call(3)) == d1
            link = await store.symlink("/s", "target", caller=call(6))
            assert await store.symlink("/s", "target", caller=call(6)) == link
            assert await errno_of(store.symlink("/s", "target", caller=call(7))) == errno.EEXIST

    run(main())


def test_batch_stat(meta):
    async def main():
        async with meta.store() as store:
            d = await store.mkdir("/d")
            await store.open("/d/f", WRITE_NEW)
            results = await store.batch_stat([(-1, "/d"), (-1, "/d/f"), (-1, "/missing"), (d.inode, "f"),
                                              (-1, "relative"), (-1, "/d/f/x")])
            kinds = [r.type if not isinstance(r, ThreeFSError) else r.errno for r in results]
            assert kinds == [DIRECTORY, FILE, errno.ENOENT, FILE, errno.EINVAL, errno.ENOTDIR]
            assert await errno_of(store.batch_stat([(-1, "/d")] * 1025)) == errno.EINVAL

    run(main())


def test_bad_ids_get_clear_errors(meta):
    async def main():
        async with meta.store() as store:
            assert await errno_of(store.close(-1, "", 0)) == errno.EINVAL
            assert await errno_of(store.close(1 << 70, "", 0)) == errno.EINVAL
            assert await errno_of(store.mkdir("/x", caller=Caller(client_id="c", request_id=1 << 70))) == \
                errno.EINVAL
            assert await errno_of(store.mkdir("/x", caller=Caller(client_id="c" * 65, request_id=1))) == \
                errno.EINVAL
            assert await errno_of(store.mkdir("/x", caller=Caller(request_id=1))) == errno.EINVAL

    run(main())
