"""Who may use a mount. `threefs mount` (and `threefs up`) run by root let other users in by default, the
kernel checking their permissions as on any file system root mounts; `--no-allow-other` keeps everyone
but the mounting user out, whatever the modes say. pjdfstest, run as root, does a third of its checks as
uid 65534 and failed them all on a mount made with the defaults (EACCES at every lookup: 3,214 of its
8,850 tests) while ext4 passed them. Also: a write by another user clears set-uid/set-gid on a
--direct-io mount as through the page cache (pjdfstest chmod/12.t)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess

import pytest

AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def mount_with(extra_mount):
    if os.geteuid() != 0:
        pytest.skip("needs root: the default under test is the one root gets")
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is not installed")
    return extra_mount


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


def test_a_write_by_another_user_clears_set_id_bits_with_direct_io(mount_with):
    """Through the page cache the kernel clears them (a setattr before the write); with --direct-io it
    leaves it to the file system, and the daemon did not: chmod/12.t failed 6 of 14 on such a mount."""
    mnt = mount_with(["--direct-io"])
    top = f"{mnt}/others-direct-io"
    os.mkdir(top)
    for name, mode, after in (("suid", 0o4777, 0o777), ("sgid", 0o2777, 0o777), ("both", 0o6777, 0o777),
                              ("sgid-noexec", 0o2767, 0o2767)):  # set-gid without group x: kept
        path = f"{top}/{name}"
        with open(path, "w"):
            pass
        os.chmod(path, mode)
        r = as_nobody(f"printf x >> {path} && stat -c %a {path}")
        assert r.returncode == 0, r.stderr
        assert int(r.stdout, 8) == after, name
        assert stat.S_IMODE(os.stat(path).st_mode) == after, name
        with open(path, "a") as f:  # root (CAP_FSETID) keeps them
            os.chmod(path, mode)
            f.write("y")
        assert stat.S_IMODE(os.stat(path).st_mode) == mode, name


def test_a_written_file_loses_its_capability_even_after_cached_answers(mdir, fs):
    """The kernel asks for security.capability before each write(2) (and removes it when there is one): the
    daemon answers "none" itself for a file it created or that meta said has none, and stops doing so once
    a capability is set through it. A file with one set loses it at the next write, as on a local disk."""
    import struct

    path, fspath = mdir
    caps = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)  # VFS_CAP_REVISION_2, effective: net_bind_service
    with open(f"{path}/f", "wb") as f:  # created here: known to have none
        for _ in range(5):
            f.write(b"x" * 1000)
            f.flush()
    with pytest.raises(OSError) as e:
        os.getxattr(f"{path}/f", "security.capability")
    assert e.value.errno == errno.ENODATA
    os.setxattr(f"{path}/f", "security.capability", caps)
    assert os.getxattr(f"{path}/f", "security.capability") == caps
    assert _meta_xattr(fs, "get", f"{fspath}/f", "security.capability").value == caps
    with open(f"{path}/f", "r+b") as f:
        f.write(b"y")
        f.flush()
    with pytest.raises(OSError) as e:
        os.getxattr(f"{path}/f", "security.capability")
    assert e.value.errno == errno.ENODATA
    assert _meta_xattr(fs, "list", f"{fspath}/f").names == []  # meta's own record, not a cached answer
    assert open(f"{path}/f", "rb").read() == b"y" + b"x" * 4999


def _meta_xattr(fs, op: str, path: str, name: str = ""):
    from threefs.rpc.schemas import meta as m

    return fs.run(fs.aio.meta_call("xattr", m.XattrReq(op, path, name), m.XattrRsp))
