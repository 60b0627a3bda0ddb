"""Kernel requests and meta calls the mount saves, each checked for what it must not change.

- Names in a directory this mount made moments ago (fuse_namespace.NewDirs): the kernel's lookup of a name the
  mount never touched there is answered "no such name" without a meta call, for the negative timeout after the
  mkdir; what another client makes there meanwhile is seen as a name the kernel had cached as absent would be
  (within the negative timeout), and meta still decides every create.
- Closing a file opened read-only sends the daemon no FLUSH (FOPEN_NOFLUSH); one opened for writing does.
- What tar does per file: the writes' length is published in the setattr that sets the file's times (one meta
  transaction), and chown's refresh of the mode is answered from that setattr's reply.
"""

from __future__ import annotations

import errno
import os
import time

import pytest
from fuse_helpers import daemon_counters, require_fuse, stop_daemon

from threefs.client import fuse_mount
from threefs.client.fuse_namespace import NEW_DIRS_MAX, NewDirs
from threefs.testing.checks import wait_for

N = 30


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_new_dirs_rules():
    clock = Clock()
    nd = NewDirs(5.0, clock)
    assert nd.absent_for(7, "a") == 0.0  # not made here: ask meta
    nd.made(7)
    assert nd.absent_for(7, "a") == 5.0
    nd.touch(7, "a")
    assert nd.absent_for(7, "a") == 0.0 and nd.absent_for(7, "b") == 5.0  # touched: ask meta
    clock.now += 4.0
    assert nd.absent_for(7, "b") == pytest.approx(1.0)
    clock.now += 1.0
    assert nd.absent_for(7, "b") == 0.0 and nd.tracked() == 0  # expired: forgotten
    nd.made(8)
    nd.forget(8)
    assert nd.absent_for(8, "x") == 0.0
    off = NewDirs(0.0, clock)  # --negative-timeout 0
    off.made(9)
    assert off.absent_for(9, "x") == 0.0
    for ino in range(NEW_DIRS_MAX + 10):  # bounded: the oldest go first
        nd.made(1000 + ino)
    assert nd.tracked() == NEW_DIRS_MAX and nd.absent_for(1000, "x") == 0.0
    assert nd.absent_for(1000 + NEW_DIRS_MAX + 9, "x") > 0


def _delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
            if after.get(k, 0) != before.get(k, 0)}


def test_creates_in_a_new_dir_ask_meta_once_each(cluster, fs, tmp_path):
    """mkdir, then N files created in it (open(w) + close): no meta call for the kernel's lookups, one open
    each; every file is there for the library; a name looked up again after its create goes to meta."""
    require_fuse()
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], log)
    try:
        os.mkdir(f"{mnt}/newdir-counts")
        d = f"{mnt}/newdir-counts/made"
        os.mkdir(d)
        s0, k0, m0 = daemon_counters(proc, log, 0)
        for i in range(N):
            open(f"{d}/f{i}", "w").close()
        s1, k1, m1 = daemon_counters(proc, log, 1)
        meta, stats = _delta(m0, m1), _delta(s0, s1)
        assert meta.get("stat", 0) == 0 and meta.get("open") == N, meta
        assert stats.get("lookups_in_new_dirs", 0) >= N, stats
        assert sorted(fs.listdir("/newdir-counts/made")) == sorted(f"f{i}" for i in range(N))
    finally:
        stop_daemon(proc, mnt)


