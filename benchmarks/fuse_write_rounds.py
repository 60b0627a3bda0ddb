"""dd writes through the FUSE mount round after round on one cluster: what each round costs, and why later rounds slow.

    .venv/bin/python benchmarks/fuse_write_rounds.py [--mib 256] [--rounds 4] [--gc-delay 60]
                                                     [--keep] [--sync] [--local]

One local cluster (3 storage services, R=3) and its mount. Each round writes a new `--mib` MiB file with
`dd bs=1M conv=fdatasync` (as benchmarks/mount_battery.py's write row does), then removes it, and prints
MB/s, the CPU seconds (utime + stime from /proc) of each storage service and of the FUSE daemon, and the
bytes this machine's disks wrote meanwhile (/proc/diskstats; storage keeps data in the page cache and
relies on replication, so fdatasync sends nothing to disk by itself). A removed file's chunks are freed
`--gc-delay` seconds after the unlink (meta_gc_delay_s; 60 is the default): until then the next file's
chunks take new blocks of the storage data files, i.e. page-cache pages that did not exist. Run it with
`--gc-delay 0` beside the default to see what reusing freed blocks (pages still cached) changes. `--keep`
keeps every round's file; `--sync` runs sync(1) after each round (untimed), so that no writeback of
earlier rounds runs during a round: what is left is the cost of the new page-cache pages themselves.
`--local` adds the reference, in the same run: after each round, plain dd writes three times `--mib` MiB
of new files (what the three replicas add to the page cache) into a local directory without fdatasync,
timed (with `--sync`, sync(1) after them, untimed); they are kept to the end, so the page cache grows by
them too: run it with `--keep --sync` to see plain dd slow down round after round as threefs does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import process_cpu_s  # noqa: E402
from threefs.cli.cluster import LocalCluster  # noqa: E402
from threefs.client import fuse_mount  # noqa: E402

MiB = 1 << 20


def disk_written() -> int:
    """Bytes written by this machine's whole disks so far (partitions and virtual devices left out)."""
    total = 0
    for line in open("/proc/diskstats"):
        f = line.split()
        name = f[2]
        if os.path.exists(f"/sys/block/{name}/device"):
            total += int(f[9]) * 512
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--gc-delay", type=float, default=60.0, help="meta_gc_delay_s of the cluster")
    ap.add_argument("--keep", action="store_true", help="keep each round's file (default: remove it)")
    ap.add_argument("--sync", action="store_true", help="sync(1) after each round, outside the timing")
    ap.add_argument("--local", action="store_true", help="plain dd of as many new local bytes after each round")
    args = ap.parse_args()
    if fuse_mount.fuse_unavailable_reason() is not None:
        raise SystemExit(f"FUSE unavailable: {fuse_mount.fuse_unavailable_reason()}")
    with tempfile.TemporaryDirectory(prefix="threefs-write-rounds-", dir=os.environ.get("TMPDIR")) as tmp:
        src = os.path.join(tmp, "src.bin")
        with open(src, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(MiB))
        cluster = LocalCluster(os.path.join(tmp, "cluster"))
        mnt, proc = os.path.join(tmp, "mnt"), None
        try:
            cluster.up(3, 3, meta_gc_delay_s=args.gc_delay)
            proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], os.path.join(tmp, "fuse.log"))
            pids = {name: pid for name, pid in cluster.running().items() if name.startswith("storage")}
            pids["fuse daemon"] = proc.pid
            print(f"{args.mib} MiB per round, 3 storage services, R=3, meta_gc_delay_s={args.gc_delay:g}"
                  f"{', files kept' if args.keep else ''}{', sync after each round' if args.sync else ''}")
            for r in range(args.rounds):
                target = os.path.join(mnt, f"round{r}.bin")
                c0, d0, t0 = {k: process_cpu_s(p) for k, p in pids.items()}, disk_written(), time.perf_counter()
                subprocess.run(["dd", f"if={src}", f"of={target}", "bs=1M", f"count={args.mib}", "conv=fdatasync",
                                "status=none"], check=True)
                wall = time.perf_counter() - t0
                c1, d1 = {k: process_cpu_s(p) for k, p in pids.items()}, disk_written()
                cpu = "  ".join(f"{k} {c1[k] - c0[k]:.2f}" for k in pids)
                print(f"round {r + 1}: {args.mib * MiB / wall / 1e6:6.0f} MB/s  {wall:5.2f} s  disks wrote "
                      f"{(d1 - d0) / MiB:5.0f} MiB  CPU s: {cpu}", flush=True)
                if not args.keep:
                    os.unlink(target)
                if args.local:
                    t0, lc0 = time.perf_counter(), os.times()
                    for k in range(3):
                        subprocess.run(["dd", f"if={src}", f"of={os.path.join(tmp, f'local{r}.{k}.bin')}", "bs=1M",
                                        f"count={args.mib}", "status=none"], check=True)
                    wall, lc1 = time.perf_counter() - t0, os.times()
                    print(f"         plain dd, 3 x {args.mib} MiB of new local files: "
                          f"{3 * args.mib * MiB / wall / 1e6:6.0f} MB/s  system CPU "
                          f"{lc1.children_system - lc0.children_system:.2f} s", flush=True)
                if args.sync:
                    subprocess.run(["sync"], check=True)
                time.sleep(1)
        finally:
            if proc is not None:
                fuse_mount.stop(proc, mnt)
            cluster.down()
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
