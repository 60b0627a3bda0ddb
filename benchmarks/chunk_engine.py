"""Chunk engine v1 vs v2, side by side on the same data in one run (the engine alone: no RPC).

    .venv/bin/python benchmarks/chunk_engine.py [--mib 128] [--rounds 5] [--seconds 0.5] [--open-chunks 1000000]

Rows (1 MiB chunks unless said):
  * seq write: full 1 MiB chunks, write + commit (as a storage target does at R=1), GB/s; reference: a
    plain local file written with 1 MiB pwrite of new data (same directory, page cache);
  * seq read: whole chunks into one buffer, GB/s; reference: pread of the local file;
  * random 4 KiB / 64 KiB reads into a caller's buffer (nowait first, as the service serves page-cache
    hits inline), IOPS; reference: os.pread of the local file;
  * random 4 KiB / 64 KiB reads in batches of 64, as the storage service serves a packed read: v2 looks up
    every chunk of the batch under one lock (`read_locations`) and preadv's each IO from the data file; v1
    has no batch call, so the service (and this row) reads each IO with `read`; reference: 64 os.preadv;
  * 64 KiB writes into 1 MiB chunks at random 64 KiB-aligned offsets, write + commit, IOPS;
  * start-up: reopen the target (v1 replays its log, v2 opens SQLite), seconds;
  * with --open-chunks N: a v2 target of N chunks of 512 B (bulk-loaded with engine.batch()) reopened.
Column "v1 no fd cache": v1 as it was when issue 16 was filed, opening and closing the version file for
every read (its descriptor cache, added since, set to 0 entries); the v2/v1 ratio is against today's v1.
Each metric is sampled --rounds times with the order of local file / v1 / v2 rotating, and the medians are
printed: the machine is shared and its load drifts; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from threefs.storage.chunk_engine import ChunkEngine  # noqa: E402
from threefs.storage.chunk_engine_v2 import ChunkEngineV2  # noqa: E402
from threefs.storage.version_files import FdCache  # noqa: E402

MiB = 1 << 20
CHUNK = MiB


def cid(i: int) -> bytes:
    return bytes(8) + i.to_bytes(8, "big")


def timed_loop(seconds: float, step) -> float:
    """Ops per second of step() (called in bursts of 64) for about `seconds`."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(64):
            step()
        n += 64
    return n / (time.perf_counter() - t0)


class EngineRunner:
    """One engine's side of each metric (the local file has the same methods)."""

    def __init__(self, eng, chunks: int, payload: bytes, seed: int):
        self.eng, self.chunks, self.payload = eng, chunks, payload
        self.rng = random.Random(seed)
        self.buf = memoryview(bytearray(CHUNK))
        self.versions: dict[int, int] = {}
        self.fresh = 0  # next id of a new chunk (sequential-write rounds add new ones)
        self.write_new(chunks)

    def write_new(self, count: int) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            i, self.fresh = self.fresh, self.fresh + 1
            self.eng.write(cid(i), update_ver=1, chain_ver=1, offset=0, data=self.payload, chunk_size=CHUNK)
            self.eng.commit(cid(i), 1)
        return count * CHUNK / (time.perf_counter() - t0) / 1e9

    def read_all(self) -> float:
        t0 = time.perf_counter()
        for i in range(self.chunks):
            self.eng.read(cid(i), 0, CHUNK, self.buf)
        return self.chunks * CHUNK / (time.perf_counter() - t0) / 1e9

    def random_reads(self, size: int, seconds: float) -> float:
        view, eng, rng, chunks = self.buf[:size], self.eng, self.rng, self.chunks

        def one():
            c, off = cid(rng.randrange(chunks)), rng.randrange(CHUNK - size)
            try:
                eng.read(c, off, size, view, nowait=True)
            except BlockingIOError:
                eng.read(c, off, size, view)

        return timed_loop(seconds, one)

    def batched_reads(self, size: int, seconds: float, batch: int = 64) -> float:
        """IOPS of random reads in batches, each read the way the storage service reads it."""
        view, eng, rng, chunks = self.buf[:size], self.eng, self.rng, self.chunks
        batched = hasattr(eng, "read_locations")

        def one_batch():
            picks = [(cid(rng.randrange(chunks)), rng.randrange(CHUNK - size)) for _ in range(batch)]
            if not batched:
                for c, off in picks:
                    try:
                        eng.read(c, off, size, view, nowait=True)
                    except BlockingIOError:
                        eng.read(c, off, size, view)
                return
            locs, epoch = eng.read_locations([c for c, _ in picks])
            try:
                for loc, (c, off) in zip(locs, picks):
                    if not loc:  # a hole or a chunk the general path must read (not in this data)
                        eng.read(c, off, size, view)
                        continue
                    fd, base, length = loc[0], loc[1], loc[2]
                    n = min(size, length - off)
                    try:
                        got = os.preadv(fd, (view[:n],), base + off, os.RWF_NOWAIT)
                    except BlockingIOError:
                        got = os.preadv(fd, (view[:n],), base + off)
                    if got != n:
                        raise OSError(f"short read of chunk {c.hex()}")
            finally:
                eng.end_reads(epoch)

        return batch * timed_loop(seconds, one_batch)

    def sub_writes(self, seconds: float) -> float:
        piece, eng, rng = self.payload[:65536], self.eng, self.rng

        def one():
            i = rng.randrange(self.chunks)
            ver = self.versions.get(i, 1) + 1
            self.versions[i] = ver
            eng.write(cid(i), update_ver=ver, chain_ver=1, offset=rng.randrange(16) * 65536, data=piece,
                      chunk_size=CHUNK)
            eng.commit(cid(i), ver)

        return timed_loop(seconds, one)


