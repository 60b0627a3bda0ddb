"""setattr with a writer's length published in the same transaction (SetattrReq.publish): the FUSE daemon sets
the times tar and cp -p give an open file this way, so that the publication of the writes before them does
not move mtime to meta's clock afterwards (which it did when the length was published at close)."""

import os

import pytest
from meta_helpers import FakeClock, run

from threefs.common.status import StatusCode, ThreeFSError
from threefs.meta.ops_attr import Changes, LengthUpdate
from threefs.meta.store import Caller

WRITE_NEW = os.O_CREAT | os.O_WRONLY
SET_NS = 1_000_000_123


def test_the_length_is_published_and_the_time_set_is_kept(meta):
    clock = FakeClock(start=5_000_000_000)
    me = Caller(client_id="writer-1")

    async def main():
        async with meta.store(clock_ns=clock) as store:
            rsp = await store.open("/f", WRITE_NEW, mode=0o644, caller=me)
            inode, session = rsp.attr.inode, rsp.session
            attr = await store.setattr("/f", Changes(mtime_ns=SET_NS), caller=me,
                                       publish=(inode, session, LengthUpdate(5000, rsp.attr.truncate_ver)))
            assert (attr.length, attr.mtime_ns) == (5000, SET_NS)
            assert attr.ctime_ns > rsp.attr.ctime_ns
            # the close that follows publishes nothing new: the time stays
            closed = await store.sync(inode, session, LengthUpdate(-1), me.client_id, end_session=True)
            assert (closed.length, closed.mtime_ns) == (5000, SET_NS)
            # two steps (the old way, and what a hint after the setattr does): the time moves
            rsp2 = await store.open("/g", WRITE_NEW, mode=0o644, caller=me)
            await store.setattr("/g", Changes(mtime_ns=SET_NS), caller=me)
            later = await store.sync(rsp2.attr.inode, rsp2.session, LengthUpdate(10), me.client_id)
            assert later.length == 10 and later.mtime_ns > SET_NS

    run(main())


def test_a_hint_of_an_older_truncate_version_is_ignored_the_times_still_set(meta):
    clock = FakeClock(start=5_000_000_000)
    me = Caller(client_id="writer-1")

    async def main():
        async with meta.store(clock_ns=clock) as store:
            rsp = await store.open("/f", WRITE_NEW, mode=0o644, caller=me)
            await store.truncate("/f", 0)  # a truncate by someone: the writer's version is old
            attr = await store.setattr("/f", Changes(mtime_ns=SET_NS), caller=me,
                                       publish=(rsp.attr.inode, rsp.session, LengthUpdate(7000, rsp.attr.truncate_ver)))
            assert attr.length == 0 and attr.mtime_ns == SET_NS

    run(main())


def test_the_service_refuses_an_exact_publish_or_one_with_a_truncate(fs, d):
    from threefs.rpc.schemas import meta as m

    fs.write_bytes(f"{d}/f", b"x")
    inode = fs.stat(f"{d}/f").inode
    for req in (m.SetattrReq(f"{d}/f", mtime_ns=SET_NS, publish=m.SyncReq(inode, "s", 10, exact=True)),
                m.SetattrReq(f"{d}/f", length=0, publish=m.SyncReq(inode, "s", 10))):
        with pytest.raises(ThreeFSError) as e:
            fs.run(fs.aio.meta_call("setattr", req, m.AttrRsp))
        assert e.value.code == StatusCode.INVALID_ARGUMENT and "publishes" in e.value.message
    assert fs.stat(f"{d}/f").length == 1


def test_a_close_with_a_hint_not_to_measure_stores_the_hint(fs, d):
    """CloseReq.exact=False (the S3 gateway: one writer, every write acknowledged): the length is the hint,
    taken as the writer's word, without measuring the file on storage; the default close measures it. Told
    apart here by a hint short of what was written (6 bytes on storage, hint 4)."""
    import os as _os

    from threefs.rpc.schemas import meta as m

    for name, exact, want in (("trusted", False, 4), ("measured", True, 6)):
        rsp = fs.run(fs.aio.create_at(m.NO_PARENT, f"{d}/{name}", _os.O_WRONLY | _os.O_TRUNC, 0o600))
        fs.run(fs.aio.write_at(rsp.attr, 0, b"abcdef"))
        attr = fs.run(fs.aio.close_file(rsp.attr.inode, rsp.session, 4, exact=exact))
        assert attr.length == want and fs.stat(f"{d}/{name}").length == want, name
