"""What other open files cost a read through the mount: 4 KiB O_DIRECT preads at queue depth 1 of one file,
with no other file open on the mount and with `--open` other files open (held by this process), in one
run, rounds interleaved. The reference is the same mount with nothing else open: the ratio should be 1.

    .venv/bin/python benchmarks/fuse_many_open.py [--open 2000] [--seconds 2] [--rounds 3]

Why it exists: the daemon went through all its open handles (twice) for every read, to find the file's
own (a length written but not yet published, writes to drain first); with 2000 other files open that was
~100-160 us of daemon CPU more per read (2,742-3,322 reads/s against 4,523-5,310, session 23). The
daemon now keeps its handles per file (client/fuse.py `_ino_handles`). Prints reads/s and the daemon's
CPU per read (from /proc) for both, and their ratio.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.fuse_profile import cpu_s  # noqa: E402
from threefs.cli.cluster import LocalCluster  # noqa: E402
from threefs.client import fuse_mount  # noqa: E402

MiB = 1 << 20
FILE_BYTES = 64 * MiB


def reads(path: str, seconds: float, seed: int, daemon_pid: int) -> tuple[float, float]:
    """(reads/s, daemon CPU us per read) of random 4 KiB O_DIRECT preads of `path` for `seconds`."""
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
    rng = random.Random(seed)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n, c0, t0 = 0, cpu_s(daemon_pid), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            os.preadv(fd, [buf], rng.randrange(FILE_BYTES // 4096) * 4096)
            n += 1
        dt, cpu = time.perf_counter() - t0, cpu_s(daemon_pid) - c0
    finally:
        os.close(fd)
    return n / dt, cpu / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--open", type=int, default=2000, help="other files held open (default 2000)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print("load average before:", open("/proc/loadavg").read().strip())
    rows: dict[int, list[tuple[float, float]]] = {0: [], args.open: []}
    with tempfile.TemporaryDirectory(prefix="threefs-many-open-", dir=os.environ.get("TMPDIR")) as tmp:
        cluster = LocalCluster(os.path.join(tmp, "cluster"))
        mnt, proc = os.path.join(tmp, "mnt"), None
        try:
            cluster.up(3, 3)
            proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], os.path.join(tmp, "fuse.log"))
            with open(os.path.join(mnt, "data.bin"), "wb") as f:
                for _ in range(FILE_BYTES // MiB):
                    f.write(os.urandom(MiB))
            os.mkdir(os.path.join(mnt, "others"))
            others = [os.path.join(mnt, "others", f"f{i}") for i in range(args.open)]
            for p in others:
                open(p, "w").close()
            for r in range(args.rounds):
                for held in (0, args.open) if r % 2 == 0 else (args.open, 0):
                    fds = [os.open(p, os.O_RDONLY) for p in others[:held]]
                    try:
                        rate, cpu = reads(os.path.join(mnt, "data.bin"), args.seconds, r, proc.pid)
                    finally:
                        for fd in fds:
                            os.close(fd)
                    rows[held].append((rate, cpu))
                    print(f"round {r + 1}: {held:5d} other files open: {rate:8,.0f} reads/s, daemon "
                          f"{cpu:6.1f} us CPU per read", flush=True)
        finally:
            if proc is not None:
                fuse_mount.stop(proc, mnt)
            cluster.down()
    base = statistics.median(x[0] for x in rows[0])
    held = statistics.median(x[0] for x in rows[args.open])
    print(f"\nmedian of {args.rounds} rounds; load average after: {open('/proc/loadavg').read().strip()}")
    print(f"no other file open      {base:10,.0f} reads/s, daemon "
          f"{statistics.median(x[1] for x in rows[0]):6.1f} us CPU per read")
    print(f"{args.open:5d} other files open {held:10,.0f} reads/s, daemon "
          f"{statistics.median(x[1] for x in rows[args.open]):6.1f} us CPU per read")
    print(f"ratio (should be ~1: a read looks at its own file's handles only): {held / base:.2f}")


if __name__ == "__main__":
    main()
