"""The mount battery of issue 15: threefs's FUSE mount against GlusterFS replica-3 (both through FUSE, three
bricks / three storage services on the same disk), with a local directory on that disk as a third
column, in one run, rounds interleaved (each round starting at the next system), median of each row.

    .venv/bin/python benchmarks/mount_battery.py [--mib 256] [--files 1000] [--rounds 3] [--seconds 4]
                                                 [--install-gluster] [--no-gluster]

Rows: dd sequential write with conv=fdatasync; dd sequential read cold (the client's page cache of the
file dropped with posix_fadvise; servers keep theirs, on both sides) and warm (the same read again);
fio 4 KiB random reads, psync, 4 jobs, buffered and O_DIRECT; a Python loop (in its own process) of
create / stat / listdir / unlink over `--files` files. Prints each row, threefs / GlusterFS and the
goals (>= 1.0x every row, >= 3x metadata and 4 KiB random reads), and the load average.

GlusterFS comes from Debian (glusterfs-server, glusterfs-client). Without it installed the GlusterFS
column is skipped with the reason; `--install-gluster` runs apt-get for it first (or run
scripts/setup-glusterfs.sh). The benchmark starts its own glusterd (`glusterd -N`, refused if another
one already listens on port 24007), creates and starts a volume on three bricks under its temporary
directory, mounts it with the glusterfs FUSE client, and afterwards unmounts, stops and deletes the
volume and ends the glusterd it started, by pid (the brick processes end with the volume).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import local_cluster  # noqa: E402

MiB = 1 << 20
GLUSTERD_PORT = 24007
GLUSTER_PACKAGES = ["glusterfs-server", "glusterfs-client"]
GLUSTER_TIMEOUT_S = 60

META_LOOP = r"""
import json, os, sys, time
top, n = sys.argv[1], int(sys.argv[2])
d = os.path.join(top, "meta")
os.makedirs(d)
names = [os.path.join(d, f"f{i:06d}") for i in range(n)]
out = {}
t0 = time.perf_counter()
for p in names:
    open(p, "w").close()
out["create"] = n / (time.perf_counter() - t0)
t0 = time.perf_counter()
for p in names:
    os.stat(p)
out["stat"] = n / (time.perf_counter() - t0)
reps, t0 = 0, time.perf_counter()
while reps < 3 or time.perf_counter() - t0 < 1.0:
    assert len(os.listdir(d)) == n
    reps += 1
out["listdir"] = reps * n / (time.perf_counter() - t0)
t0 = time.perf_counter()
for p in names:
    os.unlink(p)
out["unlink"] = n / (time.perf_counter() - t0)
try:
    os.rmdir(d)
except OSError as e:
    left = os.listdir(d)
    sys.exit(f"rmdir {d} after unlinking all {n} files: {e}; listed now: {left[:10]} ({len(left)})")
