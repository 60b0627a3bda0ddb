"""A pressure harness: a local cluster under a write load while the host runs out of breath.

    python -m threefs.testing.pressure [--seconds 120] [--hog-gib 8] [--writeback-gib 6] [--cpu 2] [--dir D]

Beside the cluster it runs, each in its own process (killed at the end, by pid):
- a memory hog that allocates and keeps touching `--hog-gib` GiB (free memory and page cache shrink);
- a writeback generator that writes `--writeback-gib` GiB to a file next to the cluster's disks again and
  again without fsync (the kernel flushes it, and throttles every process that dirties pages);
- `--cpu` busy loops (CPU contention, as another tenant's job).

The client writes files with batch IO all along and counts failed writes. The harness then reports what
the operator would see: storage fence events (`threefs_storage_fence_events`), mgmtd primary changes
(log lines "is primary"), heartbeat-related warnings, failed client writes, and the longest event-loop
stall of each service (`threefs_event_loop_lag_seconds_max`, when the service exports it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

GIB = 1 << 30


def _hog(gib: float) -> None:
    with open("/proc/self/oom_score_adj", "w") as f:  # if memory runs out, the OOM killer takes the hog
        f.write("1000")
    block = bytearray(int(gib * GIB))
    page = 4096
    while True:  # keep the pages hot so they are not reclaimed
        for i in range(0, len(block), page * 64):
            block[i] = (block[i] + 1) & 0xFF
        time.sleep(0.05)


def _writeback(path: str, gib: float) -> None:
    chunk = os.urandom(8 << 20)
    while True:
        with open(path, "wb") as f:
            for _ in range(int(gib * GIB) // len(chunk)):
                f.write(chunk)


def _burn() -> None:
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _metric(url: str, name: str) -> float:
    try:
        text = urllib.request.urlopen(url, timeout=2).read().decode()
    except OSError:
        return float("nan")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run(work: Path, seconds: float, hog_gib: float, writeback_gib: float, cpu: int) -> dict:
    from threefs.cli.cluster import LocalCluster
    from threefs.client.client import Client

    cluster = LocalCluster(work / "cluster")
    names = ["mgmtd-1", "mgmtd-2", "meta-1", "meta-2", "storage-1", "storage-2", "storage-3"]
    cluster.up(3, 3)
    fs = Client.connect(str(cluster.client_config_path))
    ctx = mp.get_context("spawn")
    procs = []
    if hog_gib:
        procs.append(ctx.Process(target=_hog, args=(hog_gib,), daemon=True))
    if writeback_gib:
        procs.append(ctx.Process(target=_writeback, args=(str(work / "writeback.bin"), writeback_gib), daemon=True))
    procs += [ctx.Process(target=_burn, daemon=True) for _ in range(cpu)]
    stop = threading.Event()
    writes = {"ok": 0, "failed": 0, "errors": {}, "longest_s": 0.0}

    def load() -> None:
        data = os.urandom(8 << 20)
        fs.mkdir("/pressure", exist_ok=True)
        i = 0
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                fs.batch_write([(f"/pressure/f{i % 64}", k * len(data), data) for k in range(4)], create=True)
                writes["ok"] += 1
            except OSError as e:
                writes["failed"] += 1
                key = getattr(getattr(e, "code", None), "name", type(e).__name__)
                writes["errors"][key] = writes["errors"].get(key, 0) + 1
            writes["longest_s"] = max(writes["longest_s"], time.monotonic() - t0)
            i += 1

    fence_before = {n: _metric(cluster.metrics_url(n), "threefs_storage_fence_events") for n in names[4:]}
    loader = threading.Thread(target=load, daemon=True)
    try:
        for p in procs:
            p.start()
        loader.start()
        time.sleep(seconds)
    finally:
        stop.set()
        loader.join(timeout=120)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=10)
        (work / "writeback.bin").unlink(missing_ok=True)
    fences = {n: _metric(cluster.metrics_url(n), "threefs_storage_fence_events") - fence_before[n]
              for n in names[4:]}
    lag = {n: _metric(cluster.metrics_url(n), "threefs_event_loop_lag_seconds_max") for n in names}
    logs = {n: cluster.log_tail(n, 100000) for n in names}
    primaries = sum(len(re.findall(r"is primary", logs[n])) for n in ("mgmtd-1", "mgmtd-2"))
    result = {"seconds": seconds, "hog_gib": hog_gib, "writeback_gib": writeback_gib, "cpu": cpu,
              "client_writes": writes, "fence_events": fences, "primary_elections": primaries,
              "lease_pass_failures": sum(logs[n].count("lease pass failed") for n in ("mgmtd-1", "mgmtd-2")),
              "heartbeat_failures": sum(logs[n].count("heartbeat failed") for n in names),
              "event_loop_lag_max_s": lag}
    fs.close()
    cluster.down()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m threefs.testing.pressure", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--hog-gib", type=float, default=8.0)
    p.add_argument("--writeback-gib", type=float, default=6.0)
    p.add_argument("--cpu", type=int, default=2)
    p.add_argument("--dir")
    args = p.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="threefs-pressure-"))
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(work, args.seconds, args.hog_gib, args.writeback_gib, args.cpu), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
