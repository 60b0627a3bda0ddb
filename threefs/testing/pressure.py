"""A pressure harness: a local cluster under a write and checkpoint load while the host runs out of breath.

    python -m threefs.testing.pressure [--seconds 120] [--cgroup-gib 6] [--free-gib 0.4] [--ckpt-gib 1]
                                       [--writeback-gib 4] [--cpu 2] [--dir D] [--lease-s L] [--timeout-s T]
                                       [--stall-mgmtd-s S --stall-every E]

Memory pressure is made local: with `--cgroup-gib N` (the default, 6) the harness puts itself, and so the
cluster, the client and the hog it starts, into a cgroup-v1 memory group limited to N GiB, and the hog keeps
the group's anonymous memory at N - `--free-gib` GiB, so page cache and dirty pages of the cluster and of
the writeback generator squeeze into `--free-gib` (as free memory did in the incident: ~0.4 GB). Without
a cgroup (`--cgroup-gib 0`) the hog follows the host's MemAvailable instead, and never leaves less than
1 GiB of it (other people's processes run here).

Beside the cluster, each in its own process (killed at the end, by pid):
- the memory hog (above), which keeps touching its pages;
- a writeback generator that writes `--writeback-gib` GiB next to the cluster's disks again and again without
  fsync (the kernel flushes it, and throttles every process that dirties pages);
- `--cpu` busy loops (CPU contention, as another tenant's job).

The client writes files with batch IO all along and, with `--ckpt-gib`, saves checkpoints of that size in a
loop through `threefs.checkpoint.CheckpointManager` (the incident's workload). Reported: storage fence events
and time fenced, mgmtd primary changes, failed writes and saves, and what was late: the longest lease pass
(one KV commit), the longest time between two renewals, the longest heartbeat send-to-reply and the longest
time without an accepted heartbeat (storage), the longest heartbeat gap seen by a primary, each service's
longest event-loop stall, wall clock against monotonic clock, load average, CPU steal, writeback rate.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
HOST_FREE_MIN_GIB = 1.0  # without a cgroup the hog never takes the machine's last GiB
HOG_STEP = 64 * MIB


def _cgroup_anon(cg: Path) -> int:
    for line in (cg / "memory.stat").read_text().splitlines():
        if line.startswith("total_rss "):
            return int(line.split()[1])
    return 0


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _hog(cgroup: str, limit: int, free: int) -> None:
    """Keep the free memory at `free` bytes: of the cgroup (anonymous memory against its limit), else of
    the host (MemAvailable). Grows and shrinks in 64 MiB blocks, touching every page it holds."""
    with open("/proc/self/oom_score_adj", "w") as f:  # if memory runs out, the OOM killer takes the hog
        f.write("1000")
    cg = Path(cgroup) if cgroup else None
    blocks: list[bytearray] = []
    while True:
        avail = limit - _cgroup_anon(cg) if cg else _mem_available()
        if avail > free + HOG_STEP:
            blocks.append(bytearray(HOG_STEP))
            for i in range(0, HOG_STEP, 4096):
                blocks[-1][i] = 1
            continue
        if avail < free - HOG_STEP and blocks:
            blocks.pop()
            continue
        for b in blocks:  # keep the pages hot so they are not reclaimed
            for i in range(0, HOG_STEP, 4096 * 16):
                b[i] = (b[i] + 1) & 0xFF
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


def _metric(url: str, name: str, agg=sum) -> float:
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return float("nan")
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + " ") or line.startswith(name + "{")]
    return agg(values) if values else float("nan")


def _proc_stat() -> tuple[int, int]:
    cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vals = [int(v) for v in cpu]
    return sum(vals), vals[7] if len(vals) > 7 else 0


def _vmstat(key: str) -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith(key + " "):
            return int(line.split()[1])
    return 0


class Sampler:
    """Every 50 ms: wall clock against monotonic clock, our own lateness, load, dirty memory, cgroup use."""

    def __init__(self, cgroup: Path | None):
        self.cgroup = cgroup
        self.clock_jump_s_max = 0.0  # |d(wall) - d(monotonic)| over one sample
        self.late_s_max = 0.0  # how late this sampler woke (the harness's own stall)
        self.load_max = 0.0
        self.dirty_max = 0
        self.cgroup_free_min = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        wall, mono = time.time(), time.monotonic()
        while not self.stop.wait(0.05):
            w, m = time.time(), time.monotonic()
            self.clock_jump_s_max = max(self.clock_jump_s_max, abs((w - wall) - (m - mono)))
            self.late_s_max = max(self.late_s_max, m - mono - 0.05)
            wall, mono = w, m
            self.load_max = max(self.load_max, float(Path("/proc/loadavg").read_text().split()[0]))
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("Dirty:"):
                    self.dirty_max = max(self.dirty_max, int(line.split()[1]) * 1024)
            if self.cgroup is not None:
                try:
                    limit = int((self.cgroup / "memory.limit_in_bytes").read_text())
                    usage = int((self.cgroup / "memory.usage_in_bytes").read_text())
                except OSError:
                    continue
                free = limit - usage
                self.cgroup_free_min = free if self.cgroup_free_min is None else min(self.cgroup_free_min, free)


def _make_cgroup(gib: float) -> Path:
    cg = CGROUP_ROOT / f"threefs-pressure-{os.getpid()}"
    cg.mkdir()
    (cg / "memory.limit_in_bytes").write_text(str(int(gib * GIB)))
    (cg / "cgroup.procs").write_text(str(os.getpid()))  # we, and so every process we start from now on
    return cg


def _remove_cgroup(cg: Path) -> None:
    parent = cg.parent / "cgroup.procs"
    for pid in (cg / "cgroup.procs").read_text().split():
        try:
            parent.write_text(pid)
        except OSError:
            pass
    for _ in range(50):
        try:
            cg.rmdir()
            return
        except OSError:
            time.sleep(0.1)


EVENT_RE = re.compile(r"is primary|no longer primary|fenced|heartbeats accepted again|marked failed|"
                      r"lease pass failed|heartbeat failed|is back")


def run(work: Path, seconds: float, cgroup_gib: float, free_gib: float, ckpt_gib: float, writeback_gib: float,
        cpu: int, cluster_extra: dict, stall_s: float = 0.0, stall_every: float = 20.0) -> dict:
    from threefs.cli.cluster import LocalCluster
    from threefs.client.client import Client

    if not cgroup_gib and free_gib < HOST_FREE_MIN_GIB:
        raise SystemExit(f"without a cgroup the hog leaves at least {HOST_FREE_MIN_GIB} GiB free "
                         f"(got --free-gib {free_gib}); use --cgroup-gib to squeeze memory locally")
    cg = _make_cgroup(cgroup_gib) if cgroup_gib else None
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    cluster = LocalCluster(work / "cluster")
    names = ["mgmtd-1", "mgmtd-2", "meta-1", "meta-2", "storage-1", "storage-2", "storage-3"]
    procs: list = []
    sampler = Sampler(cg)
    fs = None
    try:
        cluster.up(3, 3, **cluster_extra)
        fs = Client.connect(str(cluster.client_config_path))
        ctx = mp.get_context("spawn")
        procs.append(ctx.Process(target=_hog, args=(str(cg or ""), int(cgroup_gib * GIB), int(free_gib * GIB)),
                                 daemon=True))
        if writeback_gib:
            procs.append(ctx.Process(target=_writeback, args=(str(work / "writeback.bin"), writeback_gib),
                                     daemon=True))
        procs += [ctx.Process(target=_burn, daemon=True) for _ in range(cpu)]
        stop = threading.Event()
        writes = {"ok": 0, "failed": 0, "errors": {}, "longest_s": 0.0}
        saves = {"ok": 0, "failed": 0, "errors": [], "seconds": []}

        def fail(d: dict, e: BaseException) -> None:
            key = getattr(getattr(e, "code", None), "name", type(e).__name__)
            d["failed"] += 1
            if isinstance(d["errors"], dict):
                d["errors"][key] = d["errors"].get(key, 0) + 1
            elif len(d["errors"]) < 5:
                d["errors"].append(f"{key}: {str(e)[:300]}")

        def load() -> None:
            data = os.urandom(8 << 20)
            fs.mkdir("/pressure", exist_ok=True)
            i = 0
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    fs.batch_write([(f"/pressure/f{i % 16}", k * len(data), data) for k in range(4)], create=True)
                    writes["ok"] += 1
                except OSError as e:
                    fail(writes, e)
                writes["longest_s"] = max(writes["longest_s"], time.monotonic() - t0)
                i += 1

        def checkpoints() -> None:
            import torch

            from threefs.checkpoint import CheckpointManager

            n = int(ckpt_gib * GIB) // 4 // 4
            state = {f"w{k}": torch.full((n,), float(k)) for k in range(4)}
            mgr = CheckpointManager(fs, "/ckpt", keep_last=1)
            step = 0
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    mgr.save(state, step)
                    saves["ok"] += 1
                except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                    fail(saves, e)
                saves["seconds"].append(round(time.monotonic() - t0, 1))
                step += 1

        stalls = {"count": 0, "seconds": stall_s}

        def stall_primary() -> None:
            """Every `stall_every` s, SIGSTOP the primary mgmtd for `stall_s` s: a renewal that late (an
            event loop or KV commit stalled that long) moves the lease, as in the incident."""
            while not stop.wait(stall_every):
                primary = next((n for n in names[:2] if _metric(cluster.metrics_url(n), "threefs_mgmtd_primary") == 1),
                               None)
                pid = cluster.pid_of(primary) if primary else None
                if pid is None:
                    continue
                os.kill(pid, signal.SIGSTOP)
                try:
                    stop.wait(stall_s)
                finally:
                    os.kill(pid, signal.SIGCONT)
                stalls["count"] += 1

        fence_before = {n: _metric(cluster.metrics_url(n), "threefs_storage_fence_events") for n in names[4:]}
        log_start = {n: (cluster.dir / "log" / f"{n}.log").stat().st_size for n in names}
        threads = [threading.Thread(target=load, daemon=True)]
        if ckpt_gib:
            threads.append(threading.Thread(target=checkpoints, daemon=True))
        if stall_s:
            threads.append(threading.Thread(target=stall_primary, daemon=True))
        cpu0, steal0 = _proc_stat()
        written0 = _vmstat("nr_written")
        t_start = time.monotonic()
        sampler.thread.start()
        for p in procs:
            p.start()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(timeout=180)
        elapsed = time.monotonic() - t_start
        cpu1, steal1 = _proc_stat()
        written1 = _vmstat("nr_written")
    finally:
        sampler.stop.set()
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=10)
        (work / "writeback.bin").unlink(missing_ok=True)
    try:
        fences = {n: _metric(cluster.metrics_url(n), "threefs_storage_fence_events") - fence_before[n]
                  for n in names[4:]}
        m = {n: cluster.metrics_url(n) for n in names}
        events = []
        for n in names:
            with open(cluster.dir / "log" / f"{n}.log", "rb") as f:
                f.seek(log_start[n])
                events += [line for line in f.read().decode(errors="replace").splitlines() if EVENT_RE.search(line)]
        events.sort()
        result = {
            "command": {"seconds": seconds, "cgroup_gib": cgroup_gib, "free_gib": free_gib, "ckpt_gib": ckpt_gib,
                        "writeback_gib": writeback_gib, "cpu": cpu, "stall_s": stall_s, "stall_every": stall_every,
                        **cluster_extra},
            "client_writes": writes, "checkpoint_saves": saves, "mgmtd_stalls": stalls,
            "fence_events": fences,
            "fenced_seconds": {n: _metric(m[n], "threefs_storage_fenced_seconds") for n in names[4:]},
            "primary_changes": sum("is primary" in e for e in events),
            "nodes_marked_failed": sum("marked failed" in e for e in events),
            "lease_pass_s_max": {n: _metric(m[n], "threefs_mgmtd_lease_pass_seconds_max") for n in names[:2]},
            "lease_renew_gap_s_max": {n: _metric(m[n], "threefs_mgmtd_lease_renew_gap_seconds_max")
                                      for n in names[:2]},
            "mgmtd_heartbeat_gap_s_max": {n: _metric(m[n], "threefs_mgmtd_heartbeat_gap_seconds_max")
                                          for n in names[:2]},
            "storage_heartbeat_rtt_s_max": {n: _metric(m[n], "threefs_storage_heartbeat_rtt_seconds_max")
                                            for n in names[4:]},
            "storage_heartbeat_gap_s_max": {n: _metric(m[n], "threefs_storage_heartbeat_gap_seconds_max")
                                            for n in names[4:]},
            "event_loop_lag_max_s": {n: _metric(m[n], "threefs_event_loop_lag_seconds_max") for n in names},
            "wall_vs_monotonic_jump_s_max": round(sampler.clock_jump_s_max, 4),
            "harness_stall_s_max": round(sampler.late_s_max, 3),
            "loadavg_start": load0, "loadavg_max": sampler.load_max,
            "cpu_steal_pct": round(100 * (steal1 - steal0) / max(1, cpu1 - cpu0), 1),
            "writeback_gb_s": round((written1 - written0) * 4096 / elapsed / 1e9, 2),
            "dirty_gb_max": round(sampler.dirty_max / 1e9, 2),
            "cgroup_free_gb_min": None if sampler.cgroup_free_min is None else round(sampler.cgroup_free_min / 1e9, 2),
            "events": events[-60:],
        }
    finally:
        if fs is not None:
            fs.close()
        cluster.down()
        if cg is not None:
            _remove_cgroup(cg)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m threefs.testing.pressure", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--cgroup-gib", type=float, default=6.0, help="memory limit of the cluster+hog (0 = none)")
    p.add_argument("--free-gib", type=float, default=0.4, help="memory the hog leaves free")
    p.add_argument("--ckpt-gib", type=float, default=1.0, help="checkpoint size saved in a loop (0 = none)")
    p.add_argument("--writeback-gib", type=float, default=4.0)
    p.add_argument("--cpu", type=int, default=2)
    p.add_argument("--timeout-s", type=float, help="cluster heartbeat timeout T (default: the cluster's)")
    p.add_argument("--lease-s", type=float, help="cluster mgmtd lease L (default: the cluster's)")
    p.add_argument("--stall-mgmtd-s", type=float, default=0.0,
                   help="SIGSTOP the primary mgmtd this long every --stall-every s (a late renewal)")
    p.add_argument("--stall-every", type=float, default=20.0)
    p.add_argument("--dir")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = p.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="threefs-pressure-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    extra = {}
    if args.timeout_s:
        extra["heartbeat_timeout_s"] = args.timeout_s
    if args.lease_s:
        extra["mgmtd_lease_s"] = args.lease_s
    try:
        print(json.dumps(run(work, args.seconds, args.cgroup_gib, args.free_gib, args.ckpt_gib,
                             args.writeback_gib, args.cpu, extra, args.stall_mgmtd_s, args.stall_every), indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
