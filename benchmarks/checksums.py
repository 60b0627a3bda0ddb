"""CRC32C implementations side by side: alone, and on threefs's read path, in one run.

    .venv/bin/python benchmarks/checksums.py [--rounds 3] [--seconds 4] [--no-e2e]

Alone: the two implementations threefs.common.crc32c can use (awscrt's aws-checksums and ICRAR's crc32c),
the same buffers in one process, min of 5 passes, per size: µs per call and GB/s, and awscrt / crc32c.
On the read path: a fresh local cluster (3 storage services, R=3, 1 MiB chunks, 256 MiB file) per round and
implementation, every process of it (servers and the reading client) started with THREEFS_CRC32C set to
that implementation, rounds alternating between the two: sequential batch_read (256 x 1 MiB per batch) and
random 64 KiB batch_read (4,096 per batch) for --seconds each; GB/s or IO/s, and the CPU of the client
process and of the three storage services (utime + stime from /proc) per MiB or per IO. Medians per
implementation and the ratio awscrt / crc32c. The machine is shared: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MiB = 1 << 20
IMPLEMENTATIONS = ("crc32c", "awscrt")


def alone() -> None:
    import crc32c as icrar
    from awscrt import checksums

    print("alone (min of 5 passes)        crc32c            awscrt      awscrt/crc32c time")
    for size in (64, 1024, 4096, 65536, MiB, 4 * MiB):
        view = memoryview(bytearray(random.Random(size).randbytes(size)))
        assert icrar.crc32c(view) == checksums.crc32c(view)
        reps = max(2000, (128 * MiB) // size)
        best = {}
        for name, fn in (("crc32c", icrar.crc32c), ("awscrt", checksums.crc32c)):
            best[name] = min(_time_calls(fn, view, reps) for _ in range(5))
        a, b = best["crc32c"], best["awscrt"]
        print(f"{size:>10} B   {a * 1e6:8.3f} us {size / a / 1e9:5.1f} GB/s   {b * 1e6:8.3f} us "
              f"{size / b / 1e9:5.1f} GB/s   {b / a:5.2f}x")


def _time_calls(fn, view, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(view)
    return (time.perf_counter() - t0) / reps


def child(seconds: float) -> None:
    """One round on a fresh cluster, in a process whose THREEFS_CRC32C the parent set; prints JSON."""
    from benchmarks.common import local_cluster, process_cpu_s
    from threefs.client.client import Client
    from threefs.common import crc32c

    total = 256 * MiB
    out = {"implementation": crc32c.IMPLEMENTATION}
    with tempfile.TemporaryDirectory(prefix="threefs-crc32c-", dir=os.environ.get("TMPDIR")) as tmp:
        with local_cluster(tmp, 3, 3, fuse=False) as (cluster, _):
            storage = [pid for name, pid in cluster.running().items() if name.startswith("storage")]
            with Client.connect(str(cluster.client_config_path)) as fs:
                with fs.open("/f", "wb") as f:
                    data = memoryview(os.urandom(64 * MiB))
                    for _ in range(total // len(data)):
                        f.write(data)
                attr = fs.stat("/f")
                arena = memoryview(bytearray(total))
                arena[:] = b"\1" * total  # (the pages touched before the timed reads)
                seq = [(attr, o, arena[o:o + MiB]) for o in range(0, total, MiB)]
                rng = random.Random(7)
                size = 65536
                rand = [(attr, rng.randrange(total // size) * size, arena[k * size:(k + 1) * size])
                        for k in range(4096)]
                for name, items, unit in (("seq", seq, MiB), ("rand64k", rand, size)):
                    fs.batch_read(items)  # (warm: the chunks in storage's page cache, connections up)
                    s0, c0, n, t0 = sum(map(process_cpu_s, storage)), time.process_time(), 0, time.perf_counter()
                    while time.perf_counter() - t0 < seconds:
                        fs.batch_read(items)
                        n += len(items)
                    wall = time.perf_counter() - t0
                    s1, c1 = sum(map(process_cpu_s, storage)), time.process_time()
                    out[name] = {"rate": n * unit / wall if name == "seq" else n / wall,
                                 "client_us": (c1 - c0) / n * 1e6, "storage_us": (s1 - s0) / n * 1e6}
    print(json.dumps(out))


def e2e(rounds: int, seconds: float) -> None:
    got: dict[str, list[dict]] = {k: [] for k in IMPLEMENTATIONS}
    for r in range(rounds):
        for impl in IMPLEMENTATIONS if r % 2 == 0 else IMPLEMENTATIONS[::-1]:
            env = {**os.environ, "THREEFS_CRC32C": impl}
            proc = subprocess.run([sys.executable, __file__, "--child", "--seconds", str(seconds)], env=env,
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode:
                raise SystemExit(f"round {r + 1} ({impl}) failed:\n{proc.stderr[-3000:]}")
            one = json.loads(proc.stdout.strip().splitlines()[-1])
            assert one["implementation"] == impl, one
            got[impl].append(one)
            print(f"round {r + 1} {impl:>7}: sequential {one['seq']['rate'] / 1e9:.2f} GB/s, client "
                  f"{one['seq']['client_us']:.0f} / storage {one['seq']['storage_us']:.0f} us CPU per MiB; random "
                  f"64 KiB {one['rand64k']['rate']:,.0f} IO/s, client {one['rand64k']['client_us']:.1f} / storage "
                  f"{one['rand64k']['storage_us']:.1f} us CPU per IO", flush=True)
    print("medians                      crc32c     awscrt   awscrt/crc32c")
    for name, label, scale in (("seq", "sequential GB/s", 1e-9), ("rand64k", "random 64 KiB IO/s", 1)):
        for key, what in (("rate", label), ("client_us", f"{name} client CPU us"),
                          ("storage_us", f"{name} storage CPU us")):
            a, b = (statistics.median(x[name][key] for x in got[impl]) * (scale if key == "rate" else 1)
                    for impl in IMPLEMENTATIONS)
            print(f"{what:<26} {a:10.2f} {b:10.2f}   {b / a:5.2f}x")
    print(f"load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--no-e2e", action="store_true", help="only the implementations alone")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.seconds)
        return
    alone()
    if not args.no_e2e:
        e2e(args.rounds, args.seconds)


if __name__ == "__main__":
    main()
