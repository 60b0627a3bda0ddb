"""Special files (mknod), extended attributes and kernel-checked credentials, on MetaStore directly (the
mount's behaviour is tests/fuse/test_fuse_posix.py's)."""

import errno
import os

import pytest
from meta_helpers import errno_of, run

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.meta import schema
from threefs.meta.ops_attr import Changes
from threefs.meta.store import Caller
from threefs.meta.users import acting_user
from threefs.rpc.schemas import meta as m

USER = m.UserCred(1000, 1000)
OTHER = m.UserCred(2000, 2000)
CHECKED = m.UserCred(2000, 2000, kernel_checked=True)


def xreq(op, path, name="", value=b"", flags=0, follow=True):
    return m.XattrReq(op, path, name, value, flags, follow)


def test_special_files_are_inodes_with_their_type_mode_and_rdev(meta):
    async def main():
        async with meta.store() as store:
            await store.mkdir("/d", 0o777)
            me = Caller(USER)
            fifo = await store.mknod("/d/p", m.FIFO, 0o640, 0, caller=me)
            dev = await store.mknod("/d/c", m.CHARDEV, 0o600, os.makedev(1, 3))
            sock = await store.mknod("/d/s", m.SOCKET, 0o755, 99, caller=me)
            assert (fifo.type, fifo.mode, fifo.uid, fifo.rdev) == (m.FIFO, 0o640, 1000, 0)
            assert (dev.type, dev.rdev) == (m.CHARDEV, os.makedev(1, 3))
            assert sock.rdev == 0  # only devices keep a device number
            entries, _ = await store.readdir("/d")
            assert [(e.name, e.type) for e in entries] == [("c", m.CHARDEV), ("p", m.FIFO), ("s", m.SOCKET)]
            await store.rename("/d/p", "/d/q", caller=me)
            assert (await store.link("/d/q", "/d/q2")).nlink == 2
            assert (await store.setattr("/d/q", Changes(mode=0o600), caller=me)).mode == 0o600
            with pytest.raises(ThreeFSError) as e:
                await store.open("/d/q", os.O_RDONLY)
            assert e.value.code == StatusCode.NOT_SUPPORTED  # the kernel opens pipes, not meta
            assert await errno_of(store.mknod("/d/q", m.FIFO, 0o644)) == errno.EEXIST
            assert await errno_of(store.mknod("/d/x", m.FILE, 0o644)) == errno.EINVAL
            assert await errno_of(store.truncate("/d/c", 0)) == errno.EINVAL
            await store.unlink("/d/q", caller=me)
            await store.unlink("/d/q2", caller=me)
            assert await errno_of(store.stat("", parent=fifo.inode)) == errno.ENOENT  # released at once
    run(main())


def test_xattrs_limits_flags_namespaces_and_removal_with_the_inode(meta):
    async def main():
        async with meta.store() as store:
            rsp = await store.open("/f", os.O_CREAT | os.O_WRONLY)
            await store.close(rsp.attr.inode, rsp.session, -1)
            f = rsp.attr
            before = (await store.stat("/f")).ctime_ns
            await store.xattr(xreq(m.XATTR_SET, "/f", "user.a", b"1"))
            assert (await store.stat("/f")).ctime_ns > before  # setxattr moves ctime
            assert (await store.xattr(xreq(m.XATTR_GET, "/f", "user.a"))).value == b"1"
            await store.xattr(xreq(m.XATTR_SET, "/f", "trusted.t", b""))
            assert (await store.xattr(xreq(m.XATTR_LIST, "/f"))).names == ["trusted.t", "user.a"]
            assert (await store.xattr(xreq(m.XATTR_LIST, "/f"), Caller(USER))).names == ["user.a"]
            cases = [
                (xreq(m.XATTR_SET, "/f", "user.a", b"2", m.XATTR_CREATE), errno.EEXIST),
                (xreq(m.XATTR_SET, "/f", "user.b", b"2", m.XATTR_REPLACE), errno.ENODATA),
                (xreq(m.XATTR_GET, "/f", "user.b"), errno.ENODATA),
                (xreq(m.XATTR_SET, "/f", "user." + "n" * 251, b""), errno.ERANGE),
                (xreq(m.XATTR_SET, "/f", "user.big", b"x" * (64 * 1024 + 1)), errno.E2BIG),
                (xreq(m.XATTR_SET, "/f", "os2.x", b""), errno.EOPNOTSUPP),
                (xreq(m.XATTR_SET, "/f", "user.", b""), errno.EINVAL),
                (xreq(m.XATTR_REMOVE, "/f", "user.b"), errno.ENODATA),
                (xreq("frob", "/f"), errno.EINVAL),
            ]
            for req, want in cases:
                assert await errno_of(store.xattr(req)) == want, req
            await store.xattr(xreq(m.XATTR_SET, "/f", "user.big", b"x" * 64 * 1024))
            await store.xattr(xreq(m.XATTR_REMOVE, "/f", "user.big"))
            await store.unlink("/f")
            await store.gc_done((await store.gc_pending())[0])
            begin, end = schema.xattr_range(f.inode)
            assert await store._kv.run(lambda tr: tr.get_range(begin, end)) == []  # gone with the inode
    run(main())


