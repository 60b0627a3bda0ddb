"""The daemon's stream IO unit (`--segment-mb`: read-ahead and write-behind read and write whole chunks in
segments of at least that size) and its statistics on SIGUSR1.

Bytes read through mounts with 1 MiB and 4 MiB segments (sequentially with dd, and in pieces that cross
segment and chunk boundaries) are the bytes the library wrote; bytes written through the mount in odd
pieces are what the library reads back; the IO unit is whole chunks for every chunk size."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
from fuse_helpers import require_fuse, stop_daemon

from threefs.client import fuse_mount
from threefs.client.fuse import MountOptions, ThreeFSOperations

MiB = 1 << 20


@pytest.mark.parametrize("chunk,want,expect", [
    (MiB, 4 * MiB, 4 * MiB), (512 << 10, 4 * MiB, 4 * MiB), (3 * MiB, 4 * MiB, 3 * MiB),
    (8 * MiB, 4 * MiB, 8 * MiB), (16 * MiB, 4 * MiB, 8 * MiB), (MiB, 0, MiB), (MiB, 64 * MiB, 8 * MiB),
    (64 << 10, MiB, MiB), (3 * MiB, 8 * MiB, 6 * MiB)])
def test_segment_is_whole_chunks(chunk, want, expect):
    ops = ThreeFSOperations.__new__(ThreeFSOperations)
    ops.options = MountOptions(segment_bytes=want)
    seg = ops._segment(chunk)
    assert seg == expect and (seg % chunk == 0 or seg == 8 * MiB)


@pytest.mark.parametrize("segment_mb", [1, 4])
def test_reads_and_writes_across_segments(cluster, fs, tmp_path, rng, segment_mb):
    require_fuse()
    top = f"/segments-{segment_mb}"
    fs.mkdir(top, exist_ok=True)
    data = rng.randbytes(13 * MiB + 12345)
    fs.write_bytes(f"{top}/r", data)
    mnt, log = str(tmp_path / "m"), str(tmp_path / "daemon.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, ["--segment-mb", str(segment_mb)], log)
    try:
        path = f"{mnt}{top}/r"
        out = subprocess.run(["dd", f"if={path}", "bs=1M", "status=none"], capture_output=True, timeout=120)
        assert out.returncode == 0 and out.stdout == data
        with open(path, "rb", buffering=0) as f:  # pieces crossing 1 MiB chunks and 4 MiB segments
            pos = 0
            for size in [3 * MiB + 7, 1, 5 * MiB - 3, 777, 2 * MiB, 4 * MiB]:
                f.seek(pos)
                assert f.read(size) == data[pos:pos + size], (pos, size)
                pos += size
            f.seek(len(data) - 100)
            assert f.read(1000) == data[-100:]
        written = rng.randbytes(9 * MiB + 4321)
        with open(f"{mnt}{top}/w", "wb") as f:
            pos = 0
            for size in [100, 4 * MiB - 100, 3, 2 * MiB, 3 * MiB + 4218, len(written)]:
                f.write(written[pos:pos + size])
                pos = min(len(written), pos + size)
        assert fs.read_bytes(f"{top}/w") == written
        os.kill(proc.pid, signal.SIGUSR1)  # the counters so far, while mounted
        deadline = time.monotonic() + 30
        while not any("requests served" in x for x in open(log)) and time.monotonic() < deadline:
            time.sleep(0.1)
        line = next(x for x in open(log) if "requests served" in x)
        assert int(re.search(r"'read_bytes': (\d+)", line).group(1)) >= len(data)
        assert int(re.search(r"'write_bytes': (\d+)", line).group(1)) == len(written)
    finally:
        stop_daemon(proc, mnt)
    fs.remove(f"{top}/r")
    fs.remove(f"{top}/w")
