"""Permissions answer like Linux: one table of (operation, path, expected errno) run as uid 1000 (gid 1000)
against os.* on a real local directory — in a forked child that dropped root — and against MetaStore with
the same user, on the same tree of owners and modes. Root's bypass is checked as well."""

import errno
import os
import shutil
import tempfile

import pytest
from meta_helpers import errname, errno_of, run
from test_meta_posix import RD, RW, WR, local_errno, meta_call

from threefs.meta.ops_attr import Changes
from threefs.meta.store import Caller
from threefs.rpc.schemas.meta import UserCred

CREAT = os.O_CREAT
ME, OTHER = 1000, 2000
USER = UserCred(ME, ME)

# (path, kind, mode, uid, gid): the tree, built by root
TREE = [
    ("pub", "d", 0o777, 0, 0), ("pub/mine", "f", 0o644, ME, ME), ("pub/theirs", "f", 0o644, OTHER, OTHER),
    ("pub/odir", "d", 0o755, OTHER, OTHER),
    ("sticky", "d", 0o1777, 0, 0), ("sticky/mine", "f", 0o644, ME, ME),
    ("sticky/theirs", "f", 0o666, OTHER, OTHER), ("sticky/theirsdir", "d", 0o777, OTHER, OTHER),
    ("ro", "d", 0o755, 0, 0), ("ro/f", "f", 0o644, 0, 0), ("ro/sub", "d", 0o755, 0, 0),
    ("noexec", "d", 0o700, 0, 0), ("noexec/f", "f", 0o644, 0, 0),
    ("home", "d", 0o755, ME, ME), ("home/f", "f", 0o600, ME, ME), ("home/g", "f", 0o666, OTHER, OTHER),
    ("home/d", "d", 0o755, ME, ME),
    ("grp", "d", 0o770, 0, ME), ("grp/f", "f", 0o660, 0, ME),
    ("sgid", "d", 0o2777, 0, OTHER),
]

CASES = [
    ("stat", "noexec/f", errno.EACCES),
    ("stat", "ro/f", 0),
    ("listdir", "noexec", errno.EACCES),
    ("listdir", "ro", 0),
    ("open", "ro/f", RD, 0),
    ("open", "ro/f", WR, errno.EACCES),
    ("open", "ro/f", RD | os.O_TRUNC, errno.EACCES),
    ("open", "ro/new", CREAT | WR, errno.EACCES),
    ("open", "home/g", WR, 0),
    ("open", "home/f", RW, 0),
    ("open", "pub/theirs", WR, errno.EACCES),
    ("open", "pub/theirs", RD, 0),
    ("open", "grp/f", RW, 0),
    ("open", "grp/new", CREAT | WR, 0),
    ("mkdir", "ro/x", errno.EACCES),
    ("mkdir", "pub/x", 0),
    ("mkdir", "noexec/x", errno.EACCES),
    ("unlink", "ro/f", errno.EACCES),
    ("unlink", "pub/theirs", 0),
    ("unlink", "sticky/theirs", errno.EPERM),
    ("unlink", "sticky/mine", 0),
    ("unlink", "noexec/f", errno.EACCES),
    ("rmdir", "sticky/theirsdir", errno.EPERM),
    ("rmdir", "ro/sub", errno.EACCES),
    ("rmdir", "home/d", 0),
    ("rename", "pub/theirs", "pub/x", 0),
    ("rename", "sticky/theirs", "sticky/x", errno.EPERM),
    ("rename", "sticky/mine", "sticky/theirs", errno.EPERM),
    ("rename", "sticky/mine", "sticky/x", 0),
    ("rename", "home/f", "ro/f2", errno.EACCES),
    ("rename", "ro/f", "home/f2", errno.EACCES),
    ("rename", "home/d", "pub/d2", 0),
    ("rename", "pub/odir", "home/x", errno.EACCES),
    ("rename", "pub/odir", "pub/odir2", 0),
    ("truncate", "ro/f", 0, errno.EACCES),
    ("truncate", "home/g", 0, 0),
    ("chmod", "home/f", 0o644, 0),
    ("chmod", "ro/f", 0o666, errno.EPERM),
    ("chmod", "home/g", 0o600, errno.EPERM),
    ("chown", "home/f", OTHER, -1, errno.EPERM),
    ("chown", "home/f", -1, ME, 0),
    ("chown", "home/f", -1, OTHER, errno.EPERM),
    ("chown", "ro/f", -1, ME, errno.EPERM),
    ("utime", "home/g", 0),
    ("utime_at", "home/g", 10**9, errno.EPERM),
    ("utime_at", "home/f", 10**9, 0),
    ("utime", "ro/f", errno.EACCES),
    ("link", "pub/theirs", "pub/l", errno.EPERM),
    ("link", "home/g", "home/l", 0),
    ("link", "pub/mine", "ro/l", errno.EACCES),
    ("symlink", "x", "ro/l", errno.EACCES),
    ("symlink", "x", "pub/l", 0),
    ("readlink", "noexec/f", errno.EACCES),
]


