"""Who may use a mount. `threefs mount` (and `threefs up`) run by root let other users in by default, the
kernel checking their permissions as on any file system root mounts; `--no-allow-other` keeps everyone
but the mounting user out, whatever the modes say. pjdfstest, run as root, does a third of its checks as
uid 65534 and failed them all on a mount made with the defaults (EACCES at every lookup) while ext4
passed them."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
from fuse_helpers import require_fuse, stop_daemon

from threefs.client import fuse_mount

AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def mount_with(cluster, tmp_path_factory):
    """mount_with(args) -> a new mount point of the shared cluster, made by `threefs mount args`."""
    require_fuse()
    if os.geteuid() != 0:
        pytest.skip("needs root: the default under test is the one root gets")
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is not installed")
    top = tempfile.mkdtemp(prefix="threefs-others-")
    os.chmod(top, 0o755)
    log = str(tmp_path_factory.getbasetemp() / "fuse-others.log")
    procs = []

    def mount(args: list[str]) -> str:
        mnt = os.path.join(top, f"mnt{len(procs)}")
        procs.append((fuse_mount.spawn(str(cluster.client_config_path), mnt, args, log), mnt))
        return mnt

    yield mount
    for proc, mnt in procs:
        stop_daemon(proc, mnt)
    shutil.rmtree(top)


def mount_options(mnt: str) -> set[str]:
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[1] == mnt:
                return set(fields[3].split(","))
    raise AssertionError(f"{mnt} is not mounted")


def as_nobody(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(AS_NOBODY + ["sh", "-c", cmd], capture_output=True, text=True, timeout=60)


def test_a_root_mount_lets_other_users_in_by_their_permissions(mount_with):
    mnt = mount_with([])
    assert "allow_other" in mount_options(mnt)
    top = f"{mnt}/others-default"
    os.mkdir(top)
    os.mkdir(f"{top}/open")
    os.chmod(f"{top}/open", 0o777)
    os.mkdir(f"{top}/closed", 0o755)
    r = as_nobody(f"echo theirs > {top}/open/f && cat {top}/open/f && ls {top}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["theirs", "closed", "open"]
    st = os.stat(f"{top}/open/f")
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    r = as_nobody(f"touch {top}/closed/f")  # the modes still hold
    assert r.returncode and "Permission denied" in r.stderr
    assert not os.path.exists(f"{top}/closed/f")


def test_no_allow_other_keeps_other_users_out(mount_with):
    mnt = mount_with(["--no-allow-other"])
    assert "allow_other" not in mount_options(mnt)
    os.mkdir(f"{mnt}/others-refused")
    os.chmod(f"{mnt}/others-refused", 0o777)
    r = as_nobody(f"ls {mnt}/others-refused")
    assert r.returncode and "Permission denied" in r.stderr
    assert os.listdir(f"{mnt}/others-refused") == []  # root, who mounted, still gets in