def test_another_clients_name_in_a_new_dir(cluster, fs, tmp_path):
    """A name another client makes in a directory this mount just made: unseen for at most the negative
    timeout (as a name the kernel had cached as absent), seen after; a create of it through the mount is
    meta's to refuse (EEXIST with O_EXCL) or to open, never a second file."""
    require_fuse()
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    timeout_s = 2.0
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, ["--negative-timeout", str(timeout_s)], log)
    try:
        d = f"{mnt}/newdir-other"
        os.mkdir(d)
        made = time.monotonic()
        fs.write_bytes("/newdir-other/theirs", b"from another client")
        fs.write_bytes("/newdir-other/both", b"old")
        with pytest.raises(OSError) as e:
            os.open(f"{d}/theirs", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        assert e.value.errno == errno.EEXIST
        with open(f"{d}/both", "w") as f:  # O_CREAT without O_EXCL: meta opens the file that is there
            f.write("new")
        assert fs.read_bytes("/newdir-other/both") == b"new"
        if time.monotonic() - made < timeout_s - 0.5:
            assert not os.path.exists(f"{d}/never")  # (a name no one made stays absent, of course)
        wait_for(lambda: os.path.exists(f"{d}/theirs"), "the other client's file through the mount",
                 timeout=timeout_s * 2 + 5)
        assert time.monotonic() - made <= 2 * timeout_s + 5
        assert open(f"{d}/theirs", "rb").read() == b"from another client"
        assert sorted(os.listdir(d)) == ["both", "theirs"]  # meta's listing, at any time
    finally:
        stop_daemon(proc, mnt)


def test_no_negative_answers_with_negative_timeout_zero(cluster, fs, tmp_path):
    require_fuse()
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, ["--negative-timeout", "0"], log)
    try:
        d = f"{mnt}/newdir-zero"
        os.mkdir(d)
        fs.write_bytes("/newdir-zero/theirs", b"x")
        assert os.path.exists(f"{d}/theirs")  # at once
    finally:
        stop_daemon(proc, mnt)


def test_closing_a_read_only_file_sends_no_flush(cluster, fs, tmp_path):
    require_fuse()
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], log)
    try:
        fs.mkdir("/noflush")
        fs.write_bytes("/noflush/f", b"data")
        _, k0, _ = daemon_counters(proc, log, 0)
        for _ in range(N):
            with open(f"{mnt}/noflush/f", "rb") as f:
                assert f.read() == b"data"
        _, k1, _ = daemon_counters(proc, log, 1)
        with open(f"{mnt}/noflush/f", "ab") as f:
            f.write(b"+")
        _, k2, _ = daemon_counters(proc, log, 2)
        assert _delta(k0, k1).get("open") == N and "flush" not in _delta(k0, k1), _delta(k0, k1)
        assert _delta(k1, k2).get("flush") == 1, _delta(k1, k2)  # written: its close publishes it
        assert fs.read_bytes("/noflush/f") == b"data+"
    finally:
        stop_daemon(proc, mnt)


def test_tar_like_file_costs_four_meta_calls(cluster, fs, tmp_path):
    """What tar does per file (create, write, futimens, fchown, fchmod, close): the writes' length is
    published in the futimens' own setattr (no sync call), chown's refresh of the mode is answered from
    that setattr's reply (no stat), so: a lookup, the create and three setattrs; the time set stays."""
    require_fuse()
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], log)
    try:
        fs.mkdir("/tarlike")
        assert os.listdir(f"{mnt}/tarlike") == []  # the root and the directory known to the kernel first
        _, _, m0 = daemon_counters(proc, log, 0)
        set_ns = 1_300_000_000_000_000_000
        with open(f"{mnt}/tarlike/f", "wb") as f:
            f.write(b"z" * 70_000)
            f.flush()
            os.utime(f.fileno(), ns=(set_ns, set_ns))
            os.fchown(f.fileno(), 0, 0)
            os.fchmod(f.fileno(), 0o640)
        _, _, m1 = daemon_counters(proc, log, 1)
        meta = _delta(m0, m1)
        assert meta.get("sync", 0) == 0 and meta.get("setattr") == 3 and meta.get("open") == 1, meta
        assert meta.get("stat", 0) == 1, meta  # the create's lookup only
        attr = fs.stat("/tarlike/f")
        assert (attr.length, attr.mtime_ns, attr.mode) == (70_000, set_ns, 0o640)
        assert os.stat(f"{mnt}/tarlike/f").st_mtime_ns == set_ns
    finally:
        stop_daemon(proc, mnt)
