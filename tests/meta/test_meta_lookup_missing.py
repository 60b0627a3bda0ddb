"""stat with missing_ok (the FUSE daemon's lookup of a name it is about to create): None for a last name
that does not exist, without the NOT_FOUND error path; everything else answers as without it."""

from __future__ import annotations

import errno
import os

import msgspec
import pytest
from meta_helpers import MetaEnv, errno_of, run

from threefs.rpc.schemas import meta as m


def test_a_missing_last_name_is_none_and_the_rest_as_before(meta: MetaEnv):
    async def main():
        async with meta.store() as store:
            await store.mkdir("/d")
            await store.symlink("/d/l", "nowhere")
            d = (await store.stat("/d")).inode
            assert await store.stat("x", False, parent=d, missing_ok=True) is None
            assert await errno_of(store.stat("x", False, parent=d)) == errno.ENOENT
            assert (await store.stat("l", False, parent=d, missing_ok=True)).type == m.SYMLINK  # not followed
            assert await store.stat("l", True, parent=d, missing_ok=True) is None  # a dangling link's target
            assert (await store.stat("", parent=d, missing_ok=True)).inode == d
            # a directory on the way that does not exist, or a trailing slash: errors as without missing_ok
            assert await errno_of(store.stat("/nope/x", missing_ok=True)) == errno.ENOENT
            await store.open("/d/f", os.O_WRONLY | os.O_CREAT)
            assert await errno_of(store.stat("/d/f/", missing_ok=True)) == errno.ENOTDIR
            assert await errno_of(store.stat("x", parent=123456, missing_ok=True)) == errno.ENOENT

    run(main())


@pytest.mark.parametrize("attr", [None, m.InodeAttr(5, m.FILE, 0o644, 0, 0, 1, 0, 1, 2, 3)])
def test_the_wire_interoperates(attr):
    if attr is not None:  # an older server's StatRsp reads as a LookupRsp
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(m.StatRsp(attr)), type=m.LookupRsp).attr == attr
    # an older server reads a request with missing_ok (it ignores the field); without it nothing extra is sent
    req = msgspec.msgpack.decode(msgspec.msgpack.encode(m.StatReq("x", False, 7, missing_ok=True)), type=m.StatReq)
    assert req.missing_ok and req.parent == 7
    assert b"missing_ok" not in msgspec.msgpack.encode(m.StatReq("x"))
