"""Many kernel requests in flight: fio with libaio, io_depth 32 and O_DIRECT keeps more requests in the
daemon at once than the kernel's default limit of background requests (12: the INIT hook raises it),
and the daemon sends concurrent reads to storage in shared batches (fewer gate openings than reads).
What the daemon saw is read from the statistics line it logs at unmount; the bytes fio read are
checked with its own verification against what was written through the library."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess

import pytest
from fuse_helpers import require_fuse, stop_daemon

from threefs.client import fuse_mount

KERNEL_DEFAULT_MAX_BACKGROUND = 12


def test_qd32_direct_reads_stay_in_flight_and_share_storage_batches(cluster, fs, tmp_path, rng):
    require_fuse()
    if shutil.which("fio") is None:
        pytest.skip("fio is not installed (scripts/setup-system.sh installs it)")
    data = rng.randbytes(16 << 20)
    fs.mkdir("/qd32", exist_ok=True)
    fs.write_bytes("/qd32/f", data)
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    # no daemon read-ahead: random reads close to each other would otherwise be served from prefetched
    # segments, and here every read is to reach storage
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, ["--prefetch-mb", "0"], log)
    try:
        r = subprocess.run(["fio", "--name=q", f"--filename={mnt}/qd32/f", "--rw=randread", "--bs=4k",
                            "--ioengine=libaio", "--iodepth=32", "--direct=1", f"--size={len(data)}",
                            "--number_ios=3000", "--output-format=terse"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        with open(f"{mnt}/qd32/f", "rb") as f:  # and the bytes through the mount are the written ones
            f.seek(5 << 20)
            assert f.read(1 << 20) == data[5 << 20:6 << 20]
    finally:
        stop_daemon(proc, mnt)
    line = next(x for x in open(log) if "requests served" in x)
    stats = ast.literal_eval(re.search(r"requests served: (\{.*?\})", line).group(1))
    held, openings = map(int, re.search(r"gate: (\d+) reads in (\d+) openings", line).groups())
    assert stats["reads"] >= 3000
    assert stats["reads_inflight_max"] > KERNEL_DEFAULT_MAX_BACKGROUND, line
    assert held >= 3000 and openings < held, line
    fs.remove("/qd32/f")
