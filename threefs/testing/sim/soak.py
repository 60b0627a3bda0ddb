"""Soak mode: run and check many seeds of the simulator, and report what they exercised.

    python -m threefs.testing.craq_sim --seeds 100000 [--start N] [--jobs 2] [--legacy]

prints the seeds run, client operations (writes, reads), acknowledged writes, checked reads, faults by
kind (crashes, admin offline/online, dropped requests and responses) and every failing seed with its
first problem; exits 1 if any seed failed. Each failing seed replays with `Simulation(seed).run().check()`.
"""

from __future__ import annotations

import collections
import os
import time

from threefs.testing.sim import LEGACY, Simulation


def run_seeds(start: int, stop: int, scenario: dict | None = None) -> dict:
    """Run and check seeds [start, stop); totals and the failing seeds with their first problem."""
    totals: dict = {"seeds": 0, "ops": collections.Counter(), "faults": collections.Counter(), "acked": 0,
                    "checked_reads": 0, "virtual_s": 0.0, "cpu_s": 0.0, "failures": []}
    cpu = time.process_time()
    for seed in range(start, stop):
        sim = Simulation(seed, **(scenario or {}))
        try:
            sim.run().check()
        except AssertionError as e:
            totals["failures"].append((seed, str(e)[:500]))
        totals["seeds"] += 1
        totals["ops"].update(sim.ops)
        totals["faults"].update(sim.faults)
        totals["acked"] += len(sim.acked)
        totals["checked_reads"] += len(sim.reads)
        totals["virtual_s"] += sim.now
    totals["cpu_s"] = time.process_time() - cpu
    return totals


def _run_batch(args):
    return run_seeds(*args)


def soak(seeds: int, start: int = 0, jobs: int = 1, batch: int = 250, scenario: dict | None = None,
         progress=None) -> dict:
    """Run seeds [start, start+seeds) in batches on `jobs` processes; the merged totals."""
    import multiprocessing

    batches = [(b, min(b + batch, start + seeds), scenario) for b in range(start, start + seeds, batch)]
    merged = run_seeds(0, 0)
    pool = multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else None
    try:
        results = pool.imap_unordered(_run_batch, batches) if pool else map(_run_batch, batches)
        for done, part in enumerate(results, 1):
            for key in ("seeds", "acked", "checked_reads", "virtual_s", "cpu_s"):
                merged[key] += part[key]
            merged["ops"].update(part["ops"])
            merged["faults"].update(part["faults"])
            merged["failures"].extend(part["failures"])
            if progress is not None:
                progress(done, len(batches), merged)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    merged["failures"].sort()
    return merged


def main(argv=None) -> int:
    import argparse
    import signal
    import sys

    parser = argparse.ArgumentParser(prog="python -m threefs.testing.craq_sim",
                                     description="Soak the CRAQ simulator: run and check many seeds.")
    parser.add_argument("--seeds", type=int, default=10_000, help="how many seeds (default 10000)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--batch", type=int, default=250, help="seeds per work unit (default 250)")
    parser.add_argument("--legacy", action="store_true",
                        help="the model before admin faults (crashes only; seeds found then replay)")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1 or args.batch < 1 or args.start < 0:
        parser.error("--seeds, --jobs and --batch must be >= 1, --start >= 0")
    scenario = LEGACY if args.legacy else None
    began = time.monotonic()
    step = max(1, (args.seeds // args.batch) // 20)

    def progress(done, total, merged):
        if done % step == 0 or done == total:  # a full report so far: a soak cut short still counts
            print(f"-- after {time.monotonic() - began:.0f} s:", file=sys.stderr)
            report(merged, sys.stderr)

    def report(totals, out):
        wall = time.monotonic() - began
        ops, faults = totals["ops"], totals["faults"]
        load = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
        lines = [
            f"seeds: {totals['seeds']} of {args.start}..{args.start + args.seeds - 1} on {args.jobs} "
            f"process(es) in {wall:.0f} s ({totals['seeds'] / max(wall, 1e-9):.1f} seeds/s; "
            f"{totals['cpu_s']:.0f} CPU-s, {1000 * totals['cpu_s'] / max(totals['seeds'], 1):.1f} ms a seed; "
            f"load average {load})",
            f"client operations: {sum(ops.values())} ({ops['write']} writes, {ops['read']} reads); "
            f"virtual time {totals['virtual_s']:.0f} s",
            f"acknowledged writes: {totals['acked']}; checked reads: {totals['checked_reads']}",
            "faults: " + ", ".join(f"{kind} {faults[kind]}" for kind in sorted(faults)),
            f"failures: {len(totals['failures'])}",
            *(f"  {problem}  (replay: Simulation({seed}).run().check())"
              for seed, problem in sorted(totals["failures"])[:50]),
        ]
        print("\n".join(lines), file=out, flush=True)

    # a SIGTERM ends the run like ^C: the workers are stopped with it (soak's finally), not orphaned
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    totals = soak(args.seeds, args.start, args.jobs, args.batch, scenario, progress)
    report(totals, sys.stdout)
    return 1 if totals["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
