"""A real FUSE mount of the shared cluster (pyfuse3 daemon in its own process).

Skips with the reason when FUSE cannot work here (no /dev/fuse, no fusermount3, pyfuse3 not built);
scripts/setup-system.sh and scripts/setup-venv.sh install what it needs.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from fuse_helpers import require_fuse, stop_daemon

from threefs.client import fuse_mount


@pytest.fixture(scope="session")
def mount(cluster, tmp_path_factory):
    """(mount point, daemon process) of the shared cluster, for the whole session."""
    require_fuse()
    # not under pytest's 0700 temp dirs: tests run tools as another user through the mount
    top = tempfile.mkdtemp(prefix="threefs-fuse-")
    os.chmod(top, 0o755)
    mnt = os.path.join(top, "mnt")
    log = str(tmp_path_factory.getbasetemp() / "fuse-daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, ["--allow-other"], log)
    yield mnt, proc
    stop_daemon(proc, mnt)
    shutil.rmtree(top)


@pytest.fixture
def mdir(mount, fs, request):
    """A directory of this test's own: (path inside the mount, threefs path)."""
    mnt, _ = mount
    name = "fuse-" + request.node.name.replace("[", "_").replace("]", "")
    fs.mkdir(f"/{name}")
    return os.path.join(mnt, name), f"/{name}"


@pytest.fixture
def extra_mount(cluster, tmp_path_factory):
    """extra_mount(args) -> a new mount point of the shared cluster, made by `threefs mount args`
    (`threefs mount --foreground`, as `threefs mount` spawns it); unmounted at the end of the test."""
    require_fuse()
    top = tempfile.mkdtemp(prefix="threefs-extra-")
    os.chmod(top, 0o755)
    log = str(tmp_path_factory.getbasetemp() / "fuse-extra.log")
    procs = []

    def mount(args: list[str]) -> str:
        mnt = os.path.join(top, f"mnt{len(procs)}")
        procs.append((fuse_mount.spawn(str(cluster.client_config_path), mnt, args, log), mnt))
        return mnt

    yield mount
    for proc, mnt in procs:
        stop_daemon(proc, mnt)
    shutil.rmtree(top)