class LocalFile:
    """The reference: one plain local file, pwrite/pread at chunk offsets (page cache)."""

    def __init__(self, path: str, chunks: int, payload: bytes, seed: int):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.chunks, self.payload = chunks, payload
        self.rng = random.Random(seed)
        self.buf = memoryview(bytearray(CHUNK))
        self.fresh = 0
        self.write_new(chunks)

    def write_new(self, count: int) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            os.pwrite(self.fd, self.payload, self.fresh * CHUNK)
            self.fresh += 1
        return count * CHUNK / (time.perf_counter() - t0) / 1e9

    def read_all(self) -> float:
        t0 = time.perf_counter()
        for i in range(self.chunks):
            os.preadv(self.fd, [self.buf], i * CHUNK)
        return self.chunks * CHUNK / (time.perf_counter() - t0) / 1e9

    def random_reads(self, size: int, seconds: float) -> float:
        view, span = self.buf[:size], self.chunks * CHUNK - size
        return timed_loop(seconds, lambda: os.preadv(self.fd, [view], self.rng.randrange(span)))

    def batched_reads(self, size: int, seconds: float, batch: int = 64) -> float:
        view, span, rng, fd = self.buf[:size], self.chunks * CHUNK - size, self.rng, self.fd

        def one_batch():
            for off in [rng.randrange(span) for _ in range(batch)]:
                os.preadv(fd, [view], off)

        return batch * timed_loop(seconds, one_batch)

    def sub_writes(self, seconds: float) -> float:
        piece = self.payload[:65536]
        return timed_loop(seconds, lambda: os.pwrite(self.fd, piece, self.rng.randrange(self.chunks * 16) * 65536))


def run_rounds(runners: dict, rounds: int, seconds: float, write_chunks: int) -> dict:
    """Every metric, `rounds` times, the order of the contenders rotating each round; medians."""
    metrics = {
        "seq write GB/s": lambda r: r.write_new(write_chunks),
        "seq read GB/s": lambda r: r.read_all(),
        "random 4 KiB read IOPS": lambda r: r.random_reads(4096, seconds),
        "random 64 KiB read IOPS": lambda r: r.random_reads(65536, seconds),
        "random 4 KiB, 64 per batch IOPS": lambda r: r.batched_reads(4096, seconds),
        "random 64 KiB, 64 per batch IOPS": lambda r: r.batched_reads(65536, seconds),
        "64 KiB write into 1 MiB IOPS": lambda r: r.sub_writes(seconds),
    }
    names = list(runners)
    samples = {m: {n: [] for n in names} for m in metrics}
    for k in range(rounds):
        order = names[k % len(names):] + names[:k % len(names)]
        for metric, fn in metrics.items():
            for name in order:
                samples[metric][name].append(fn(runners[name]))
    return {m: {n: statistics.median(v) for n, v in per.items()} for m, per in samples.items()}