print(json.dumps(out))
"""

ROWS = [  # (key, label, unit, goal vs GlusterFS)
    ("write", "dd seq write (conv=fdatasync)", "MB/s", 1.0),
    ("read_cold", "dd seq read, cold", "MB/s", 1.0),
    ("read_warm", "dd seq read, warm (second read)", "MB/s", 1.0),
    ("rand_buffered", "fio 4 KiB randread psync x4, buffered", "IOPS", 3.0),
    ("rand_direct", "fio 4 KiB randread psync x4, O_DIRECT", "IOPS", 3.0),
    ("create", "create (open(w)+close), one process", "/s", 3.0),
    ("stat", "stat, one process", "/s", 3.0),
    ("listdir", "listdir", "entries/s", 3.0),
    ("unlink", "unlink, one process", "/s", 3.0),
]


def sh(cmd: list[str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {(r.stderr or r.stdout).strip()[-800:]}")
    return r


def drop_client_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd_mbps(src: str, dst: str, nbytes: int, flags: list[str]) -> float:
    t0 = time.perf_counter()
    sh(["dd", f"if={src}", f"of={dst}", "bs=1M", f"count={nbytes // MiB}", "status=none", *flags])
    return nbytes / (time.perf_counter() - t0) / 1e6


def fio_iops(path: str, nbytes: int, direct: bool, seconds: float) -> float:
    r = sh(["fio", "--name=r", f"--filename={path}", "--rw=randread", "--bs=4k", "--ioengine=psync",
            "--numjobs=4", f"--direct={int(direct)}", f"--size={nbytes}", f"--runtime={seconds}",
            "--time_based", "--group_reporting", "--output-format=json"], timeout=seconds + 120)
    return json.loads(r.stdout)["jobs"][0]["read"]["iops"]


def battery_round(top: str, source: str, nbytes: int, files: int, seconds: float) -> dict[str, float]:
    """One round of every row on the directory `top`."""
    out: dict[str, float] = {}
    target = os.path.join(top, "seq.bin")
    out["write"] = dd_mbps(source, target, nbytes, ["conv=fdatasync"])
    drop_client_cache(target)
    out["read_cold"] = dd_mbps(target, "/dev/null", nbytes, [])
    out["read_warm"] = dd_mbps(target, "/dev/null", nbytes, [])
    if shutil.which("fio"):
        out["rand_buffered"] = fio_iops(target, nbytes, False, seconds)
        out["rand_direct"] = fio_iops(target, nbytes, True, seconds)
    r = sh([sys.executable, "-c", META_LOOP, top, str(files)], timeout=1800)
    out.update(json.loads(r.stdout.strip().splitlines()[-1]))
    os.unlink(target)
    return out


# -- GlusterFS -------------------------------------------------------------------------------------
def gluster_missing() -> str | None:
    missing = [b for b in ("glusterd", "gluster", "mount.glusterfs") if not shutil.which(b)]
    if missing:
        return (f"{', '.join(missing)} not installed: apt-get install -y {' '.join(GLUSTER_PACKAGES)} "
                "(or scripts/setup-glusterfs.sh, or this benchmark with --install-gluster)")
    return None


def install_gluster() -> None:
    print(f"installing {' '.join(GLUSTER_PACKAGES)} from Debian (apt-get) ...", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *GLUSTER_PACKAGES]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-800:]}")


def host_address() -> str:
    """An address of this machine that is not loopback (GlusterFS refuses bricks on localhost)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            addr = ""
    if not addr or addr.startswith("127."):
        out = sh(["hostname", "-I"], check=False).stdout.split()
        addr = next((a for a in out if "." in a and not a.startswith("127.")), "")
    if not addr:
        raise RuntimeError("no non-loopback IPv4 address for the GlusterFS bricks")
    return addr


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _pids_of_volume(volume: str) -> list[int]:
    """Processes whose command line names our volume (bricks, self-heal): all started by our glusterd."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if f"--volfile-id {volume}".encode() in cmd or (f"{volume}.".encode() in cmd and b"glusterfsd" in cmd):
            pids.append(int(pid))
    return pids


@contextlib.contextmanager
def gluster_volume(tmp: str):
    """A started replica-3 volume on three bricks under tmp, mounted; yields the mount point."""
    if port_in_use(GLUSTERD_PORT):
        raise RuntimeError(f"port {GLUSTERD_PORT} is in use (another glusterd runs here); not touching it")
    volume = f"tfsbat{os.getpid()}"
    base = os.path.join(tmp, "gluster")
    bricks = [os.path.join(base, f"brick{i}") for i in range(1, 4)]
    mnt = os.path.join(base, "mnt")
    for d in bricks + [mnt]:
        os.makedirs(d)
    pidfile, log = os.path.join(base, "glusterd.pid"), os.path.join(base, "glusterd.log")
    glusterd = subprocess.Popen(["glusterd", "-N", "-p", pidfile, f"--log-file={log}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    created = mounted = False
    cli = ["gluster", "--mode=script"]
    try:
        deadline = time.monotonic() + GLUSTER_TIMEOUT_S
        while sh(cli + ["volume", "list"], check=False, timeout=30).returncode:
            if glusterd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"glusterd did not start (exit {glusterd.poll()}); see {log}")
            time.sleep(0.2)
        addr = host_address()
        sh(cli + ["volume", "create", volume, "replica", "3", *[f"{addr}:{b}" for b in bricks], "force"])
        created = True
        sh(cli + ["volume", "start", volume])
        sh(["mount", "-t", "glusterfs", f"{addr}:/{volume}", mnt], timeout=GLUSTER_TIMEOUT_S)
        mounted = True
        yield mnt
    finally:
        if mounted:
            if sh(["umount", mnt], check=False).returncode:
                sh(["umount", "-l", mnt], check=False)
        if created:
            sh(cli + ["volume", "stop", volume, "force"], check=False, timeout=120)
            sh(cli + ["volume", "delete", volume], check=False, timeout=120)
        for pid in _pids_of_volume(volume):  # normally none: the volume's stop ended them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        glusterd.terminate()
        try:
            glusterd.wait(timeout=20)
        except subprocess.TimeoutExpired:
            glusterd.kill()
            glusterd.wait(timeout=10)


@contextlib.contextmanager
def before_mount(cluster, tmp: str, tree: str):
    """The same cluster mounted by the FUSE daemon of an older checkout (its threefs package first on
    PYTHONPATH); its top directory is /before on the cluster."""
    from threefs.client import fuse_mount

    mnt = os.path.join(tmp, "mnt-before")
    saved, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = os.path.abspath(tree) + (os.pathsep + saved if saved else "")
    os.chdir(tree)  # `python -m` puts the working directory first on sys.path, before PYTHONPATH
    try:
        proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], os.path.join(tmp, "fuse-before.log"))
    finally:
        os.chdir(cwd)
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    try:
        os.makedirs(os.path.join(mnt, "before"), exist_ok=True)
        yield os.path.join(mnt, "before")
    finally:
        fuse_mount.stop(proc, mnt)


# -- the run ---------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="size of the sequential file (default 256 MiB)")
    ap.add_argument("--files", type=int, default=1000, help="files of the metadata loop (default 1000)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds of each fio run")
    ap.add_argument("--storage", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--no-gluster", action="store_true")
    ap.add_argument("--install-gluster", action="store_true", help="apt-get install GlusterFS if missing")
    ap.add_argument("--mount-args", default="", help="extra `threefs mount` options, e.g. '--no-keep-cache'")
    ap.add_argument("--before-tree", default="",
                    help="a checkout of an older threefs (e.g. `git archive REV | tar -x -C DIR`): its FUSE "
                         "daemon mounts the same cluster too, as a 'threefs before' column")
    args = ap.parse_args()
    nbytes = args.mib * MiB
    load_before = open("/proc/loadavg").read().split()[:3]
    with tempfile.TemporaryDirectory(prefix="threefs-battery-", dir=os.environ.get("TMPDIR")) as tmp:
        source = os.path.join(tmp, "source.bin")
        with open(source, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(MiB))
        local = os.path.join(tmp, "local")
        os.makedirs(local)
        with contextlib.ExitStack() as stack:
            targets = {"local disk": local}
            gluster_why = "--no-gluster" if args.no_gluster else gluster_missing()
            if gluster_why and args.install_gluster and not args.no_gluster:
                install_gluster()
                gluster_why = gluster_missing()
            if not gluster_why:
                try:
                    targets["GlusterFS"] = stack.enter_context(gluster_volume(tmp))
                except Exception as e:
                    gluster_why = f"GlusterFS could not run here: {e}"
            cluster, mnt = stack.enter_context(local_cluster(tmp, args.storage, args.replicas, fuse=True,
                                                             mount_args=args.mount_args.split()))
            if mnt is None:
                raise SystemExit("threefs could not mount (FUSE unavailable); nothing to compare")
            if args.before_tree:
                targets["threefs before"] = stack.enter_context(before_mount(cluster, tmp, args.before_tree))
            targets["threefs"] = mnt
            results = {name: [] for name in targets}
            names = list(targets)
            for r in range(args.rounds):
                # Each round starts at the next system: a system measured right after another one's writes
                # shares the disk with their writeback (the same tree measured twice in a row, fixed order:
                # the second got 0.63x on dd write, 0.59x on buffered fio, within one run)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    print(f"round {r + 1}/{args.rounds}: {name} ...", flush=True)
                    results[name].append(battery_round(targets[name], source, nbytes, args.files, args.seconds))
        before_log = os.path.join(tmp, "fuse-before.log")
        if os.path.exists(before_log):
            print("threefs before: daemon", next((x.strip() for x in open(before_log) if "requests served" in x), "?"))
        fuse_log = os.path.join(tmp, "fuse.log")
        served = [line.strip() for line in open(fuse_log) if "requests served" in line] if os.path.exists(
            fuse_log) else []
    load_after = open("/proc/loadavg").read().split()[:3]
    report(results, gluster_why, args, load_before, load_after, served)


def report(results, gluster_why, args, load_before, load_after, served) -> None:
    med = {name: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
           for name, rounds in results.items() if rounds}
    names = list(med)
    print(f"\n{args.mib} MiB file, {args.files} files, median of {args.rounds} rounds; threefs: "
          f"{args.storage} storage services, R={args.replicas}; load average before {' '.join(load_before)}, "
          f"after {' '.join(load_after)}")
    if gluster_why:
        print(f"GlusterFS column skipped: {gluster_why}")
    head = f"{'test':<42}" + "".join(f"{n:>14}" for n in names) + f"{'unit':>10}"
    if "threefs before" in med:
        head += f"{'after/before':>14}"
    if "GlusterFS" in med:
        head += f"{'threefs/Gluster':>17}{'goal':>7}"
    print(head)
    for key, label, unit, goal in ROWS:
        if not all(key in med[n] for n in names):
            continue
        line = f"{label:<42}" + "".join(f"{med[n][key]:>14,.0f}" for n in names) + f"{unit:>10}"
        if "threefs before" in med:
            line += f"{med['threefs'][key] / med['threefs before'][key]:>13.2f}x"
        if "GlusterFS" in med:
            ratio = med["threefs"][key] / med["GlusterFS"][key]
            line += f"{ratio:>16.2f}x{'>=' + str(goal):>7} {'met' if ratio >= goal else 'NOT met'}"
        print(line)
    for line in served:
        print("threefs daemon:", line[line.find("requests served"):])


if __name__ == "__main__":
    main()
