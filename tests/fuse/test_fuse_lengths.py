"""The daemon's idea of a file's length (what a read through the mount may return) never goes back to an
older answer of meta's. The daemon serves requests concurrently, so a getattr sent before a close published
more may land after it; taken as it came, it lowered the length, a read through another handle ended
early, and on a `--writeback` mount the kernel zero-filled the rest of the page it was writing into and
wrote the zeros back over the other writer's bytes: two shells appending 300 lines each with `>>` kept
535-578 of 600 lines (NULs instead), 598-600 since. Within one truncate version a file only grows;
a truncate (a newer version) lowers it."""

from __future__ import annotations

import collections
import stat

from threefs.client.fuse import MountOptions, ThreeFSOperations, to_fuse
from threefs.rpc.schemas import meta as m


def daemon() -> ThreeFSOperations:
    ops = ThreeFSOperations.__new__(ThreeFSOperations)  # the attribute logic alone: no mount, no cluster
    ops.options = MountOptions()
    ops._meta_length, ops._handles, ops._ino_handles, ops._reported = {}, {}, {}, {}
    ops._epoch = collections.Counter()
    return ops


def attr(length: int, truncate_ver: int = 0) -> m.InodeAttr:
    return m.InodeAttr(inode=7, type=m.FILE, mode=0o644, uid=0, gid=0, nlink=1, length=length, atime_ns=0,
                       mtime_ns=0, ctime_ns=0, truncate_ver=truncate_ver)


def test_an_older_answer_does_not_lower_the_length():
    ops, ino = daemon(), to_fuse(7)
    assert ops.entry(attr(2369)).st_size == 2369  # meta after a close with hint 2369
    e = ops.entry(attr(2364))  # a getattr answered before that close, landing after it
    assert stat.S_ISREG(e.st_mode) and e.st_size == 2369
    assert ops._length(ino, 2364) == 2369  # what a read through any handle may return


def test_a_truncate_lowers_it_and_older_versions_are_ignored():
    ops, ino = daemon(), to_fuse(7)
    ops.entry(attr(5000))
    assert ops.entry(attr(10, truncate_ver=1)).st_size == 10
    assert ops.entry(attr(5000, truncate_ver=0)).st_size == 10  # from before the truncate
    assert ops.entry(attr(30, truncate_ver=1)).st_size == 30  # grows again after it
    assert ops._length(ino, 0) == 30