def test_xattr_permissions_for_api_callers_and_the_kernel_checked_bypass(meta):
    async def main():
        async with meta.store() as store:
            await store.mkdir("/d", 0o1777)
            await store.open("/d/f", os.O_CREAT | os.O_WRONLY, 0o644, caller=Caller(USER))
            await store.mknod("/d/p", m.FIFO, 0o666)
            other = Caller(OTHER)
            denied = await errno_of(store.xattr(xreq(m.XATTR_SET, "/d/f", "user.a", b""), other))
            assert denied == errno.EACCES
            assert await errno_of(store.xattr(xreq(m.XATTR_SET, "/d/f", "trusted.a", b""),
                                              Caller(USER))) == errno.EPERM
            assert await errno_of(store.xattr(xreq(m.XATTR_SET, "/d/p", "user.a", b""))) == errno.EPERM
            assert await errno_of(store.xattr(xreq(m.XATTR_GET, "/d/p", "user.a"))) == errno.ENODATA
            assert await errno_of(store.xattr(xreq(m.XATTR_SET, "/d", "user.a", b""), other)) == errno.EPERM
            # the kernel already decided (FUSE default_permissions): meta does not decide again
            await store.xattr(xreq(m.XATTR_SET, "/d/f", "user.a", b"k"), Caller(CHECKED))
            assert (await store.xattr(xreq(m.XATTR_GET, "/d/f", "user.a"), other)).value == b"k"
    run(main())


def test_kernel_checked_credentials_pass_every_check_and_still_own_new_inodes(meta):
    async def main():
        async with meta.store() as store:
            await store.mkdir("/g", 0o2770)
            await store.setattr("/g", Changes(gid=500))
            f = (await store.open("/g/f", os.O_CREAT | os.O_WRONLY, 0o600)).attr
            checked = Caller(CHECKED)
            # a caller whose groups FUSE could not tell meta (the kernel saw its supplementary group 500)
            assert await errno_of(store.mkdir("/g/x", caller=Caller(OTHER))) == errno.EACCES
            x = await store.mkdir("/g/x", 0o755, caller=checked)
            assert (x.uid, x.gid, x.mode) == (2000, 500, 0o2755)  # the setgid directory's group and bit
            await store.rename("/g/x", "/g/y", caller=checked)
            assert (await store.setattr("/g/f", Changes(mode=0o2640), caller=checked)).mode == 0o2640
            await store.truncate("/g/f", 5, user=CHECKED)  # ftruncate on an fd the kernel let it open
            assert (await store.setattr("/g/f", Changes(uid=2000), caller=checked)).uid == 2000
            assert (await store.stat("", parent=f.inode)).length == 5
            await store.unlink("/g/f", caller=checked)
    run(main())


def test_only_privileged_principals_send_kernel_checked_credentials():
    known = {"user:alice#1": m.UserCred(2000, 2000)}
    assert acting_user("cluster", CHECKED, known) == CHECKED
    with pytest.raises(ThreeFSError) as e:
        acting_user("user:alice#1", CHECKED, known)
    assert e.value.code == status_error(StatusCode.PERMISSION_DENIED, "").code