def build_local(root: str) -> None:
    os.chmod(root, 0o755)
    for rel, kind, mode, uid, gid in TREE:
        path = f"{root}/{rel}"
        if kind == "d":
            os.mkdir(path)
        else:
            open(path, "wb").close()
        os.chown(path, uid, gid)
        os.chmod(path, mode)


async def build_meta(store, root: str) -> None:
    await store.mkdir(root)
    for rel, kind, mode, uid, gid in TREE:
        path = f"{root}/{rel}"
        if kind == "d":
            await store.mkdir(path)
        else:
            await store.open(path, os.O_CREAT | os.O_WRONLY)
        await store.setattr(path, Changes(mode=mode, uid=uid, gid=gid))


def local_errno_as_user(op: str, root: str, args: tuple) -> int:
    """Run the local operation in a child that dropped root to uid/gid 1000 (no supplementary groups)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 255
        try:
            os.setgroups([])
            os.setresgid(ME, ME, ME)
            os.setresuid(ME, ME, ME)
            code = local_errno(op, root, args)
        finally:
            os.write(write_end, bytes([code]))
            os._exit(0)
    os.close(write_end)
    got = os.read(read_end, 1)
    os.close(read_end)
    os.waitpid(pid, 0)
    return got[0]


@pytest.fixture
def local_root():
    """A directory every user can reach (pytest's tmp dirs are root-only)."""
    path = tempfile.mkdtemp(prefix="threefs-perms-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build a tree of several owners")
def test_permission_errnos_match_linux(meta, local_root):
    async def main():
        mismatches = []
        async with meta.store() as store:
            for i, (op, *args, expected) in enumerate(CASES):
                local, remote = f"{local_root}/c{i}", f"/c{i}"
                os.mkdir(local)
                build_local(local)
                await build_meta(store, remote)
                got_local = local_errno_as_user(op, local, tuple(args))
                got_meta = await errno_of(meta_call(store, op, remote, tuple(args), Caller(USER)))
                if not got_local == got_meta == expected:
                    mismatches.append(f"{op}{tuple(args)}: expected {errname(expected)}, "
                                      f"linux {errname(got_local)}, meta {errname(got_meta)}")
        assert not mismatches, "\n".join(mismatches)

    run(main())


def test_new_entries_take_the_callers_ids_and_setgid_groups(meta):
    async def main():
        async with meta.store() as store:
            await build_meta(store, "/t")
            f = (await store.open("/t/pub/new", os.O_CREAT | os.O_WRONLY, caller=Caller(USER))).attr
            assert (f.uid, f.gid) == (ME, ME)
            d = await store.mkdir("/t/sgid/d", 0o755, caller=Caller(USER))
            assert (d.uid, d.gid, d.mode) == (ME, OTHER, 0o2755)  # group and setgid passed on
            g = (await store.open("/t/sgid/d/f", os.O_CREAT | os.O_WRONLY, caller=Caller(USER))).attr
            assert g.gid == OTHER
            # root passes every check, even on a directory closed to everyone
            await store.setattr("/t/noexec", Changes(mode=0))
            assert (await store.stat("/t/noexec/f")).type == 1

    run(main())


def test_chmod_of_a_directory_reaches_walks_at_once(meta):
    """A directory's mode is copied into its dentry (walks check search permission from it): a chmod
    must take effect for the very next walk, through both records."""

    async def main():
        async with meta.store() as store:
            await build_meta(store, "/t")
            assert await errno_of(store.stat("/t/home/f", user=USER)) == 0
            await store.setattr("/t/home", Changes(mode=0o700, uid=OTHER))
            assert await errno_of(store.stat("/t/home/f", user=USER)) == errno.EACCES
            await store.setattr("/t/home", Changes(mode=0o711))
            assert await errno_of(store.stat("/t/home/f", user=USER)) == 0

    run(main())
