"""Storage benchmark: threefs beside the loopback ceiling and local-disk IO, in one run.

    .venv/bin/python benchmarks/storage.py [--gib 1] [--seconds 5] [--engines v1,v2]

Measures (3 storage services, R=3, 1 MiB chunks):
  * sequential write (file object, 64 MiB calls) and read (batch_read, 4 x 64 MiB per batch), GB/s;
  * random 4 KiB and 64 KiB reads through batch_read (1024 IOs per batch), IOPS;
  * resync speed: a storage process is killed, data is written while it is down, it is restarted, and
    the time until all its targets are SERVING again gives GB/s of catch-up;
baselines in the same run: the loopback TCP stream (transport ceiling) and the same operations on a
local file (sequential write/read, random pread from the page cache). With --engines v1,v2 the cluster
part runs once per chunk engine (a fresh cluster each, same data) and a v2/v1 column is printed. The
machine is shared and noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.throughput import PIECE, loopback_gbps  # noqa: E402
from threefs.cli.cluster import LocalCluster  # noqa: E402
from threefs.client.client import Client  # noqa: E402
from threefs.testing.checks import all_serving, wait_for  # noqa: E402


def local_disk(path: str, total: int, seconds: float) -> dict[str, float]:
    data = os.urandom(PIECE)
    out = {}
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(total // PIECE):
            f.write(data)
    out["seq write GB/s"] = total / (time.perf_counter() - t0) / 1e9
    buf = bytearray(PIECE)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    out["seq read GB/s"] = total / (time.perf_counter() - t0) / 1e9
    rng = random.Random(1)
    fd = os.open(path, os.O_RDONLY)
    try:
        for size in (4096, 65536):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                for _ in range(1024):
                    os.pread(fd, size, rng.randrange(0, total - size))
                n += 1024
            out[f"random {size // 1024} KiB IOPS"] = n / (time.perf_counter() - t0)
    finally:
        os.close(fd)
    return out


def threefs_io(fs: Client, total: int, seconds: float) -> dict[str, float]:
    data = bytearray(os.urandom(PIECE))
    out = {}
    t0 = time.perf_counter()
    with fs.open("/bench/seq", "wb", buffering=0) as f:
        for _ in range(total // PIECE):
            f.write(data)
    out["seq write GB/s"] = total / (time.perf_counter() - t0) / 1e9
    attr = fs.stat("/bench/seq")
    bufs = [bytearray(PIECE) for _ in range(4)]
    t0 = time.perf_counter()
    for base in range(0, total, PIECE * len(bufs)):
        fs.batch_read([(attr, base + i * PIECE, b) for i, b in enumerate(bufs)])
    out["seq read GB/s"] = total / (time.perf_counter() - t0) / 1e9
    rng = random.Random(1)
    for size in (4096, 65536):
        items = [(attr, 0, bytearray(size)) for _ in range(1024)]
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            batch = [(a, rng.randrange(0, total - size), b) for a, _, b in items]
            fs.batch_read(batch)
            n += len(batch)
        out[f"random {size // 1024} KiB IOPS"] = n / (time.perf_counter() - t0)
    return out


def resync_speed(cluster: LocalCluster, fs: Client, nbytes: int) -> tuple[float, float]:
    """(GB/s, seconds): data written while storage-2 was down, caught up after its restart."""
    cluster.kill("storage-2")
    wait_for(lambda: not all_serving(fs), "storage-2's targets to leave SERVING", 60)
    data = bytearray(os.urandom(PIECE))
    with fs.open("/bench/while-down", "wb", buffering=0) as f:
        for _ in range(nbytes // PIECE):
            f.write(data)
    t0 = time.perf_counter()
    cluster.up()
    wait_for(lambda: all_serving(fs), "the restarted targets to return to SERVING", 600, interval=0.05)
    seconds = time.perf_counter() - t0
    return nbytes / seconds / 1e9, seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=4.0, help="duration of each random-read test")
    ap.add_argument("--resync-mib", type=int, default=512)
    ap.add_argument("--engines", default="", help="comma-separated chunk engines to compare (v1,v2); "
                    "default: the storage default only")
    args = ap.parse_args()
    total = int(args.gib * (1 << 30)) // PIECE * PIECE
    engines = [e for e in args.engines.split(",") if e] or [""]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="threefs-bench-") as tmp:
        disk = local_disk(os.path.join(tmp, "local.bin"), total, args.seconds)
        os.unlink(os.path.join(tmp, "local.bin"))
        ceiling = loopback_gbps(total)
        for engine in engines:
            cluster = LocalCluster(os.path.join(tmp, f"cluster-{engine or 'default'}"))
            cluster.up(3, 3, heartbeat_timeout_s=3.0, chunk_engine=engine)
            try:
                with Client.connect(str(cluster.client_config_path)) as fs:
                    fs.mkdir("/bench")
                    ours = threefs_io(fs, total, args.seconds)
                    ours["resync GB/s"], ours["resync s"] = resync_speed(cluster, fs, args.resync_mib << 20)
            finally:
                cluster.down()
            runs[engine or "threefs"] = ours
    loadavg = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"data {total / (1 << 30):.2f} GiB; 3 storage services, R=3, 1 MiB chunks; loopback ceiling "
          f"{ceiling:.2f} GB/s; load average {loadavg}")
    names = list(runs)
    head = "".join(f"{n:>12}" for n in names)
    extra = f"{'v2/v1':>8}" if names == ["v1", "v2"] else ""
    print(f"{'metric':<24}{head} {'local disk':>12} {'vs disk':>8} {'vs ceiling':>10}{extra}")
    for key in runs[names[-1]]:
        if key.startswith("resync"):
            continue
        value = runs[names[-1]][key]
        ratio_ceiling = f"{value / ceiling:9.2f}x" if "GB/s" in key else ""
        cols = "".join(f"{runs[n][key]:12.2f}" for n in names)
        tail = f"{runs['v2'][key] / runs['v1'][key]:7.2f}x" if extra else ""
        print(f"{key:<24}{cols} {disk[key]:12.2f} {value / disk[key]:7.2f}x {ratio_ceiling:>10}{tail}")
    for n in names:
        print(f"[{n}] resync of {args.resync_mib} MiB written while a storage service was down: "
              f"{runs[n]['resync s']:.2f} s from restart to SERVING = {runs[n]['resync GB/s']:.2f} GB/s")


if __name__ == "__main__":
    main()