def open_time(cls, path: str) -> float:
    t0 = time.perf_counter()
    eng = cls(path)
    seconds = time.perf_counter() - t0
    eng.close()
    return seconds


def million(path: str, count: int) -> tuple[float, float]:
    """(seconds to bulk-load, seconds to reopen) a v2 target of `count` 512-byte chunks."""
    data = os.urandom(512)
    t0 = time.perf_counter()
    eng = ChunkEngineV2(path)
    step = 20_000
    for start in range(0, count, step):
        with eng.batch():
            for i in range(start, min(count, start + step)):
                eng.write(cid(i), update_ver=1, chain_ver=1, offset=0, data=data, chunk_size=CHUNK)
                eng.commit(cid(i), 1)
    eng.close()
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng = ChunkEngineV2(path)
    reopen = time.perf_counter() - t0
    assert eng.chunk_count() == count
    last = eng.iter_metas(reverse=True, limit=1)[0]
    assert last.chunk_id == cid(count - 1)
    eng.close()
    return load, reopen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128, help="data per engine (1 MiB chunks)")
    ap.add_argument("--seconds", type=float, default=0.5, help="per random-IO sample")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--open-chunks", type=int, default=0, help="also open a v2 target of this many chunks")
    ap.add_argument("--dir", default=None, help="where targets go (default: a temporary directory)")
    args = ap.parse_args()
    payload = os.urandom(CHUNK)
    with tempfile.TemporaryDirectory(prefix="threefs-engine-bench-", dir=args.dir) as tmp:
        engines = {"v1": ChunkEngine(os.path.join(tmp, "v1")), "v2": ChunkEngineV2(os.path.join(tmp, "v2")),
                   "v1 no fd cache": ChunkEngine(os.path.join(tmp, "v1-nocache"))}
        engines["v1 no fd cache"]._files.fds = FdCache(0)  # open + pread + close per read, as v1 was
        try:
            runners = {"local file": LocalFile(os.path.join(tmp, "local.bin"), args.mib, payload, 1),
                       **{n: EngineRunner(e, args.mib, payload, 1) for n, e in engines.items()}}
            results = run_rounds(runners, args.rounds, args.seconds, max(8, args.mib // 4))
        finally:
            for e in engines.values():
                e.close()
        starts = {n: open_time(cls, os.path.join(tmp, n)) for n, cls in (("v1", ChunkEngine), ("v2", ChunkEngineV2))}
        loadavg = open("/proc/loadavg").read().split()[:3]
        print(f"{args.mib} x 1 MiB chunks per engine, medians of {args.rounds} rounds (order rotating); "
              f"load average {' '.join(loadavg)}")
        print(f"{'metric':<32} {'local file':>11} {'v1':>11} {'v2':>11} {'v2/v1':>7} {'v2/file':>8} "
              f"{'v1 no fd cache':>15} {'v2/it':>7}")
        for key, per in results.items():
            ref, a, b, c = per["local file"], per["v1"], per["v2"], per["v1 no fd cache"]
            print(f"{key:<32} {ref:11.2f} {a:11.2f} {b:11.2f} {b / a:6.2f}x {b / ref:7.2f}x {c:15.2f} {b / c:6.2f}x")
        print(f"{'start-up (s), this target':<32} {'':>11} {starts['v1']:11.3f} {starts['v2']:11.3f} "
              f"{starts['v1'] / starts['v2']:6.2f}x faster")
        if args.open_chunks:
            load, reopen = million(os.path.join(tmp, "million"), args.open_chunks)
            print(f"v2 target of {args.open_chunks} chunks: bulk load {load:.1f} s, reopen {reopen:.3f} s "
                  f"(load average {' '.join(open('/proc/loadavg').read().split()[:3])})")


if __name__ == "__main__":
    main()
