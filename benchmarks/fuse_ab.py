"""A/B of the FUSE daemon's code: a daemon from another revision beside this tree's, on one cluster, in one run.

    .venv/bin/python benchmarks/fuse_ab.py --base REV [--rounds 6] [--files 2000] [--seconds 2]
                                           [--only unlink,qd1,psync,qd32] [--no-spin]

The cluster (3 storage services, R=3, one meta server) runs this tree's code; two daemons mount it: `base`
from a git worktree of REV (made in a temp dir, removed afterwards) and `this` from this tree. Rounds are
interleaved (each round starts with the other daemon), so a noisy neighbour hits both alike. Workloads,
each per daemon per round: (unlink) create `--files` empty files, stat them, then time os.unlink of each;
(qd1) 4 KiB O_DIRECT preads at random offsets of a 64 MiB file for `--seconds`; (psync, qd32) fio 4 KiB
randread O_DIRECT, psync x4 and libaio qd32. Printed per round: the rate and the daemon's CPU per request,
from /proc/PID/task/*/schedstat (nanoseconds; /proc/PID/stat's 10 ms ticks are too coarse for 2,000
requests), then the median of each over the rounds and this/base.

`--no-spin` sets THREEFS_RPC_SPIN_US=0 for both daemons (and this process's cluster): the daemons then
sleep instead of polling while they wait, so their CPU is the work they do, which is what a change to the
daemon's code changes. With spinning on (the default) CPU includes the polling, and the rates are the
product's. The machine is shared: compare within one run, over several rounds; `--base HEAD` (the same
code on both sides) shows the noise (6 rounds, --no-spin: unlink CPU 1.08x, qd1 1.00x in one run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.fuse_profile import spawn_variant  # noqa: E402
from threefs.cli.cluster import LocalCluster  # noqa: E402
from threefs.client import fuse_mount  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FILE_MIB = 64
BLOCK = 4096


def daemon_cpu_s(pid: int) -> float:
    """On-CPU seconds of every thread of `pid` (schedstat: nanoseconds)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return total / 1e9


def unlink_loop(mnt: str, tag: str, n: int, pid: int) -> tuple[float, float]:
    d = os.path.join(mnt, f"ab-{tag}")
    os.makedirs(d)
    names = [os.path.join(d, f"f{i:06d}") for i in range(n)]
    for name in names:
        open(name, "w").close()
    for name in names:
        os.stat(name)
    time.sleep(0.2)  # the deferred closes go out before the timed part
    c0, t0 = daemon_cpu_s(pid), time.perf_counter()
    for name in names:
        os.unlink(name)
    dt, cpu = time.perf_counter() - t0, daemon_cpu_s(pid) - c0
    os.rmdir(d)
    return n / dt, 1e6 * cpu / n


def qd1_reads(path: str, seconds: float, seed: int, pid: int) -> tuple[float, float]:
    import mmap

    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    rng, n = random.Random(seed), 0
    blocks = FILE_MIB * (1 << 20) // BLOCK
    try:
        c0, t0 = daemon_cpu_s(pid), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            os.preadv(fd, [buf], rng.randrange(blocks) * BLOCK)
            n += 1
        dt, cpu = time.perf_counter() - t0, daemon_cpu_s(pid) - c0
    finally:
        os.close(fd)
    return n / dt, 1e6 * cpu / n


def fio(path: str, engine: str, jobs: int, depth: int, seconds: float, pid: int) -> tuple[float, float]:
    c0 = daemon_cpu_s(pid)
    r = subprocess.run(["fio", "--name=ab", f"--filename={path}", "--rw=randread", f"--bs={BLOCK}",
                        f"--ioengine={engine}", f"--iodepth={depth}", f"--numjobs={jobs}", "--direct=1",
                        f"--size={FILE_MIB}m", f"--runtime={seconds}", "--time_based", "--group_reporting",
                        "--output-format=json"], capture_output=True, text=True, check=True)
    read = json.loads(r.stdout)["jobs"][0]["read"]
    return read["iops"], 1e6 * (daemon_cpu_s(pid) - c0) / max(1, read["total_ios"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of the other daemon (e.g. HEAD~1, main)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--files", type=int, default=2000, help="files of the unlink loop")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each read workload")
    ap.add_argument("--only", default="unlink,qd1,psync,qd32")
    ap.add_argument("--no-spin", action="store_true", help="THREEFS_RPC_SPIN_US=0: daemon CPU is work only")
    args = ap.parse_args()
    work = set(args.only.split(","))
    unknown = work - {"unlink", "qd1", "psync", "qd32"}
    if unknown:
        ap.error(f"--only: unknown workloads {sorted(unknown)}")
    if {"psync", "qd32"} & work and shutil.which("fio") is None:
        ap.error("fio is not installed (apt-get install fio), or leave psync and qd32 out with --only")
    if args.no_spin:
        os.environ["THREEFS_RPC_SPIN_US"] = "0"
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", args.base], capture_output=True, text=True)
    if rev.returncode != 0:
        ap.error(f"--base {args.base}: {rev.stderr.strip()}")
    tmp = tempfile.mkdtemp(prefix="threefs-fuse-ab-")
    base_tree = os.path.join(tmp, "base")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", base_tree, args.base], check=True)
    cluster = LocalCluster(os.path.join(tmp, "cluster"))
    daemons: list[tuple[str, object, str]] = []
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        cluster.up(3, 3, meta=1)
        for k, (name, tree) in enumerate((("base", base_tree), ("this", REPO))):
            # spawned from `tree` with it first on PYTHONPATH: that tree's threefs is the daemon's
            label, mnt, proc = spawn_variant(cluster, tmp, k, f"{name}||PYTHONPATH={tree}")
            daemons.append((label, proc, mnt))
        data = os.path.join(daemons[0][2], "ab-data")
        with open(data, "wb") as f:
            for _ in range(FILE_MIB):
                f.write(os.urandom(1 << 20))
        print(f"base {rev.stdout.strip()} ({args.base}) against this tree; spin "
              f"{'off' if args.no_spin else 'on'}; us = the daemon's CPU per request")
        for rnd in range(args.rounds):
            for name, proc, mnt in (daemons if rnd % 2 == 0 else daemons[::-1]):
                path, pid, row = os.path.join(mnt, "ab-data"), proc.pid, []
                runs = [("unlink", lambda: unlink_loop(mnt, f"{name}{rnd}", args.files, pid)),
                        ("qd1", lambda: qd1_reads(path, args.seconds, rnd, pid)),
                        ("psync", lambda: fio(path, "psync", 4, 1, args.seconds, pid)),
                        ("qd32", lambda: fio(path, "libaio", 1, 32, args.seconds, pid))]
                for key, run in runs:
                    if key in work:
                        rate, us = run()
                        results.setdefault((key, name), []).append((rate, us))
                        row.append(f"{key} {rate:8,.0f}/s {us:6.1f} us")
                print(f"round {rnd} {name:4}: " + "   ".join(row), flush=True)
        print("\nmedian over rounds          base                    this                   this/base")
        for key in ("unlink", "qd1", "psync", "qd32"):
            if key not in work:
                continue
            (rb, ub), (rt, ut) = ([statistics.median(x) for x in zip(*results[(key, who)])]
                                  for who in ("base", "this"))
            print(f"{key:8} {rb:12,.0f}/s {ub:6.1f} us  {rt:12,.0f}/s {ut:6.1f} us    rate {rt / rb:.2f}x  "
                  f"CPU {ut / ub:.2f}x")
    finally:
        for name, proc, mnt in daemons:
            fuse_mount.stop(proc, mnt)
        cluster.down()
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base_tree], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
