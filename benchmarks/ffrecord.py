"""FFRecord random batches through threefs, side by side with local disk and with small files on FUSE.

    .venv/bin/python benchmarks/ffrecord.py [--mib 128] [--seconds 1] [--batch 64] [--sizes 65536,1024]
                                            [--rounds 3] [--small-files 2048] [--storage 3] [--replicas 3]
                                            [--no-fuse] [--no-dataloader]

For each sample size: one .ffr file of `--mib` MiB written through the client to a local cluster
(N storage processes, R replicas, 1 MiB chunks) and the same file written to local disk; then random
batches (seeded, `--batch` samples each), `--rounds` interleaved rounds of `--seconds` per reader,
the best round counting:
  - local disk, plain os.pread per sample (no CRC)            <- the goal's baseline
  - local disk, os.pread + zlib.crc32 per sample
  - FileReader on the local file (client=None)
  - FileReader on threefs, CRC on / off (one batch_read per batch)
  - FileReader on the .ffr file through the FUSE mount (os.preadv per sample)
  - the same samples as individual small files on the FUSE mount (open/read/close per sample;
    `--small-files` of them, spread over directories of 1000)
  - the reference server of benchmarks/refserver.py (three plain Python processes preadv-ing the local
    file) reading the samples of the same seeded batches, batch by batch       <- issue 15's baseline
  - FFRecordDataset + DataLoader, in-process and with 2 forked workers, threefs (whole pipeline, CRC on),
    with the CPU per batch of the main process, each worker and the storage services
Local files are read warm (just written, page cache), as the storage services' chunk files are.
Prints samples/s and GB/s (10^9 B/s) per row and the ratio to the local os.pread reader. The machine
is shared and noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from refserver import IOS_PER_REQUEST, RefServers  # noqa: E402

from benchmarks.common import local_cluster  # noqa: E402
from threefs.client.client import Client  # noqa: E402
from threefs.ffrecord import FileReader, FileWriter  # noqa: E402

MiB = 1 << 20
SMALL_FILES_PER_DIR = 1000
WRITE_BATCH_FILES = 256  # small files created per batch_write


def batches(n: int, batch: int, seed: int):
    """An endless stream of seeded random batches of indices."""
    rng = np.random.default_rng(seed)
    while True:
        yield rng.integers(0, n, batch)


def timed_rate(fn, n: int, batch: int, seconds: float, sizes: np.ndarray) -> tuple[float, float]:
    """(samples/s, GB/s) of fn(indices) over random batches for about `seconds`."""
    fn(np.arange(min(batch, n)))  # warm up connections and buffers
    count = nbytes = 0
    t0 = time.perf_counter()
    for idx in batches(n, batch, seed=n):
        fn(idx)
        count += len(idx)
        nbytes += int(sizes[idx].sum())
        if time.perf_counter() - t0 >= seconds:
            break
    dt = time.perf_counter() - t0
    return count / dt, nbytes / dt / 1e9


def make_samples(n: int, size: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(size)
    block = rng.integers(0, 256, size * min(n, 4096), dtype=np.uint8).tobytes()
    samples = [block[(i % 4096) * size:(i % 4096 + 1) * size] for i in range(n)]
    return samples, np.full(n, size, dtype=np.int64)


def write_ffr(path: str, samples: list[bytes], client=None) -> float:
    t0 = time.perf_counter()
    with FileWriter(path, len(samples), client=client) as w:
        for s in samples:
            w.write_one(s)
    return time.perf_counter() - t0


def write_small_files(fs: Client, base: str, samples: list[bytes]) -> list[str]:
    paths = [f"{base}/d{i // SMALL_FILES_PER_DIR:04d}/{i:07d}.bin" for i in range(len(samples))]
    for k in range(0, len(paths), SMALL_FILES_PER_DIR):
        fs.mkdir(os.path.dirname(paths[k]), parents=True, exist_ok=True)
    for k in range(0, len(paths), WRITE_BATCH_FILES):
        fs.batch_write([(p, 0, samples[i]) for i, p in enumerate(paths[k:k + WRITE_BATCH_FILES], k)],
                       create=True)
    return paths


# -- the readers compared -------------------------------------------------------------------------
def pread_reader(path: str, offsets: np.ndarray, crc: np.ndarray | None):
    fd = os.open(path, os.O_RDONLY)
    starts, ends = offsets[:-1].tolist(), offsets[1:].tolist()
    expected = None if crc is None else crc.tolist()

    def read(idx):
        out = []
        for i in idx.tolist():
            b = os.pread(fd, ends[i] - starts[i], starts[i])
            if expected is not None and zlib.crc32(b) != expected[i]:
                raise ValueError(f"sample {i} checksum mismatch")
            out.append(b)
        return out
    return read, lambda: os.close(fd)


def small_file_reader(paths: list[str]):
    def read(idx):
        out = []
        for i in idx.tolist():
            with open(paths[i], "rb", buffering=0) as f:
                out.append(f.read())
        return out
    return read


TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pids) -> float:
    """CPU seconds (user + system, all threads) the processes used so far."""
    total = 0
    for pid in pids:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICK


def dataloader_rate(fs: Client, path: str, n: int, batch: int, seconds: float, size: int,
                    storage_pids: list[int], workers: int = 2) -> tuple[float, float, str]:
    """(samples/s, GB/s, CPU per batch of the main process, each worker and the storage services)."""
    from threefs.ffrecord.torch import DataLoader, FFRecordDataset

    loader = DataLoader(FFRecordDataset(path, client=fs), batch_size=batch, shuffle=True, seed=1,
                        num_workers=workers, collate_fn=lambda b: len(b), persistent_workers=workers > 0)
    count, batches, t0 = 0, 0, None
    while t0 is None or time.perf_counter() - t0 < seconds:
        for got in loader:
            if t0 is None:  # the first batch includes starting the workers
                t0 = time.perf_counter()
                pids = [w.pid for w in loader._iterator._workers] if workers else []
                cpu0 = [proc_cpu([os.getpid()]), *(proc_cpu([p]) for p in pids), proc_cpu(storage_pids)]
                continue
            count += got
            batches += 1
            if time.perf_counter() - t0 >= seconds:
                break
    dt = time.perf_counter() - t0
    cpu = [proc_cpu([os.getpid()]), *(proc_cpu([p]) for p in pids), proc_cpu(storage_pids)]
    us = [(b - a) / max(1, batches) * 1e6 for a, b in zip(cpu0, cpu)]
    names = ["main", *(f"worker {i}" for i in range(len(pids))), "storage"]
    note = "CPU us/batch: " + ", ".join(f"{k} {v:,.0f}" for k, v in zip(names, us))
    note += f" (total {sum(us):,.0f}; {sum(us) * batches / dt / 1e6:.2f} cores busy)"
    del loader
    return count / dt, count * size / dt / 1e9, note


def run_size(fs: Client, tmp: str, mnt: str | None, size: int, args,
             storage_pids: list[int]) -> list[tuple[str, float, float]]:
    n = max(args.batch, args.mib * MiB // size)
    samples, sizes = make_samples(n, size)
    local, remote = os.path.join(tmp, f"s{size}.ffr"), f"/bench/s{size}.ffr"
    t_local, t_remote = write_ffr(local, samples), write_ffr(remote, samples, fs)
    print(f"{size} B samples: {n} ({n * size / MiB:.0f} MiB); write local {n * size / t_local / 1e9:.2f} GB/s, "
          f"threefs {n * size / t_remote / 1e9:.2f} GB/s", flush=True)
    reader = FileReader(local)
    offsets, crc = reader.get_offsets(0), reader.get_checksums(0)
    plain, close_plain = pread_reader(local, offsets, None)
    checked, close_checked = pread_reader(local, offsets, crc)
    readers = [reader, FileReader(remote, True, client=fs), FileReader(remote, False, client=fs)]
    rows = {  # name: (read(indices), how many samples it may pick from)
        "local disk os.pread (no CRC)": (plain, n),
        "local disk os.pread + crc32": (checked, n),
        "FileReader local file, CRC on": (reader.read, n),
        "FileReader threefs, CRC on": (readers[1].read, n),
        "FileReader threefs, CRC off": (readers[2].read, n),
    }
    if mnt:
        readers.append(FileReader(mnt + remote))
        rows["FileReader on FUSE mount, CRC on"] = (readers[-1].read, n)
        k = min(n, args.small_files)
        paths = write_small_files(fs, f"/bench/small{size}", samples[:k])
        rows[f"small files on FUSE ({k}), open+read"] = (small_file_reader([mnt + p for p in paths]), k)
    # the reference server (benchmarks/refserver.py) reading the samples of the same seeded batches
    ref = RefServers(local, IOS_PER_REQUEST * size).__enter__()
    gen = batches(n, args.batch, seed=n)
    ref_idx = np.concatenate([next(gen) for _ in range(max(1, 4096 // args.batch))])
    ref_ios = list(zip(offsets[ref_idx].tolist(), sizes[ref_idx].tolist()))
    ref_name = f"reference server, same offsets (batch {args.batch}, {ref.transport})"

    def ref_rate():
        rate = ref.read(ref_ios, args.seconds, batch=args.batch)
        return rate, rate * size / 1e9
    best = {name: (0.0, 0.0) for name in [ref_name, *rows]}
    paired = []  # per round: threefs CRC on / the reference measured just before it
    for _ in range(args.rounds):  # interleaved rounds, best of each: the machine is shared and noisy
        for name, (fn, count) in rows.items():
            if name == "FileReader threefs, CRC on":
                got_ref = ref_rate()
                best[ref_name] = max(best[ref_name], got_ref)
            got = timed_rate(fn, count, args.batch, args.seconds, sizes)
            best[name] = max(best[name], got)
            if name == "FileReader threefs, CRC on":
                paired.append(got[0] / got_ref[0])
    notes = [f"FileReader threefs CRC on / reference measured just before it, per round: "
             f"{', '.join(f'{r:.2f}' for r in paired)} (median {float(np.median(paired)):.2f})"]
    ref.__exit__(None, None, None)
    close_plain(), close_checked()
    for r in readers:
        r.close()
    out = [(name, *best[name]) for name in [*rows, ref_name]]
    if not args.no_dataloader:
        best = {0: (0.0, 0.0, ""), 2: (0.0, 0.0, "")}
        paired = []
        for _ in range(args.rounds):  # interleaved rounds here too, the best of each
            got = {}
            for workers in best:
                got[workers] = dataloader_rate(fs, remote, n, args.batch, args.seconds, size, storage_pids,
                                               workers=workers)
                best[workers] = max(best[workers], got[workers])
            paired.append(got[2][0] / got[0][0])
        out.append(("DataLoader in-process, threefs, CRC on", *best[0][:2]))
        out.append(("DataLoader 2 workers, threefs, CRC on", *best[2][:2]))
        notes += [f"DataLoader 2 workers / in-process just before, per round: "
                  f"{', '.join(f'{r:.2f}' for r in paired)} (median {float(np.median(paired)):.2f})",
                  f"DataLoader in-process (best round): {best[0][2]}",
                  f"DataLoader 2 workers (best round): {best[2][2]}"]
    return out, notes


def report(size: int, rows: list[tuple[str, float, float]], notes: list[str]) -> None:
    base = rows[0][1]
    print(f"\n== random batches of {size} B samples ==")
    print(f"{'reader':<42} {'samples/s':>11} {'GB/s':>7} {'x local pread':>14}")
    for name, rate, gbps in rows:
        print(f"{name:<42} {rate:>11,.0f} {gbps:>7.3f} {rate / base:>13.2f}x")
    best = max(r for name, r, _ in rows if name.startswith("FileReader threefs"))
    print(f"goal: threefs FileReader / local os.pread = {best / base:.2f} (>= 1.0)")
    rate = {name: r for name, r, _ in rows}
    ref = next(r for name, r, _ in rows if name.startswith("reference server"))
    print(f"goal: threefs FileReader CRC on / reference server = {rate['FileReader threefs, CRC on'] / ref:.2f} (>= 0.7)")
    one, two = rate.get("DataLoader in-process, threefs, CRC on"), rate.get("DataLoader 2 workers, threefs, CRC on")
    if one and two:
        print(f"goal: DataLoader 2 workers / in-process = {two / one:.2f} (>= 1.5)")
    for note in notes:
        print("  " + note)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128, help="dataset size per sample size")
    ap.add_argument("--seconds", type=float, default=1.0, help="per measured row and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each row counts")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--sizes", default="65536,1024", help="sample sizes in bytes")
    ap.add_argument("--small-files", type=int, default=2048, help="samples also written as single files")
    ap.add_argument("--storage", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--no-fuse", action="store_true")
    ap.add_argument("--no-dataloader", action="store_true")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="threefs-ffrecord-", dir=os.environ.get("TMPDIR")) as tmp:
        with local_cluster(tmp, args.storage, args.replicas, fuse=not args.no_fuse) as (cluster, mnt):
            storage_pids = [pid for name, pid in cluster.running().items() if name.startswith("storage")]
            with Client.connect(str(cluster.client_config_path)) as fs:
                fs.mkdir("/bench")
                for size in (int(s) for s in args.sizes.split(",")):
                    results.append((size, *run_size(fs, tmp, mnt, size, args, storage_pids)))
    print(f"\n{args.storage} storage services, R={args.replicas}, batch {args.batch}, best of {args.rounds} "
          f"rounds of {args.seconds:g} s per row, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for size, rows, notes in results:
        report(size, rows, notes)


if __name__ == "__main__":
    main()
