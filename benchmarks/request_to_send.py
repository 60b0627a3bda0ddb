"""Request-to-send (3FS RDMAControl) on and off: many storage services reading into one client.

    .venv/bin/python benchmarks/request_to_send.py [--storage 6] [--mib 512] [--senders 2]

A cluster of N storage services (R=1, so every service holds a share of the file) serves a file that one
client reads with 8 threads, each doing batch reads of 32 x 1 MiB. Each mode runs in its own client
process so its memory high-water mark (ru_maxrss) is its own. Printed: GB/s, per-batch latency
p50/p99/max, and peak RSS, with request-to-send off and on (at most --senders services transmitting to
the client at once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from threefs.cli.cluster import LocalCluster  # noqa: E402
from threefs.client.client import Client  # noqa: E402

READER = r"""
import json, os, resource, sys, threading, time
sys.path.insert(0, sys.argv[1])
from threefs.common.config import ClientConfig, load_toml
from threefs.client.client import Client
cfg = load_toml(sys.argv[2], ClientConfig)
cfg.request_to_send = int(sys.argv[3])
rounds = int(sys.argv[4])
fs = Client.connect(cfg)
attr = fs.stat("/rts/data")
MiB = 1 << 20
latencies, lock = [], threading.Lock()
def reader(k):
    bufs = [bytearray(MiB) for _ in range(32)]
    for r in range(rounds):
        base = ((k * rounds + r) * 32) % (attr.length // MiB - 32)
        t0 = time.perf_counter()
        fs.batch_read([(attr, (base + i) * MiB, b) for i, b in enumerate(bufs)])
        with lock:
            latencies.append(time.perf_counter() - t0)
t0 = time.perf_counter()
threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
dt = time.perf_counter() - t0
latencies.sort()
q = lambda p: latencies[min(len(latencies) - 1, int(p * len(latencies)))]
print(json.dumps({"gbps": len(latencies) * 32 * MiB / dt / 1e9, "p50_ms": q(0.5) * 1e3,
                  "p99_ms": q(0.99) * 1e3, "max_ms": latencies[-1] * 1e3,
                  "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
fs.close()
"""


def run_reader(repo: str, config: str, senders: int, rounds: int) -> dict:
    out = subprocess.run([sys.executable, "-c", READER, repo, config, str(senders), str(rounds)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--storage", type=int, default=6)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with tempfile.TemporaryDirectory(prefix="threefs-rts-") as tmp:
        cluster = LocalCluster(tmp)
        cluster.up(args.storage, 1)
        try:
            config = str(cluster.client_config_path)
            with Client.connect(config) as fs:
                fs.mkdir("/rts", stripe=16)
                piece = bytearray(os.urandom(64 << 20))
                with fs.open("/rts/data", "wb", buffering=0) as f:
                    for _ in range(args.mib // 64):
                        f.write(piece)
            results = {"off": run_reader(repo, config, 0, args.rounds),
                       f"on ({args.senders} senders)": run_reader(repo, config, args.senders, args.rounds)}
        finally:
            cluster.down()
    print(f"{args.storage} storage services (R=1), 8 reader threads x batch_read(32 x 1 MiB) in one client")
    print(f"{'request-to-send':<20} {'GB/s':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'peak RSS MiB':>13}")
    for name, r in results.items():
        print(f"{name:<20} {r['gbps']:6.2f} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} {r['max_ms']:8.1f} "
              f"{r['rss_mib']:13.0f}")


if __name__ == "__main__":
    main()
