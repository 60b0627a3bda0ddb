"""The kernel's GETATTR of a directory after this mount changed its entries (the kernel invalidates the
directory's attributes at every create, mkdir, unlink, rmdir, rename, link, symlink, mknod) is answered from
the attributes meta's reply to the change carried, as committed, without a meta call: what stat shows of the
directory is what the library's stat says, after each kind of change; another client's change is seen as
before (the kept attributes answer once, within --changed-dir-s); and a create costs a lookup and a create,
an unlink one call."""

from __future__ import annotations

import os
import stat
import time

from fuse_helpers import daemon_counters, require_fuse, stop_daemon

from threefs.client import fuse_mount
from threefs.client.fuse_namespace import ChangedDirs
from threefs.rpc.schemas import meta as m

N = 40


def _same(path: str, fs, tpath: str) -> None:
    """What stat of the directory shows through the mount is what meta says."""
    got, want = os.stat(path), fs.stat(tpath)
    assert (got.st_mtime_ns, got.st_ctime_ns, got.st_nlink, stat.S_IMODE(got.st_mode), got.st_ino) == \
        (want.mtime_ns, want.ctime_ns, want.nlink, want.mode, want.inode), (path, got, want)


def _delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
            if after.get(k, 0) != before.get(k, 0)}


def test_meta_calls_per_create_unlink_mkdir_rmdir(cluster, fs, tmp_path):
    """Counted by the daemon: kernel requests per operation and meta calls per method, for N of each through
    one mount that keeps the attributes and one that does not (--changed-dir-s 0: as before)."""
    require_fuse()
    seen = {}
    for variant, args in (("kept", []), ("off", ["--changed-dir-s", "0"])):
        top = f"/changed-counts-{variant}"
        fs.mkdir(top)
        mnt, log = str(tmp_path / f"m-{variant}"), str(tmp_path / f"daemon-{variant}.log")
        proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, args, log)
        try:
            d = f"{mnt}{top}"
            os.listdir(d)
            lines = 0

            def phase(fn):
                nonlocal lines
                _, k0, m0 = daemon_counters(proc, log, lines)
                for i in range(N):
                    fn(i)
                _, k1, m1 = daemon_counters(proc, log, lines + 1)
                lines += 2
                return _delta(k0, k1), _delta(m0, m1)

            seen[variant] = {
                "create": phase(lambda i: open(f"{d}/f{i}", "w").close()),
                "unlink": phase(lambda i: os.unlink(f"{d}/f{i}")),
                "mkdir": phase(lambda i: os.mkdir(f"{d}/s{i}")),
                "rmdir": phase(lambda i: os.rmdir(f"{d}/s{i}")),
            }
        finally:
            stop_daemon(proc, mnt)
        fs.remove_tree(top)
    for variant in ("kept", "off"):
        for op, (kernel, _) in seen[variant].items():
            # the kernel asks for the directory's attributes once per change either way
            assert N - 1 <= kernel.get("getattr", 0) <= N, (variant, op, kernel)
    kept, off = seen["kept"], seen["off"]
    # kept: a create is a lookup (of the new name) and a create; mkdir likewise; unlink and rmdir one call
    assert kept["create"][1].get("open") == N and kept["create"][1].get("stat", 0) <= N + 1, kept
    assert kept["unlink"][1].get("unlink") == N and kept["unlink"][1].get("stat", 0) <= 1, kept
    assert kept["mkdir"][1].get("mkdir") == N and kept["mkdir"][1].get("stat", 0) <= N + 1, kept
    assert kept["rmdir"][1].get("rmdir") == N and kept["rmdir"][1].get("stat", 0) <= 1, kept
    # off (the daemon before this change): every such getattr was a meta call too
    assert off["create"][1].get("stat", 0) >= 2 * N - 1, off
    assert off["unlink"][1].get("stat", 0) >= N - 1, off
    assert off["mkdir"][1].get("stat", 0) >= 2 * N - 1, off
    assert off["rmdir"][1].get("stat", 0) >= N - 1, off


