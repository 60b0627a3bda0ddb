"""Client IO side by side in one run: batch API, file objects and the FUSE mount, against the loopback
TCP ceiling and the same data read from local disk.

    .venv/bin/python benchmarks/client_io.py [--mib 512] [--storage 3] [--replicas 3] [--no-fuse]

Sequential write and read of one file (1 MiB pieces; FUSE with dd, and fio when installed), then random
4 KiB and 64 KiB reads. Baselines: `loopback_gbps` of benchmarks/throughput.py (a bare Python TCP
stream, measured before and after), a local file on this machine's disk (page cache dropped with
posix_fadvise before each cold read), the loopback stream again in each sequential round (the goal's
ratio is also printed round by round), and the reference server of benchmarks/refserver.py (three plain
Python server processes preadv-ing the same data from the page cache, 64 IOs per request: what Python
can do here). Sequential reads run in 3 interleaved rounds, best of each. Prints GB/s (10^9 B/s), IOPS, and the ratios the goals name:
FUSE sequential read / batch read (goal >= 0.8) and batch read / loopback (goal >= 0.8). The machine
is shared and noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from refserver import IOS_PER_REQUEST, RefServers, default_transport  # noqa: E402
from throughput import loopback_gbps  # noqa: E402

from benchmarks.common import local_cluster, process_cpu_s  # noqa: E402
from threefs.client.client import Client  # noqa: E402

MiB = 1 << 20
PIECE = MiB
BATCH_BYTES = 256 * MiB
RANDOM_IOS = 4096
RANDOM_SECONDS = 4
READ_ROUNDS = 3


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- threefs through the Python client ------------------------------------------------------------
def batch_write(fs: Client, path: str, data: memoryview, total: int) -> None:
    with fs.open(path, "wb"):
        pass
    per_batch = len(data) // PIECE
    for base in range(0, total, len(data)):
        fs.batch_write([(path, base + i * PIECE, data[i * PIECE:(i + 1) * PIECE]) for i in range(per_batch)])


def batch_read(fs: Client, path: str, buf: memoryview, total: int) -> None:
    attr = fs.stat(path)
    per_batch = len(buf) // PIECE
    for base in range(0, total, len(buf)):
        fs.batch_read([(attr, base + i * PIECE, buf[i * PIECE:(i + 1) * PIECE]) for i in range(per_batch)])


def file_write(fs: Client, path: str, data: memoryview, total: int) -> None:
    with fs.open(path, "wb") as f:
        for base in range(0, total, PIECE):
            f.write(data[base % len(data):base % len(data) + PIECE])


def file_read(fs: Client, path: str, buf: memoryview) -> None:
    with fs.open(path, "rb") as f:
        while f.readinto(buf[:PIECE]):
            pass


def random_offsets(total: int, size: int, count: int, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, total // size) * size for _ in range(count)]


STORAGE_PIDS: list[int] = []  # the cluster's storage processes (CPU per IO of the random batch reads)
CPU_NOTES: list[str] = []
ROUND_RATIOS: list[float] = []  # batch_read / loopback stream, measured back to back in each sequential round


def batch_random(fs: Client, path: str, total: int, size: int) -> float:
    attr = fs.stat(path)
    arena = memoryview(bytearray(RANDOM_IOS * size))
    offs = random_offsets(total, size, RANDOM_IOS)
    items = [(attr, o, arena[i * size:(i + 1) * size]) for i, o in enumerate(offs)]
    storage0, client0 = sum(map(process_cpu_s, STORAGE_PIDS)), time.process_time()
    runs, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < RANDOM_SECONDS:
        fs.batch_read(items)
        runs += 1
    ios = runs * RANDOM_IOS
    storage, client = sum(map(process_cpu_s, STORAGE_PIDS)) - storage0, time.process_time() - client0
    CPU_NOTES.append(f"batch_read random {size // 1024} KiB ({RANDOM_IOS} per batch), CPU per IO: storage "
                     f"{storage / ios * 1e6:.2f} us (all {len(STORAGE_PIDS)} services; each IO is served by one), "
                     f"client {client / ios * 1e6:.2f} us; storage {storage / (ios * size / 1e9):.2f} CPU-s per GB")
    return ios / (time.perf_counter() - t0)


def threads_random(fs: Client, path: str, total: int, size: int, threads: int, per_batch: int) -> float:
    """Aggregate IO/s of `threads` callers of one client, each reading batches of `per_batch` random IOs."""
    import threading

    attr = fs.stat(path)
    done = [0] * threads
    stop = time.perf_counter() + RANDOM_SECONDS

    def caller(k: int) -> None:
        arena = memoryview(bytearray(per_batch * size))
        offs = random_offsets(total, size, per_batch, seed=100 + k)
        items = [(attr, o, arena[i * size:(i + 1) * size]) for i, o in enumerate(offs)]
        while time.perf_counter() < stop:
            fs.batch_read(items)
            done[k] += per_batch

    t0 = time.perf_counter()
    workers = [threading.Thread(target=caller, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(done) / (time.perf_counter() - t0)


def file_random(fs: Client, path: str, total: int, size: int) -> float:
    offs = random_offsets(total, size, RANDOM_IOS)
    n, t0 = 0, time.perf_counter()
    with fs.open(path, "rb") as f:
        while time.perf_counter() - t0 < RANDOM_SECONDS and n < len(offs):
            f.seek(offs[n])
            f.read(size)
            n += 1
    return n / (time.perf_counter() - t0)


# -- FUSE and local disk through standard tools ---------------------------------------------------
def dd(src: str, dst: str, total: int, flags: str = "") -> float:
    cmd = f"dd if={src} of={dst} bs=1M count={total // MiB} {flags} status=none"
    return timed(lambda: subprocess.run(cmd, shell=True, check=True))


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd) if os.access(path, os.W_OK) else None
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fio(path: str, rw: str, bs: str, depth: int, size: int) -> dict | None:
    if shutil.which("fio") is None:
        return None
    cmd = ["fio", "--name=j", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--size={size}",
           "--ioengine=libaio", f"--iodepth={depth}", "--direct=1", f"--runtime={RANDOM_SECONDS}",
           "--time_based", "--output-format=json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        return None
    job = json.loads(r.stdout)["jobs"][0]["read"]
    return {"gbps": job["bw_bytes"] / 1e9, "iops": job["iops"]}


def pread_random(path: str, total: int, size: int) -> float:
    offs = random_offsets(total, size, RANDOM_IOS)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < RANDOM_SECONDS and n < len(offs):
            os.pread(fd, size, offs[n])
            n += 1
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def pread_random_warm(path: str, total: int, size: int) -> float:
    """qd1 preads of offsets read once before (their pages cached): IOPS."""
    offs = random_offsets(total, size, RANDOM_IOS)
    fd = os.open(path, os.O_RDONLY)
    try:
        for o in offs:
            os.pread(fd, size, o)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < RANDOM_SECONDS / 2:
            os.pread(fd, size, offs[n % len(offs)])
            n += 1
        return n / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def run(fs: Client, mnt: str | None, tmp: str, total: int) -> list[tuple[str, str, float]]:
    """[(group, name, value)]: GB/s for sequential rows, IOPS for random rows."""
    data = memoryview(os.urandom(BATCH_BYTES if total >= BATCH_BYTES else total))
    buf = memoryview(bytearray(len(data)))
    out = []
    local = os.path.join(tmp, "local.bin")
    with open(local, "wb") as f:
        for base in range(0, total, len(data)):
            f.write(data[:min(len(data), total - base)])
    out.append(("write", "batch_write (1 MiB items)", gbps(total, timed(lambda: batch_write(fs, "/seq-b", data, total)))))
    out.append(("write", "file object write(1 MiB)", gbps(total, timed(lambda: file_write(fs, "/seq-f", data, total)))))
    if mnt:
        out.append(("write", "FUSE dd bs=1M", gbps(total, dd(local, f"{mnt}/seq-d", total))))
    ref = RefServers(local, IOS_PER_REQUEST * PIECE).__enter__()
    # The read buffer's pages touched once, after the reference servers' fork (which makes every page of
    # this process copy-on-write again) and before any timed read: the first write of each page faults,
    # ~1 ms per MiB on this VM, and that was round 1's batch_read (~0.9 GB/s against ~3 in the rounds after;
    # 278 against 78-82 ms for 256 MiB), while the loopback stream it is compared with reads into a 4 MiB
    # buffer, hot after its first pass.
    buf[:] = data
    seq_ios = [(o, PIECE) for o in range(0, total, PIECE)]
    reads = {  # interleaved rounds, best of each: the machine is shared and noisy
        "local disk dd bs=1M (cold)": lambda: (drop_cache(local), dd(local, "/dev/null", total))[1],
        "reference server (1 MiB IOs)": lambda: len(seq_ios) / ref.read(seq_ios, None),
        "batch_read (1 MiB items)": lambda: timed(lambda: batch_read(fs, "/seq-b", buf, total)),
        "file object readinto(1 MiB)": lambda: timed(lambda: file_read(fs, "/seq-b", buf)),
    }
    if mnt:
        # the kernel keeps a file's pages across opens (close-to-open): "cold" drops them first
        reads["FUSE dd bs=1M (page cache dropped)"] = lambda: (drop_cache(f"{mnt}/seq-b"),
                                                               dd(f"{mnt}/seq-b", "/dev/null", total))[1]
        reads["FUSE dd bs=1M"] = lambda: dd(f"{mnt}/seq-b", "/dev/null", total)
        reads["FUSE dd bs=4M iflag=direct"] = lambda: dd(f"{mnt}/seq-b", "/dev/null", total, "iflag=direct")
    # the loopback stream once per round too, right before batch_read: on a shared machine the ceiling moves
    # by 2-3x within a minute, so the goal's ratio is taken round by round (before/after stay for reference)
    reads = {"loopback TCP stream (this round)": lambda: total / 1e9 / loopback_gbps(total), **reads}
    best = {name: 0.0 for name in reads}
    for _ in range(READ_ROUNDS):
        this = {}
        for name, fn in reads.items():
            this[name] = gbps(total, fn())
            best[name] = max(best[name], this[name])
        ROUND_RATIOS.append(this["batch_read (1 MiB items)"] / this["loopback TCP stream (this round)"])
        CPU_NOTES.append(f"sequential round {len(ROUND_RATIOS)}: loopback {this['loopback TCP stream (this round)']:.2f} "
                         f"GB/s, batch_read {this['batch_read (1 MiB items)']:.2f} GB/s, ratio {ROUND_RATIOS[-1]:.2f}; "
                         f"load {os.getloadavg()[0]:.1f}")
    out += [("read", name, v) for name, v in best.items()]
    for size in (4096, 65536):
        label = f"{size // 1024} KiB"
        out.append((f"rand {label}", "local disk pread qd1 (cold)", pread_random(local, total, size)))
        out.append((f"rand {label}", "reference server", ref.read(
            [(o, size) for o in random_offsets(total, size, RANDOM_IOS)], RANDOM_SECONDS)))
        out.append((f"rand {label}", f"batch_read ({RANDOM_IOS} per batch)", batch_random(fs, "/seq-b", total, size)))
        for threads in (1, 4):
            out.append((f"rand {label}", f"batch_read 64 per batch, {threads} thread{'s' * (threads > 1)}",
                        threads_random(fs, "/seq-b", total, size, threads, 64)))
        out.append((f"rand {label}", "file object seek+read qd1", file_random(fs, "/seq-b", total, size)))
        if mnt:
            out.append((f"rand {label}", "FUSE pread qd1", pread_random(f"{mnt}/seq-b", total, size)))
            out.append((f"rand {label}", "FUSE pread qd1, page cache warm",
                        pread_random_warm(f"{mnt}/seq-b", total, size)))
            r = fio(f"{mnt}/seq-b", "randread", f"{size // 1024}k", 32, total)
            if r:
                out.append((f"rand {label}", "FUSE fio libaio qd32 direct", r["iops"]))
            r = fio(local, "randread", f"{size // 1024}k", 32, total)
            if r:
                out.append((f"rand {label}", "local disk fio libaio qd32 direct", r["iops"]))
    ref.__exit__(None, None, None)
    return out


def report(rows, ceiling_before: float, ceiling_after: float, total: int, args) -> None:
    ceiling = (ceiling_before + ceiling_after) / 2
    print(f"data: {total // MiB} MiB, {args.storage} storage services, R={args.replicas}, 1 MiB chunks")
    print(f"{'loopback TCP ceiling (before / after)':<48} {ceiling_before:7.2f} / {ceiling_after:.2f} GB/s")
    print(f"transport of threefs's clients and the reference server on this host: {default_transport()} "
          "(THREEFS_RPC_LOCAL=0: tcp)")
    value = {name: v for _, name, v in rows}
    value.update({f"{name}@{group[5:]}": v for group, name, v in rows if group.startswith("rand ")})
    for group, name, v in rows:
        unit = "GB/s" if group in ("read", "write") else "IOPS"
        extra = f"   {v / ceiling:5.2f}x ceiling" if unit == "GB/s" else f"   {v * int(group.split()[1]) * 1024 / 1e9:6.3f} GB/s"
        print(f"{group:<11} {name:<36} {v:10.2f} {unit}{extra}")
    batch = value.get("batch_read (1 MiB items)")
    if batch:
        print(f"goal: batch read / loopback ceiling = {batch / ceiling:.2f} (>= 0.8; before/after average)")
        if ROUND_RATIOS:
            r = sorted(ROUND_RATIOS)
            print(f"goal: batch read / loopback stream of the same round = {r[len(r) // 2]:.2f} median "
                  f"({', '.join(f'{x:.2f}' for x in ROUND_RATIOS)}) (>= 0.8)")
        fuse = value.get("FUSE dd bs=1M (page cache dropped)")
        if fuse:
            print(f"goal: FUSE sequential read (page cache dropped) / batch read = {fuse / batch:.2f} (>= 0.8); "
                  f"direct IO: {value['FUSE dd bs=4M iflag=direct'] / batch:.2f}; "
                  f"page cache warm: {value['FUSE dd bs=1M'] / batch:.2f}")
    for size in ("4 KiB",):
        mine, fuse = value.get(f"batch_read ({RANDOM_IOS} per batch)@{size}"), value.get(
            f"FUSE fio libaio qd32 direct@{size}")
        if mine and fuse:
            print(f"goal: FUSE fio qd32 direct {size} / batch_read = {fuse / mine:.2f} (>= 0.5)")
        print(f"file object read / batch read = {value['file object readinto(1 MiB)'] / batch:.2f}")
        print(f"goal: batch read / reference server = {batch / value['reference server (1 MiB IOs)']:.2f} (>= 0.9)")
    for note in CPU_NOTES:
        print(note)
    for size in ("4 KiB", "64 KiB"):
        mine, ref = value.get(f"batch_read ({RANDOM_IOS} per batch)@{size}"), value.get(f"reference server@{size}")
        if mine and ref:
            print(f"goal: batch_read random {size} / reference server = {mine / ref:.2f} (>= 0.7)")
        one, four = (value.get(f"batch_read 64 per batch, {t}@{size}") for t in ("1 thread", "4 threads"))
        if one and four:
            print(f"batch_read random {size}, 64 per batch: 4 threads / 1 thread = {four / one:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--storage", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--no-fuse", action="store_true")
    args = ap.parse_args()
    total = max(BATCH_BYTES, args.mib * MiB) // BATCH_BYTES * BATCH_BYTES
    with tempfile.TemporaryDirectory(prefix="threefs-client-io-", dir=os.environ.get("TMPDIR")) as tmp:
        with local_cluster(tmp, args.storage, args.replicas, fuse=not args.no_fuse) as (cluster, mnt):
            STORAGE_PIDS[:] = [pid for name, pid in cluster.running().items() if name.startswith("storage")]
            with Client.connect(str(cluster.client_config_path)) as fs:
                before = loopback_gbps(total)
                rows = run(fs, mnt, tmp, total)
                after = loopback_gbps(total)
    report(rows, before, after, total, args)


if __name__ == "__main__":
    main()
