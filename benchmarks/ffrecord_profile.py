"""Where one FileReader batch's CPU goes, stage by stage, against the reference server in the same run.

    .venv/bin/python benchmarks/ffrecord_profile.py [--size 1024] [--batch 64] [--batches 2000] [--mib 32]
        [--py-spy DIR [--spy-storage]] [--rotate] [--copy]

Writes one .ffr file of `--size` B samples to a local cluster (3 storage services, R=3) and to local
disk, then reads `--batches` seeded random batches through FileReader(client=...) with CRC on, timing each
stage of the read path with perf_counter (wall) and thread_time (this thread's CPU):
  build          chunk IOs as columns                                     aio.build_read_columns
  plan           replica per IO, requests per service                     StorageClient._plan
  send           encode + send every request                              SyncStorageReads._send
  recv           wait + receive + apply (status, crc32c per IO, placing)  SyncStorageReads._receive
  results        per run result                                           read_results
  verify         CRC32 per sample                                         reader._verify
  rest of fetch  the rest of reader._fetch (runs, read_columns' checks, the caller-thread path's own work)
  index+views    the rest of read(): index checks and math, sort, the result views
The storage services' CPU over the run (utime+stime from /proc) is divided by the batches read. Then the
reference server (benchmarks/refserver.py) reads the same batches; its client and server CPU per batch
are printed beside. --py-spy records collapsed stacks of the client (and the storage services);
--rotate and --copy turn off the per-thread service turn and the in-place receive, to compare.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from refserver import IOS_PER_REQUEST, RefServers  # noqa: E402

from benchmarks.common import local_cluster  # noqa: E402
from benchmarks.ffrecord import make_samples, proc_cpu, write_ffr  # noqa: E402
from threefs.client.client import Client  # noqa: E402
from threefs.ffrecord import FileReader  # noqa: E402


class Stages:
    """Accumulates (wall, cpu) per stage name."""

    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def wrap(self, obj, name: str, stage: str):
        fn = getattr(obj, name)
        wall, cpu = self.wall, self.cpu
        wall.setdefault(stage, 0.0)
        cpu.setdefault(stage, 0.0)

        def timed(*a, **k):
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                wall[stage] += time.perf_counter() - w0
                cpu[stage] += time.thread_time() - c0
        setattr(obj, name, timed)
        return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--py-spy", metavar="DIR", help="also record the client and the storage services with py-spy "
                    "(collapsed stacks: DIR/client.txt, DIR/storage-N.txt)")
    ap.add_argument("--spy-storage", action="store_true", help="with --py-spy: the storage services too")
    ap.add_argument("--rotate", action="store_true", help="every batch to the next storage service (the "
                    "caller-thread path's turn not kept per thread), to compare")
    ap.add_argument("--copy", action="store_true", help="receive multi-IO responses into the connection's "
                    "buffer and copy them out (as before the in-place receive), to compare")
    args = ap.parse_args()
    if args.copy:
        from threefs.client import storage_sync

        in_place = storage_sync._in_place
        storage_sync._in_place = lambda batch, idx, *a: in_place(batch, idx, *a) if len(idx) == 1 else None
    n = max(args.batch, args.mib * (1 << 20) // args.size)
    samples, sizes = make_samples(n, args.size)
    rng = np.random.default_rng(n)
    all_idx = [rng.integers(0, n, args.batch) for _ in range(args.batches)]
    with tempfile.TemporaryDirectory(prefix="threefs-ffrprof-") as tmp:
        with local_cluster(tmp, 3, 3, fuse=False) as (cluster, _):
            storage_pids = [pid for name, pid in cluster.running().items() if name.startswith("storage")]
            with Client.connect(str(cluster.client_config_path)) as fs:
                fs.mkdir("/bench")
                local, remote = os.path.join(tmp, "s.ffr"), "/bench/s.ffr"
                write_ffr(local, samples), write_ffr(remote, samples, fs)
                fs._storage_sync.sticky = not args.rotate
                r = FileReader(remote, True, client=fs)
                for idx in all_idx[:50]:  # warm: connections, page cache, caches
                    r.read(idx)
                st = Stages()
                from threefs.client import client as client_mod
                sync = fs._storage_sync
                st.wrap(fs.aio, "build_read_columns", "build")
                st.wrap(fs.aio.storage, "_plan", "plan")
                st.wrap(sync, "_send", "send")
                st.wrap(sync, "_receive", "recv")
                st.wrap(client_mod, "read_results", "results")
                st.wrap(r, "_verify", "verify")
                st.wrap(r, "_fetch", "fetch (all above)")
                spies = []
                if args.py_spy:
                    import subprocess
                    os.makedirs(args.py_spy, exist_ok=True)
                    spy_bin = os.path.join(os.path.dirname(sys.executable), "py-spy")
                    for name, pid in [("client", os.getpid())] + [(f"storage-{i}", p)
                                                                  for i, p in enumerate(storage_pids)
                                                                  if args.spy_storage]:
                        spies.append(subprocess.Popen(
                            [spy_bin, "record", "--format", "raw", "-o", os.path.join(args.py_spy, name + ".txt"),
                             "-p", str(pid), "-r", "1000", "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                    time.sleep(2.0)
                s0, p0 = proc_cpu(storage_pids), proc_cpu([os.getpid()])
                w0, c0 = time.perf_counter(), time.thread_time()
                for idx in all_idx:
                    r.read(idx)
                wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
                s_cpu, p_cpu = proc_cpu(storage_pids) - s0, proc_cpu([os.getpid()]) - p0
                for spy in spies:
                    spy.send_signal(2)
                for spy in spies:
                    spy.wait(30)
                nb = args.batches
                print(f"threefs FileReader, {args.size} B x {args.batch}, CRC on, {nb} batches: "
                      f"{nb * args.batch / wall:,.0f} samples/s, {wall / nb * 1e6:.0f} us wall per batch")
                print(f"  client thread CPU per batch {cpu / nb * 1e6:.0f} us (process {p_cpu / nb * 1e6:.0f}); storage CPU per batch (3 "
                      f"services) {s_cpu / nb * 1e6:.0f} us")
                print(f"  {'stage':<20} {'wall us':>8} {'cpu us':>8}")
                fetch_w = st.wall.pop("fetch (all above)")
                fetch_c = st.cpu.pop("fetch (all above)")
                inner_w = sum(v for k, v in st.wall.items() if k != "verify")
                inner_c = sum(v for k, v in st.cpu.items() if k != "verify")
                for k in st.wall:
                    print(f"  {k:<20} {st.wall[k] / nb * 1e6:>8.1f} {st.cpu[k] / nb * 1e6:>8.1f}")
                print(f"  {'rest of fetch':<20} {(fetch_w - inner_w) / nb * 1e6:>8.1f} "
                      f"{(fetch_c - inner_c) / nb * 1e6:>8.1f}")
                rest_w = wall - fetch_w - st.wall["verify"]
                rest_c = cpu - fetch_c - st.cpu["verify"]
                print(f"  {'index+views':<20} {rest_w / nb * 1e6:>8.1f} {rest_c / nb * 1e6:>8.1f}")
                r.close()
            offsets = FileReader(local).get_offsets(0)
            ref_ios = [(int(o), args.size) for idx in all_idx for o in offsets[idx]]
            with RefServers(local, IOS_PER_REQUEST * args.size) as ref:
                pids = [p.pid for p in ref.procs]
                s0, c0 = proc_cpu(pids), proc_cpu([os.getpid()])
                w0 = time.perf_counter()
                rate = ref.read(ref_ios, None, batch=args.batch)
                wall = time.perf_counter() - w0
                s_cpu, c_cpu = proc_cpu(pids) - s0, proc_cpu([os.getpid()]) - c0
            print(f"reference server, same batches: {rate:,.0f} samples/s, {wall / nb * 1e6:.0f} us wall per "
                  f"batch; client CPU per batch {c_cpu / nb * 1e6:.0f} us, servers {s_cpu / nb * 1e6:.0f} us")
    print(f"load average {open('/proc/loadavg').read().split()[0]}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
