"""FUSE read-around (client/fuse_store.py) against the same mount without it, in one run: what it gains
when a file is read again and what it costs when nothing is.

    .venv/bin/python benchmarks/fuse_read_around.py [--mib 256] [--seconds 4] [--rounds 2]

One cluster (3 storage services, R=3), mounted three times: `--read-around-kb 0` (the reference: every
buffered miss reads just its pages), `--read-around-region-kb 0` (64 KiB windows only) and the default
(64 KiB windows, a whole 1 MiB region at a second miss in it). Rounds interleave the three. Before each
workload the file's pages are dropped (posix_fadvise DONTNEED, as fio's invalidate=1).

- one per region: one 4 KiB read in each 1 MiB of the file, in shuffled order: every read is the first
  of its window and of its region, nothing is read again, so read-around can only cost here (reads/s,
  and the daemon's CPU per read). The daemon remembers the regions that missed until the kernel forgets
  the inode, so from the second round on the default mount reads whole regions here (the file was read
  densely in the first round): the first round's figure is the sparse reader's;
- misses only: one 4 KiB read in each 128 KiB of the file, in shuffled order, so that every read is the
  first of its window (eight per region);
- re-reads: 4 threads of random 4 KiB preads over the whole file for --seconds (fio psync x4 as in
  benchmarks/mount_battery.py): IO/s, and the daemon's CPU per read that reached it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.fuse_profile import cpu_s  # noqa: E402
from benchmarks.mount_battery import drop_client_cache as drop  # noqa: E402
from threefs.cli.cluster import LocalCluster  # noqa: E402
from threefs.client import fuse_mount  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SPACING = 128 * KiB
THREADS = 4


def misses_only(path: str, size: int, seed: int, spacing: int = SPACING) -> tuple[float, int]:
    rng = random.Random(seed)
    offsets = [w * spacing + rng.randrange(spacing // 4096) * 4096 for w in range(size // spacing)]
    rng.shuffle(offsets)
    drop(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        for off in offsets:
            os.pread(fd, 4096, off)
        return time.perf_counter() - t0, len(offsets)
    finally:
        os.close(fd)


def re_reads(path: str, size: int, seconds: float, seed: int) -> tuple[float, int]:
    drop(path)
    counts = [0] * THREADS
    stop = time.perf_counter() + seconds

    def worker(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        pages = size // 4096
        fd = os.open(path, os.O_RDONLY)
        try:
            n = 0
            while time.perf_counter() < stop:
                for _ in range(64):
                    os.pread(fd, 4096, rng.randrange(pages) * 4096)
                n += 64
            counts[k] = n
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(counts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    size = args.mib * MiB
    print("load average before:", open("/proc/loadavg").read().strip())
    variants = [("off", ["--read-around-kb", "0"]), ("windows", ["--read-around-region-kb", "0"]), ("on", [])]
    workloads = ("one per region", "misses only", "re-reads")
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="threefs-read-around-", dir=os.environ.get("TMPDIR")) as tmp:
        cluster = LocalCluster(os.path.join(tmp, "cluster"))
        mounts = []
        try:
            cluster.up(3, 3)
            for label, extra in variants:
                mnt = os.path.join(tmp, f"mnt-{label}")
                proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, extra,
                                        os.path.join(tmp, f"fuse-{label}.log"))
                mounts.append((label, mnt, proc))
            with open(os.path.join(mounts[0][1], "data.bin"), "wb") as f:
                for _ in range(args.mib):
                    f.write(os.urandom(MiB))
            for r in range(args.rounds):
                for label, mnt, proc in mounts:
                    path = os.path.join(mnt, "data.bin")
                    for name, run in (("one per region", lambda: misses_only(path, size, r, MiB)),
                                      ("misses only", lambda: misses_only(path, size, r)),
                                      ("re-reads", lambda: re_reads(path, size, args.seconds, r))):
                        c0 = cpu_s(proc.pid)
                        dt, n = run()
                        daemon_us = (cpu_s(proc.pid) - c0) / n * 1e6
                        rows.setdefault((name, label), []).append((n / dt, daemon_us))
                        print(f"round {r + 1} {label:7s} {name:14s}: {n / dt:10,.0f} reads/s, daemon "
                              f"{daemon_us:6.1f} us CPU per read", flush=True)
        finally:
            for _, mnt, proc in mounts:
                fuse_mount.stop(proc, mnt)
            cluster.down()
    print(f"\n{args.mib} MiB file, median of {args.rounds} rounds; load average after:",
          open("/proc/loadavg").read().strip())
    labels = [label for label, _ in variants]
    print(f"{'workload':15s}" + "".join(f" {label + ' reads/s':>16s}" for label in labels)
          + "".join(f" {label + ' / off':>14s}" for label in labels[1:])
          + "".join(f" {'daemon us ' + label:>18s}" for label in labels))
    for name in workloads:
        rate = {label: statistics.median(x[0] for x in rows[(name, label)]) for label in labels}
        cpu = {label: statistics.median(x[1] for x in rows[(name, label)]) for label in labels}
        print(f"{name:15s}" + "".join(f" {rate[label]:16,.0f}" for label in labels)
              + "".join(f" {rate[label] / rate['off']:13.2f}x" for label in labels[1:])
              + "".join(f" {cpu[label]:18.1f}" for label in labels))
    print("(one per region: the rounds after the first read whole regions on the default mount; see the "
          "module docstring)")


if __name__ == "__main__":
    main()
