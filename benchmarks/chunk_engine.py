"""Chunk engine v1 vs v2, side by side on the same data in one run (the engine alone: no RPC).

    .venv/bin/python benchmarks/chunk_engine.py [--mib 256] [--seconds 2] [--open-chunks 1000000]

Rows (1 MiB chunks unless said):
  * seq write: full 1 MiB chunks, write + commit (as a storage target does at R=1), GB/s; reference: a
    plain local file written with 1 MiB pwrite of new data (same directory, page cache);
  * seq read: whole chunks into one buffer, GB/s; reference: pread of the local file;
  * random 4 KiB / 64 KiB reads into a caller's buffer (nowait first, as the service serves page-cache
    hits inline), IOPS; reference: os.pread of the local file;
  * 64 KiB writes into 1 MiB chunks at random 64 KiB-aligned offsets, write + commit, IOPS;
  * start-up: reopen the target (v1 replays its log, v2 opens SQLite), seconds;
  * with --open-chunks N: a v2 target of N chunks of 512 B (bulk-loaded with engine.batch()) reopened.
The machine is shared: compare ratios within one run; the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from threefs.storage.chunk_engine import ChunkEngine  # noqa: E402
from threefs.storage.chunk_engine_v2 import ChunkEngineV2  # noqa: E402

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


def bench_engine(eng, chunks: int, seconds: float, payload: bytes, seed: int) -> dict:
    out = {}
    t0 = time.perf_counter()
    for i in range(chunks):
        eng.write(cid(i), update_ver=1, chain_ver=1, offset=0, data=payload, chunk_size=CHUNK)
        eng.commit(cid(i), 1)
    out["seq write GB/s"] = chunks * CHUNK / (time.perf_counter() - t0) / 1e9
    buf = memoryview(bytearray(CHUNK))
    t0 = time.perf_counter()
    for i in range(chunks):
        eng.read(cid(i), 0, CHUNK, buf)
    out["seq read GB/s"] = chunks * CHUNK / (time.perf_counter() - t0) / 1e9
    rng = random.Random(seed)
    for size in (4096, 65536):
        view = buf[:size]

        def one(size=size, view=view):
            c, off = cid(rng.randrange(chunks)), rng.randrange(CHUNK - size)
            try:
                eng.read(c, off, size, view, nowait=True)
            except BlockingIOError:
                eng.read(c, off, size, view)

        out[f"random {size // 1024} KiB read IOPS"] = timed_loop(seconds, one)
    piece = payload[:65536]
    versions = {}

    def sub_write():
        i = rng.randrange(chunks)
        ver = versions.get(i, 1) + 1
        versions[i] = ver
        eng.write(cid(i), update_ver=ver, chain_ver=1, offset=rng.randrange(16) * 65536, data=piece,
                  chunk_size=CHUNK)
        eng.commit(cid(i), ver)

    out["64 KiB write into 1 MiB IOPS"] = timed_loop(seconds, sub_write)
    return out


def bench_local(path: str, chunks: int, seconds: float, payload: bytes, seed: int) -> dict:
    out = {}
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        for i in range(chunks):
            os.pwrite(fd, payload, i * CHUNK)
        out["seq write GB/s"] = chunks * CHUNK / (time.perf_counter() - t0) / 1e9
        buf = memoryview(bytearray(CHUNK))
        t0 = time.perf_counter()
        for i in range(chunks):
            os.preadv(fd, [buf], i * CHUNK)
        out["seq read GB/s"] = chunks * CHUNK / (time.perf_counter() - t0) / 1e9
        rng = random.Random(seed)
        for size in (4096, 65536):
            view = buf[:size]
            out[f"random {size // 1024} KiB read IOPS"] = timed_loop(
                seconds, lambda size=size, view=view: os.preadv(fd, [view], rng.randrange(chunks * CHUNK - size)))
        out["64 KiB write into 1 MiB IOPS"] = timed_loop(
            seconds, lambda: os.pwrite(fd, payload[:65536], rng.randrange(chunks * 16) * 65536))
    finally:
        os.close(fd)
    return out


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
    ap.add_argument("--mib", type=int, default=256, help="data per engine (1 MiB chunks)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--open-chunks", type=int, default=0, help="also open a v2 target of this many chunks")
    ap.add_argument("--dir", default=None, help="where targets go (default: a temporary directory)")
    args = ap.parse_args()
    payload = os.urandom(CHUNK)
    with tempfile.TemporaryDirectory(prefix="threefs-engine-bench-", dir=args.dir) as tmp:
        results = {"local file": bench_local(os.path.join(tmp, "local.bin"), args.mib, args.seconds, payload, 1)}
        os.unlink(os.path.join(tmp, "local.bin"))
        starts = {}
        for name, cls in (("v1", ChunkEngine), ("v2", ChunkEngineV2)):
            path = os.path.join(tmp, name)
            with cls(path) as eng:
                results[name] = bench_engine(eng, args.mib, args.seconds, payload, 1)
            starts[name] = open_time(cls, path)
        loadavg = open("/proc/loadavg").read().split()[:3]
        print(f"{args.mib} x 1 MiB chunks per engine; load average {' '.join(loadavg)}")
        print(f"{'metric':<30} {'local file':>11} {'v1':>11} {'v2':>11} {'v2/v1':>7} {'v2/file':>8}")
        for key in results["v1"]:
            ref, a, b = results["local file"][key], results["v1"][key], results["v2"][key]
            print(f"{key:<30} {ref:11.2f} {a:11.2f} {b:11.2f} {b / a:6.2f}x {b / ref:7.2f}x")
        print(f"{'start-up (s), this target':<30} {'':>11} {starts['v1']:11.3f} {starts['v2']:11.3f} "
              f"{starts['v1'] / starts['v2']:6.2f}x faster")
        if args.open_chunks:
            load, reopen = million(os.path.join(tmp, "million"), args.open_chunks)
            print(f"v2 target of {args.open_chunks} chunks: bulk load {load:.1f} s, reopen {reopen:.3f} s "
                  f"(load average {' '.join(open('/proc/loadavg').read().split()[:3])})")


if __name__ == "__main__":
    main()
