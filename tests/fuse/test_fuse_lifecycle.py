"""Mount life cycle: SIGTERM/SIGINT unmount cleanly, a killed daemon's mount is cleaned up by
`threefs umount` (and by the next mount), `threefs up`/`down` mount and unmount, direct IO mode."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from fuse_helpers import require_fuse, stop_daemon

from threefs.cli.main import main
from threefs.client import fuse_mount


def wait_for(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture
def spawn(cluster, tmp_path):
    """Start extra daemons; whatever a test leaves mounted or running is cleaned up."""
    require_fuse()
    started = []

    def start(name: str = "m", *args: str):
        mnt = str(tmp_path / name)
        proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, list(args), str(tmp_path / "log"))
        started.append((proc, mnt))
        return mnt, proc

    yield start
    for proc, mnt in started:
        if proc.poll() is None or fuse_mount.mount_entry(mnt) is not None:
            stop_daemon(proc, mnt)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_unmounts_cleanly(spawn, fs, sig):
    mnt, proc = spawn()
    with open(os.path.join(mnt, f"written-before-{sig.name}"), "wb") as f:
        f.write(b"x" * 100_000)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 0
    assert fuse_mount.mount_entry(mnt) is None
    assert fs.stat(f"/written-before-{sig.name}").length == 100_000


def test_signal_with_a_file_open_still_unmounts(spawn, fs):
    mnt, proc = spawn()
    f = open(os.path.join(mnt, "held-open"), "wb")
    try:
        f.write(b"y" * 5000)
        f.flush()  # in the daemon now; its session is still open
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert wait_for(lambda: fuse_mount.mount_entry(mnt) is None)
    finally:
        try:
            f.close()
        except OSError:
            pass  # the mount is gone: closing reports it
    assert fs.stat("/held-open").length == 5000  # the daemon ended the session at unmount


def test_killed_daemon_is_cleaned_up_by_umount_and_by_mount(spawn, cluster, capsys):
    mnt, proc = spawn("k")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert fuse_mount.mount_entry(mnt) is not None  # left behind, as the kernel does
    with pytest.raises(OSError):
        os.listdir(mnt)  # ENOTCONN
    assert main(["umount", mnt]) == 0
    assert fuse_mount.mount_entry(mnt) is None
    assert main(["umount", mnt]) == 1  # nothing mounted any more: says so
    assert "nothing is mounted" in capsys.readouterr().err
    mnt2, proc2 = spawn("k")  # a dead leftover is removed by the next mount
    proc2.send_signal(signal.SIGKILL)
    proc2.wait(timeout=30)
    mnt3, proc3 = spawn("k")
    assert os.listdir(mnt3) is not None and proc3.poll() is None


def test_direct_io_mount(spawn, rng):
    mnt, _ = spawn("direct", "--direct-io")
    data = rng.randbytes(3 * (1 << 20) + 99)
    with open(os.path.join(mnt, "direct.bin"), "wb") as f:
        f.write(data)
    with open(os.path.join(mnt, "direct.bin"), "rb") as f:
        assert f.read() == data


def test_mount_refuses_a_busy_mount_point(spawn, cluster):
    mnt, _ = spawn("busy")
    with pytest.raises(Exception) as e:
        fuse_mount.spawn(str(cluster.client_config_path), mnt, [])
    assert "already mounted" in str(e.value)


def test_up_and_down_mount_and_unmount(cluster, tmp_path, capsys):
    require_fuse()
    from threefs.cli.mount_cmd import mount_for_cluster, unmount_for_cluster

    mnt = str(tmp_path / "upmnt")
    try:
        msg = mount_for_cluster(cluster, mnt, [])
        assert msg.startswith("FUSE: mounted at") and fuse_mount.is_threefs_mount(mnt)
        assert mount_for_cluster(cluster, mnt, []).startswith("FUSE: already mounted")
        assert unmount_for_cluster(cluster) == mnt
        assert fuse_mount.mount_entry(mnt) is None
    finally:
        if fuse_mount.mount_entry(mnt) is not None:
            subprocess.run(["fusermount3", "-u", "-z", mnt])
