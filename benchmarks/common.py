"""Set-up shared by the benchmarks that need a local cluster and, optionally, its FUSE mount."""

from __future__ import annotations

import contextlib
import os

from threefs.cli.cluster import LocalCluster
from threefs.client import fuse_mount


@contextlib.contextmanager
def local_cluster(tmp: str, storage: int, replicas: int, fuse: bool, mount_args: list[str] | None = None):
    """A cluster in tmp/cluster and, when `fuse` and FUSE works here, its mount at tmp/mnt (with the
    `threefs mount` options mount_args). Yields (cluster, mount point or None); unmounts and stops the
    cluster afterwards."""
    cluster = LocalCluster(os.path.join(tmp, "cluster"))
    mnt, proc = None, None
    try:
        cluster.up(storage, replicas)
        if fuse and fuse_mount.fuse_unavailable_reason() is None:
            mnt = os.path.join(tmp, "mnt")
            proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, list(mount_args or []),
                                    os.path.join(tmp, "fuse.log"))
        elif fuse:
            print(f"FUSE rows skipped: {fuse_mount.fuse_unavailable_reason()}")
        yield cluster, mnt
    finally:
        if mnt:
            fuse_mount.stop(proc, mnt)
        cluster.down()


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
