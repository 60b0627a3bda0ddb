"""Where the FUSE daemon's time goes: CPU per GB / per request of every process, per workload, in one run.

    .venv/bin/python benchmarks/fuse_profile.py [--mib 64] [--files 300] [--seconds 3] [--rounds 1]
                                                [--py-spy DIR] [--only seq,rand,meta]
                                                [--variant 'LABEL|mount args|ENV=V' ...]

One cluster (3 storage services, R=3) and its mount. Workloads: (seq) a cold dd bs=1M read of a `--mib` file
through the mount (the kernel's pages dropped first) beside batch_read of the same file (1 MiB items);
(rand) fio 4 KiB randread O_DIRECT through the mount, libaio qd32 and psync x4, beside batch_read of
4,096 random 4 KiB items; (meta) a loop of open(O_CREAT|O_WRONLY)+close and of unlink over `--files` files. For each: the rate,
and CPU seconds (user+system, /proc/PID/stat) of the FUSE daemon, meta, the three storage services, and the
tool (dd/fio/the loop), per GB or per request. With `--py-spy DIR` the daemon is sampled (py-spy record
--gil --native, speedscope-less raw format) during each workload into DIR/<workload>.txt (top frames are
printed). Several `--variant`s mount several daemons on the one cluster, rounds interleaved (A/B of
daemon options in one run). The machine is shared: read ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from threefs.cli.cluster import LocalCluster  # noqa: E402
from threefs.client import fuse_mount  # noqa: E402
from threefs.client.client import Client  # noqa: E402

MiB = 1 << 20
RANDOM_IOS = 4096


def cpu_s(pid: int, part: slice = slice(11, 13)) -> float:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(map(int, fields[part])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Meter:
    """CPU seconds of each watched process over a with-block (the tool: this process's children)."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.c0 = {k: cpu_s(p) for k, p in self.pids.items()}
        self.sys0 = cpu_s(self.pids["daemon"], slice(12, 13)) if "daemon" in self.pids else 0.0
        self.tool0, self.self0 = children_cpu(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.cpu = {k: cpu_s(p) - self.c0[k] for k, p in self.pids.items()}
        if "daemon" in self.pids:
            self.cpu["(daemon system)"] = cpu_s(self.pids["daemon"], slice(12, 13)) - self.sys0
        self.cpu["tool"] = children_cpu() - self.tool0
        self.cpu["this process"] = time.process_time() - self.self0


def group(cpu: dict[str, float]) -> dict[str, float]:
    out = {"daemon": 0.0, "(daemon system)": 0.0, "meta": 0.0, "storage": 0.0}
    for k, v in cpu.items():
        key = "storage" if k.startswith("storage") else "meta" if k.startswith("meta") else k
        if key in out or key in ("tool", "this process"):
            out[key] = out.get(key, 0.0) + v
    return out


class Spy:
    def __init__(self, pid: int, out_dir: str | None):
        self.pid, self.dir = pid, out_dir

    def start(self, name: str):
        self.proc = None
        if not self.dir:
            return
        spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        self.path = os.path.join(self.dir, f"{name}.txt")
        self.proc = subprocess.Popen([spy, "record", "--pid", str(self.pid), "--gil", "--format", "raw",
                                      "--rate", "200", "--output", self.path, "--nonblocking"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)

    def stop(self):
        if self.proc is None:
            return
        self.proc.send_signal(2)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        summarize(self.path)


def summarize(path: str, top: int = 25) -> None:
    """Self and inclusive sample shares of the functions in a py-spy raw (collapsed stacks) file."""
    if not os.path.exists(path):
        print(f"  (no profile at {path})")
        return
    total, incl, own = 0, {}, {}
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n
    print(f"  py-spy {path}: {total} GIL samples; self / inclusive, top {top} by self:")
    for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {100 * n / total:5.1f}% {100 * incl[f] / total:5.1f}%  {f[:150]}")


def report(name: str, m: Meter, units: float, unit: str, rate: float, rate_unit: str) -> None:
    g = group(m.cpu)
    per = ", ".join(f"{k} {v / units * (1e6 if unit == 'request' else 1):.1f}" for k, v in g.items())
    scale = "us per request" if unit == "request" else "CPU-s per GB"
    print(f"{name:<44} {rate:>12,.1f} {rate_unit:<6} wall {m.wall:5.2f} s; {scale}: {per}")


def spawn_variant(cluster, tmp: str, k: int, spec: str):
    """spec: 'LABEL' or 'LABEL|mount args' or 'LABEL|mount args|ENV=V,...' (env for the daemon). With
    PYTHONPATH=DIR the daemon is spawned from DIR, so that DIR's threefs is the one imported (`python -m`
    puts the working directory first): 'before||PYTHONPATH=/work/main' mounts an older checkout's daemon."""
    parts = spec.split("|")
    label, margs = parts[0], parts[1].split() if len(parts) > 1 else []
    env = dict(kv.split("=", 1) for kv in parts[2].split(",") if kv) if len(parts) > 2 else {}
    mnt = os.path.join(tmp, f"mnt{k}")
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    cwd = os.getcwd()
    try:
        if "PYTHONPATH" in env:
            os.chdir(env["PYTHONPATH"].split(os.pathsep)[0])
        proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, margs, os.path.join(tmp, f"fuse{k}.log"))
    finally:
        os.chdir(cwd)
        for key, v in saved.items():
            if v is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = v
    return label, mnt, proc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--py-spy", default="", help="directory for py-spy profiles of the daemon")
    ap.add_argument("--variant", action="append", default=[],
                    help="a daemon to mount: 'LABEL|mount args|ENV=V,...' (repeat to compare, rounds "
                         "interleaved; default one daemon with the default options)")
    ap.add_argument("--only", default="seq,rand,meta", help="of seq, rand, rand32 (qd32 only), meta")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    only = set(args.only.split(","))
    total = args.mib * MiB
    print("load average before:", open("/proc/loadavg").read().strip())
    with tempfile.TemporaryDirectory(prefix="threefs-fuse-profile-", dir=os.environ.get("TMPDIR")) as tmp:
        cluster = LocalCluster(os.path.join(tmp, "cluster"))
        mounts = []
        try:
            cluster.up(3, 3)
            for k, spec in enumerate(args.variant or ["default"]):
                mounts.append(spawn_variant(cluster, tmp, k, spec))
            base = {k: p for k, p in cluster.running().items() if k.startswith(("storage", "meta"))}
            if args.py_spy:
                os.makedirs(args.py_spy, exist_ok=True)
            with Client.connect(str(cluster.client_config_path)) as fs:
                path0 = os.path.join(mounts[0][1], "seq.bin")
                with open(path0, "wb") as f:
                    for _ in range(args.mib):
                        f.write(os.urandom(MiB))
                attr = fs.stat("/seq.bin")
                buf = memoryview(bytearray(total))
                for r in range(args.rounds):
                    for label, mnt, proc in mounts:
                        print(f"-- round {r + 1}, daemon {label!r}: {open('/proc/loadavg').read().strip()}")
                        pids = dict(base, daemon=proc.pid)
                        spy = Spy(proc.pid, args.py_spy or None)
                        run_round(fs, attr, buf, total, mnt, pids, spy, f"{label}-{r}", only, args)
        finally:
            for label, mnt, proc in mounts:
                fuse_mount.stop(proc, mnt)
            for k, (label, _, _) in enumerate(mounts):
                log = os.path.join(tmp, f"fuse{k}.log")
                if os.path.exists(log):
                    for line in open(log):
                        if "requests served" in line:
                            print(f"daemon {label!r}:", line.strip()[line.find("requests served"):])
            cluster.down()
    print("load average after:", open("/proc/loadavg").read().strip())


def run_round(fs, attr, buf, total, mnt, pids, spy, tag, only, args) -> None:
    path = os.path.join(mnt, "seq.bin")
    if "seq" in only:
        with Meter(pids) as m:
            fs.batch_read([(attr, o, buf[o:o + MiB]) for o in range(0, total, MiB)])
        report("batch_read 1 MiB items", m, total / 1e9, "GB", total / m.wall / 1e9, "GB/s")
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        spy.start(f"seq-{tag}")
        with Meter(pids) as m:
            subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "status=none"], check=True)
        spy.stop()
        report("FUSE dd bs=1M cold", m, total / 1e9, "GB", total / m.wall / 1e9, "GB/s")
    if "rand" in only or "rand32" in only:
        rng = random.Random(7)
        arena = memoryview(bytearray(RANDOM_IOS * 4096))
        items = [(attr, rng.randrange(total // 4096) * 4096, arena[i * 4096:(i + 1) * 4096])
                 for i in range(RANDOM_IOS)]
        n = 0
        with Meter(pids) as m:
            while m.t0 + args.seconds > time.perf_counter():
                fs.batch_read(items)
                n += RANDOM_IOS
        report("batch_read 4 KiB x 4096", m, n, "request", n / m.wall, "IO/s")
        for depth, engine in ((32, "libaio"), (4, "psync"))[:1 if "rand" not in only else 2]:
            spy.start(f"rand{depth}-{tag}")
            jobs = ["--numjobs=4", "--group_reporting"] if engine == "psync" else [f"--iodepth={depth}"]
            with Meter(pids) as m:
                out = subprocess.run(
                    ["fio", "--name=j", f"--filename={path}", "--rw=randread", "--bs=4k", f"--size={total}",
                     f"--ioengine={engine}", *jobs, "--direct=1", f"--runtime={args.seconds}", "--time_based",
                     "--output-format=json"], capture_output=True, text=True, check=True).stdout
            spy.stop()
            job = json.loads(out)["jobs"][0]["read"]
            what = f"libaio qd{depth}" if engine == "libaio" else "psync x4"
            report(f"FUSE fio 4 KiB randread {what} direct", m, job["total_ios"], "request", job["iops"], "IO/s")
    if "meta" in only:
        d = os.path.join(mnt, f"meta-{tag}")
        os.mkdir(d)
        names = [os.path.join(d, f"f{i:06d}") for i in range(args.files)]
        loop = ("import os,sys,time\nns=sys.argv[2:]\nt=time.perf_counter()\n"
                "if sys.argv[1]=='c':\n  [os.close(os.open(p,os.O_CREAT|os.O_WRONLY,0o644)) for p in ns]\n"
                "else:\n  [os.unlink(p) for p in ns]\nprint(time.perf_counter()-t)")
        for op in ("c", "u"):
            spy.start(f"{'create' if op == 'c' else 'unlink'}-{tag}")
            with Meter(pids) as m:
                t = float(subprocess.run([sys.executable, "-c", loop, op, *names], check=True,
                                         capture_output=True, text=True).stdout)
            spy.stop()
            report(f"FUSE {'create+close' if op == 'c' else 'unlink'} loop", m, len(names), "request",
                   len(names) / t, "/s")
        os.rmdir(d)


if __name__ == "__main__":
    main()