def test_directory_stat_after_each_change_is_what_meta_says(cluster, fs, tmp_path):
    require_fuse()
    top, other = "/changed-stat", "/changed-stat-other"
    fs.mkdir(top)
    fs.mkdir(other)
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], log)
    try:
        d, o = f"{mnt}{top}", f"{mnt}{other}"
        _same(d, fs, top)
        _same(o, fs, other)
        os.mkdir(f"{d}/sub")  # nlink 3
        stats0, _, _ = daemon_counters(proc, log, 0)
        changes = [
            lambda: open(f"{d}/f", "w").close(),
            lambda: os.mkdir(f"{d}/sub2"),  # nlink 4
            lambda: os.symlink("f", f"{d}/l"),
            lambda: os.mkfifo(f"{d}/p"),
            lambda: os.mknod(f"{d}/r", stat.S_IFREG | 0o600),
            lambda: os.link(f"{d}/f", f"{d}/f2"),
            lambda: os.rename(f"{d}/f2", f"{d}/f3"),
            lambda: os.rename(f"{d}/sub2", f"{o}/sub2"),  # out: nlink 3 here, 3 there
            lambda: os.rename(f"{o}/sub2", f"{d}/sub2"),  # and back
            lambda: os.rmdir(f"{d}/sub2"),
            lambda: os.unlink(f"{d}/f3"),
            lambda: os.chmod(d, 0o750),  # setattr of the directory itself, after the unlink
            lambda: open(f"{d}/g", "w").close(),
            lambda: os.setxattr(d, "user.k", b"v"),  # its ctime moves
            lambda: os.unlink(f"{d}/g"),
        ]
        for change in changes:
            change()
            _same(d, fs, top)
            _same(o, fs, other)
            _same(f"{d}/sub", fs, f"{top}/sub")
        stats1, _, meta = daemon_counters(proc, log, 1)
        # the kept attributes did answer (the entry changes in d and o, each once)
        assert stats1.get("getattr_from_change", 0) - stats0.get("getattr_from_change", 0) >= 10, stats1
        assert os.stat(d).st_nlink == 3 == fs.stat(top).nlink
    finally:
        stop_daemon(proc, mnt)
    fs.remove_tree(top)
    fs.remove_tree(other)


def test_renaming_the_directory_itself_is_seen(cluster, fs, tmp_path):
    """A create in d keeps d's attributes; renaming d (its ctime moves) must not leave them to answer."""
    require_fuse()
    fs.mkdir("/changed-rename")
    fs.mkdir("/changed-rename/dst")
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], log)
    try:
        base = f"{mnt}/changed-rename"
        os.mkdir(f"{base}/d")
        for target, tpath in ((f"{base}/d2", "/changed-rename/d2"), (f"{base}/dst/d3", "/changed-rename/dst/d3")):
            src = f"{base}/d" if target.endswith("d2") else f"{base}/d2"
            open(f"{src}/f{len(target)}", "w").close()  # d's attributes kept
            os.rename(src, target)
            _same(target, fs, tpath)
            _same(base, fs, "/changed-rename")
            _same(f"{base}/dst", fs, "/changed-rename/dst")
    finally:
        stop_daemon(proc, mnt)
    fs.remove_tree("/changed-rename")


def test_another_clients_change_is_seen_as_before(cluster, fs, tmp_path):
    """Attributes cached for 0.5 s. A change by the library right after this mount's own change is seen at
    the kernel's next getattr after the one the kept attributes answered (once); and when the kernel's
    getattr comes later than --changed-dir-s after the change, meta answers it, with the library's change."""
    require_fuse()
    top = "/changed-other"
    fs.mkdir(top)
    for fresh_s, part in (("5", "once"), ("0.3", "fresh")):
        mnt, log = str(tmp_path / f"m-{part}"), str(tmp_path / f"daemon-{part}.log")
        proc = fuse_mount.spawn(str(cluster.client_config_path), mnt,
                                ["--attr-timeout", "0.5", "--changed-dir-s", fresh_s], log)
        try:
            d = f"{mnt}{top}"
            os.listdir(d)
            open(f"{d}/a-{part}", "w").close()
            if part == "once":
                _same(d, fs, top)  # the kept attributes answer (nothing else changed d yet)
                fs.write_bytes(f"{top}/lib-{part}", b"")
                time.sleep(0.6)  # the kernel's attributes expire: it asks again, meta answers
            else:
                fs.write_bytes(f"{top}/lib-{part}", b"")
                time.sleep(0.6)  # the kernel's first getattr after the create comes too late for them
            _same(d, fs, top)
            assert f"lib-{part}" in os.listdir(d)
            stats, _, _ = daemon_counters(proc, log, 0)
            assert stats.get("getattr_from_change", 0) == (1 if part == "once" else 0), (part, stats)
        finally:
            stop_daemon(proc, mnt)
    fs.remove_tree(top)


# -- the bookkeeping alone (no mount): which interleavings of this daemon's changes may keep attributes --

def _dir(inode: int, mtime: int) -> m.InodeAttr:
    return m.InodeAttr(inode, m.DIRECTORY, 0o755, 0, 0, 2, 0, mtime, mtime, mtime)


