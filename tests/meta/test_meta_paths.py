"""Path parsing and resolution: limits, '.', '..', '//', trailing slashes, symlinks (crafted in the KV, since
symlink creation comes later)."""

import errno
import os

import pytest
from meta_helpers import errno_of, run

from threefs.common import limits
from threefs.common.status import StatusCode, ThreeFSError
from threefs.meta import schema
from threefs.meta.paths import Last, parse_path
from threefs.meta.schema import DIRECTORY, SYMLINK, Dentry, Inode


def code_of(fn, *args):
    with pytest.raises(ThreeFSError) as info:
        fn(*args)
    return info.value.code


def test_parse_splits_like_linux():
    assert parse_path("/") == ("/", (), "", Last.ROOT, False, 0)
    assert parse_path("//a//b/") == ("//a//b/", ("a",), "b", Last.NAME, True, 0)
    assert parse_path("/a/./b/.") == ("/a/./b/.", ("a", "b"), ".", Last.DOT, False, 0)
    assert parse_path("/a", 7).start == 0  # absolute paths ignore the parent, as openat(2)
    assert parse_path("b/c", 7) == ("b/c", ("b",), "c", Last.NAME, False, 7)
    assert parse_path("", 7) == ("", (), "", Last.SELF, False, 7)  # the inode itself
    assert parse_path("/a/../b/..").parent == ("a", "..", "b")
    assert parse_path("/a/../b/..").kind is Last.DOTDOT


@pytest.mark.parametrize(
    "path, code",
    [
        ("", StatusCode.INVALID_PATH),
        ("a/b", StatusCode.INVALID_PATH),
        ("/a\x00b", StatusCode.INVALID_PATH),
        ("/" + "n" * (limits.NAME_BYTES_MAX + 1), StatusCode.NAME_TOO_LONG),
        ("/" + "é" * 128, StatusCode.NAME_TOO_LONG),  # 256 bytes in UTF-8: the limit counts bytes
        ("/a" * (limits.PATH_DEPTH_MAX + 1), StatusCode.NAME_TOO_LONG),
        ("/" + "/".join(["n" * 200] * 21), StatusCode.NAME_TOO_LONG),  # > PATH_BYTES_MAX
        ("/" + "\u20ac" * 86, StatusCode.NAME_TOO_LONG),  # 86 characters, 258 bytes
        ("/" + "/".join(["\u20ac" * 80] * 18), StatusCode.NAME_TOO_LONG),  # 1,458 characters, 4,338 bytes
        ("/" + "\u20ac" * 90 + "/a\x00", StatusCode.NAME_TOO_LONG),  # the first bad name's error
        ("/a\x00/" + "\u20ac" * 90, StatusCode.INVALID_PATH),
    ],
)
def test_parse_rejects(path, code):
    assert code_of(parse_path, path) == code


def test_parse_accepts_limits():
    parse_path("/" + "n" * limits.NAME_BYTES_MAX)
    parse_path("/" + "\u20ac" * 85)  # 255 bytes
    parse_path("/" + "/".join(["\u20ac" * 80] * 16))  # 3,856 bytes in 1,296 characters
    parse_path("/a" * limits.PATH_DEPTH_MAX)
    parse_path("/./." * 100 + "/a")  # '.' components are not depth


def test_resolution_through_dots(meta):
    async def main():
        async with meta.store() as store:
            a = await store.mkdir("/a")
            b = await store.mkdir("/a/b")
            assert (await store.stat("/..")).inode == 0  # the root's parent is the root
            assert (await store.stat("/../../a")).inode == a.inode
            assert (await store.stat("//a//b//")).inode == b.inode
            assert (await store.stat("/a/b/..")).inode == a.inode
            assert (await store.stat("/a/./b/../b/.")).inode == b.inode
            err = await errno_of(store.stat("/a/missing/.."))
            assert err == errno.ENOENT  # '..' is physical: the missing name must exist first
            with pytest.raises(FileNotFoundError, match="/a/missing/x"):
                await store.stat("/a/missing/x")
            with pytest.raises(ThreeFSError) as info:
                await store.mkdir("relative")
            assert info.value.code == StatusCode.INVALID_PATH

    run(main())


def test_non_utf8_names_round_trip(meta):
    name = b"caf\xe9".decode("utf-8", "surrogateescape")  # Latin-1 bytes, as FUSE may hand them over

    async def main():
        async with meta.store() as store:
            await store.mkdir(f"/{name}")
            entries, _ = await store.readdir("/")
            assert [e.name for e in entries] == [name]

    run(main())


async def add_symlink(store, parent: int, name: str, target: str, inode_id: int) -> None:
    """Write a symlink the way the (later) symlink operation will: an inode and a dentry."""
    link = Inode(type=SYMLINK, mode=0o777, uid=0, gid=0, nlink=1, atime_ns=1, mtime_ns=1, ctime_ns=1,
                 length=len(target), symlink_target=target)

    async def fn(tr):
        tr.set(schema.inode_key(inode_id), schema.encode(link))
        tr.set(schema.dentry_key(parent, name), schema.encode(Dentry(inode_id, SYMLINK)))

    await store._kv.run(fn)


def test_symlink_resolution(meta):
    async def main():
        async with meta.store() as store:
            a = await store.mkdir("/a")
            b = await store.mkdir("/a/b")
            await add_symlink(store, 0, "abs", "/a/b", 10_001)  # /abs -> /a/b
            await add_symlink(store, a.inode, "rel", "b/..", 10_002)  # /a/rel -> /a
            await add_symlink(store, 0, "loop", "/loop", 10_003)
            await add_symlink(store, 0, "dangling", "/a/new", 10_004)
            assert (await store.stat("/abs")).inode == b.inode
            assert (await store.stat("/abs", follow=False)).type == SYMLINK
            assert (await store.stat("/abs/..")).inode == a.inode  # physical parent of /a/b
            assert (await store.stat("/a/rel")).inode == a.inode
            assert (await store.stat("/a/rel/b")).inode == b.inode
            assert (await store.stat("/abs/", follow=False)).inode == b.inode  # trailing '/' follows
            assert await errno_of(store.stat("/loop")) == errno.ELOOP
            assert await errno_of(store.stat("/loop/x")) == errno.ELOOP
            assert await errno_of(store.open("/abs", os.O_RDONLY | os.O_NOFOLLOW)) == errno.ELOOP
            exclusive = os.O_CREAT | os.O_EXCL | os.O_WRONLY
            assert await errno_of(store.open("/dangling", exclusive)) == errno.EEXIST
            rsp = await store.open("/dangling", os.O_CREAT | os.O_WRONLY)  # creates the target, as Linux
            assert (await store.stat("/a/new")).inode == rsp.attr.inode
            await store.mkdir("/abs/c/d", parents=True)  # mkdir -p walks through the link
            assert (await store.stat("/a/b/c/d")).type == DIRECTORY
            await store.unlink("/abs")  # removes the link, not the directory
            assert (await store.stat("/a/b")).inode == b.inode

    run(main())
