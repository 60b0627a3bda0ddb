"""Sequential throughput of threefs beside this machine's transport ceiling, in one run.

    .venv/bin/python benchmarks/throughput.py [--gib 1] [--storage 3] [--replicas 3]

Baseline: a bare Python loopback TCP stream (one sender process, `sendall` of a preallocated 4 MiB
buffer; receiver `recv_into` a preallocated buffer) = the transport ceiling on this machine.
threefs: a local cluster (mgmtd, meta, N storage processes, R replicas, 1 MiB chunks) in a temp dir;
writes and reads of one file through the file object (64 MiB calls) and through batch_read.
Prints GB/s (10^9 bytes/s) and the ratios to the ceiling. The machine is shared and noisy: compare
ratios within one run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from threefs.cli.cluster import LocalCluster  # noqa: E402
from threefs.client.client import Client  # noqa: E402

PIECE = 64 << 20


def _sender(port: int, total: int) -> None:
    buf = os.urandom(4 << 20)
    with socket.create_connection(("127.0.0.1", port)) as s:
        sent = 0
        while sent < total:
            s.sendall(buf)
            sent += len(buf)


def loopback_gbps(total: int) -> float:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        proc = mp.get_context("spawn").Process(target=_sender, args=(port, total))
        proc.start()
        conn, _ = srv.accept()
        buf = bytearray(4 << 20)
        view = memoryview(buf)
        got = 0
        t0 = time.perf_counter()
        with conn:
            while got < total:
                n = conn.recv_into(view)
                if not n:
                    break
                got += n
        dt = time.perf_counter() - t0
        proc.join()
    return got / dt / 1e9


def disk_write_gbps(directory: str, total: int) -> float:
    """New data written to local files (the page cache of this VM): the write-side ceiling per copy."""
    data = os.urandom(PIECE)
    path = os.path.join(directory, "disk-baseline.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(total // PIECE):
            f.write(data)
    gbps = total / (time.perf_counter() - t0) / 1e9
    os.unlink(path)
    return gbps


def threefs_runs(fs: Client, total: int):
    """Yield (name, GB/s) of each threefs measurement, so the caller can bracket it with baselines."""
    data = bytearray(os.urandom(PIECE))
    t0 = time.perf_counter()
    with fs.open("/bench/seq", "wb", buffering=0) as f:
        for _ in range(total // PIECE):
            f.write(data)
    yield "write (file object, 64 MiB calls)", total / (time.perf_counter() - t0) / 1e9

    buf = bytearray(PIECE)
    t0 = time.perf_counter()
    with fs.open("/bench/seq", "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    yield "read (file object, 64 MiB calls)", total / (time.perf_counter() - t0) / 1e9

    attr = fs.stat("/bench/seq")
    bufs = [bytearray(PIECE) for _ in range(4)]
    t0 = time.perf_counter()
    for base in range(0, total, PIECE * len(bufs)):
        fs.batch_read([(attr, base + i * PIECE, b) for i, b in enumerate(bufs)])
    yield "read (batch_read, 256 MiB per batch)", total / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--storage", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    args = ap.parse_args()
    total = int(args.gib * (1 << 30)) // PIECE * PIECE
    rows = []
    with tempfile.TemporaryDirectory(prefix="threefs-bench-") as tmp:
        cluster = LocalCluster(tmp)
        cluster.up(args.storage, args.replicas)
        try:
            with Client.connect(str(cluster.client_config_path)) as fs:
                fs.mkdir("/bench", exist_ok=True)
                disk = disk_write_gbps(tmp, total)
                runs = threefs_runs(fs, total)
                while True:  # every measurement is bracketed by the ceiling, measured just before and after
                    before = loopback_gbps(total)
                    try:
                        name, gbps = next(runs)
                    except StopIteration:
                        break
                    rows.append((name, gbps, (before + loopback_gbps(total)) / 2))
        finally:
            cluster.down()
    print(f"data: {total / (1 << 30):.2f} GiB, {args.storage} storage services, R={args.replicas}, "
          f"1 MiB chunks; local-disk write (new data) {disk:.2f} GB/s")
    for name, gbps, ceiling in rows:
        extra = f"  {gbps * args.replicas / disk:4.2f}x disk/R" if name.startswith("write") else ""
        print(f"threefs {name:<38} {gbps:6.2f} GB/s  ceiling {ceiling:5.2f}  {gbps / ceiling:5.2f}x ceiling{extra}")


if __name__ == "__main__":
    main()