def test_kept_attributes_answer_once_and_only_after_a_change_alone():
    c = ChangedDirs(fresh_s=60)
    t = c.begin([5])
    assert c.take(5) is None  # in flight: meta answers
    c.end(t, [_dir(5, 1)])
    assert c.take(5) == _dir(5, 1)
    assert c.take(5) is None  # once
    c.end(c.begin([5]), [])  # a change that said nothing of the directory (setattr, xattr)
    assert c.take(5) is None
    c.end(c.begin([1]), [_dir(0, 2)])  # the root: meta's inode 0 is the kernel's 1
    assert c.take(1) == _dir(0, 2)
    c.end(c.begin([5]), [_dir(5, 3)])
    c.forget(5)  # the kernel got fresher attributes (a lookup, an opendir)
    assert c.take(5) is None
    off = ChangedDirs(fresh_s=0)
    off.end(off.begin([5]), [_dir(5, 1)])
    assert off.take(5) is None and off.kept() == 0


def test_overlapping_changes_keep_nothing_whichever_ends_last():
    for first_ends in ("a", "b"):
        c = ChangedDirs(fresh_s=60)
        ta = c.begin([5])
        tb = c.begin([5])
        ends = [(ta, _dir(5, 1)), (tb, _dir(5, 2))]
        if first_ends == "b":
            ends.reverse()
        for t, attr in ends:
            c.end(t, [attr])
        assert c.take(5) is None, first_ends  # which one committed last is not known
    # a change that began and ended while another was in flight, on another directory: no effect
    c = ChangedDirs(fresh_s=60)
    ta = c.begin([5])
    c.end(c.begin([6]), [_dir(6, 1)])
    c.end(ta, [_dir(5, 1)])
    assert c.take(5) == _dir(5, 1) and c.take(6) == _dir(6, 1)


def test_a_rename_or_rmdir_overlapping_a_change_keeps_nothing():
    # a create in 7 overlapping a rename in 5 (which may move 7 itself: its ctime moves, and the create's
    # reply may carry 7 from before)
    for order in ("rename-first", "create-first"):
        c = ChangedDirs(fresh_s=60)
        if order == "rename-first":
            tr = c.begin([5], everything=True)
            tc = c.begin([7])
        else:
            tc = c.begin([7])
            tr = c.begin([5], everything=True)
        c.end(tr, [_dir(5, 1)])
        c.end(tc, [_dir(7, 1)])
        assert c.take(7) is None, order
        assert c.take(5) == _dir(5, 1), order  # the create changed 7 only: the rename's own are sound
    # one alone keeps its directories, and forgets all others kept
    c = ChangedDirs(fresh_s=60)
    c.end(c.begin([7]), [_dir(7, 1)])
    c.end(c.begin([5, 6], everything=True), [_dir(5, 2), _dir(6, 2)])
    assert c.take(7) is None and c.take(5) == _dir(5, 2) and c.take(6) == _dir(6, 2)


def test_attributes_from_meta_during_a_change_keep_none_from_it():
    # a lookup / getattr / opendir of 5 answered by meta while a change of 5 is in flight: that answer may be
    # newer than what the change's reply carries, so the change keeps nothing
    c = ChangedDirs(fresh_s=60)
    t = c.begin([5])
    c.forget(5)
    c.end(t, [_dir(5, 1)])
    assert c.take(5) is None
    c.forget(9)  # of a directory nothing changes: nothing to do
    c.end(c.begin([9]), [_dir(9, 1)])
    assert c.take(9) == _dir(9, 1)


def test_written_small_files_end_their_sessions_in_batches(cluster, fs, tmp_path):
    """open + write + close through the mount: close(2) publishes the length (one meta sync), and the
    release's session end goes in a close_many batch instead of a meta close per file; the library sees
    each file's bytes and length at once."""
    require_fuse()
    top = "/written-batches"
    fs.mkdir(top)
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], log)
    try:
        d = f"{mnt}{top}"
        _, _, m0 = daemon_counters(proc, log, 0)
        for i in range(N):
            with open(f"{d}/w{i}", "wb") as f:
                f.write(b"%d" % i * 100)
            assert fs.read_bytes(f"{top}/w{i}") == b"%d" % i * 100  # published at close(2)
            assert fs.stat(f"{top}/w{i}").length == len(b"%d" % i) * 100
        time.sleep(0.5)  # past DEFERRED_CLOSE_S
        _, _, m1 = daemon_counters(proc, log, 1)
        meta = _delta(m0, m1)
        assert meta.get("close", 0) == 0 and meta.get("sync") == N and 1 <= meta.get("close_many", 0) <= N, meta
        for i in range(N):
            os.unlink(f"{d}/w{i}")
    finally:
        stop_daemon(proc, mnt)
    fs.remove_tree(top)
