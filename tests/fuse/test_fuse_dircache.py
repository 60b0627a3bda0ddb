"""Directory listings cached by the kernel, with close-to-open consistency: an unchanged directory is
listed again from the kernel's cache (no readdir reaches the daemon), and every change, by another client
(the library: create, remove, rename in and out, mkdir) or through the mount, is in the next listing."""

from __future__ import annotations

import ast
import os
import re
import signal
import time

from fuse_helpers import require_fuse, stop_daemon

from threefs.client import fuse_mount


def _counters(proc, log: str, seen: int) -> dict:
    """The daemon's counters, from the statistics line SIGUSR1 makes it log (the one after `seen` lines)."""
    os.kill(proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [x for x in open(log) if "requests served" in x]
        if len(lines) > seen:
            return ast.literal_eval(re.search(r"requests served: (\{.*?\})", lines[-1]).group(1))
        time.sleep(0.05)
    raise AssertionError(f"the daemon logged no statistics within 30 s (see {log})")


def test_listing_cached_until_the_directory_changes(cluster, fs, tmp_path, rng):
    require_fuse()
    top = "/dircache"
    fs.mkdir(top, exist_ok=True)
    names = {f"f{i:04d}" for i in rng.sample(range(10000), 300)}
    for n in names:
        fs.write_bytes(f"{top}/{n}", b"")
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], log)
    try:
        d = f"{mnt}{top}"

        def listing() -> set:
            got = os.listdir(d)
            assert len(got) == len(set(got)), "a name listed twice"
            return set(got)

        def library() -> set:
            return set(fs.listdir(top))

        assert listing() == names
        before = _counters(proc, log, 0)
        for _ in range(5):
            assert listing() == names
        after = _counters(proc, log, 1)
        assert after.get("readdirs", 0) == before.get("readdirs", 0), (before, after)  # the kernel's cache
        assert after["opendir_keep"] >= 5

        fs.write_bytes(f"{top}/new", b"x")  # another client adds
        names.add("new")
        assert listing() == names == library()
        gone = sorted(names)[0]
        fs.remove(f"{top}/{gone}")  # removes
        names.discard(gone)
        assert listing() == names == library()
        fs.write_bytes("/dircache-outside", b"y")
        fs.rename("/dircache-outside", f"{top}/moved-in")  # renames in
        names.add("moved-in")
        assert listing() == names
        fs.rename(f"{top}/new", "/dircache-out")  # and out
        names.discard("new")
        assert listing() == names == library()
        fs.mkdir(f"{top}/sub")
        names.add("sub")
        assert listing() == names
        with open(f"{d}/through-mount", "w"):  # through this mount
            pass
        names.add("through-mount")
        assert listing() == names == library()
        os.unlink(f"{d}/through-mount")
        names.discard("through-mount")
        assert listing() == names == library()
        dropped = _counters(proc, log, 2)
        assert dropped.get("opendir_drop", 0) >= 5, dropped
    finally:
        stop_daemon(proc, mnt)
    fs.remove_tree(top)
    fs.remove("/dircache-out")


def test_untouched_creates_end_their_sessions_in_batches(cluster, fs, tmp_path):
    """open(O_CREAT|O_WRONLY) + close through the mount: the write session ends in a close_many batch
    (the daemon counts it), and the files are as the library expects at once: empty, removable, renamable,
    writable by another client, and a later write through the mount lands."""
    require_fuse()
    top = "/deferred"
    fs.mkdir(top, exist_ok=True)
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], log)
    try:
        d = f"{mnt}{top}"
        for i in range(40):
            with open(f"{d}/e{i:02d}", "w"):
                pass
        assert sorted(fs.listdir(top)) == [f"e{i:02d}" for i in range(40)]
        assert all(fs.stat(f"{top}/e{i:02d}").length == 0 for i in range(40))
        os.unlink(f"{d}/e00")  # right after its close, through the mount
        fs.remove(f"{top}/e01")  # and through the library
        os.rename(f"{d}/e02", f"{d}/r02")
        fs.write_bytes(f"{top}/e03", b"library")
        with open(f"{d}/e04", "ab") as f:
            f.write(b"mount")
        assert fs.read_bytes(f"{top}/e04") == b"mount"
        with open(f"{d}/e03", "rb") as f:
            assert f.read() == b"library"
        names = set(os.listdir(d))
        assert "e00" not in names and "e01" not in names and "r02" in names and "e02" not in names
        counters = _counters(proc, log, 0)
        assert counters.get("closes_deferred", 0) >= 38, counters
    finally:
        stop_daemon(proc, mnt)
    assert fs.read_bytes(f"{top}/e04") == b"mount"
    fs.remove_tree(top)
