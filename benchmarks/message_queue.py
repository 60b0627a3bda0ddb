"""The message queue (threefs.queue) beside Redis Streams, in one run, at 1 KiB records.

    .venv/bin/python benchmarks/message_queue.py [--records 200000] [--partitions 4] [--record-bytes 1024]
                                         [--repeats 2] [--profile]

threefs: a local cluster (3 storage services, chains of R=3, every record on three disks), one Producer
(batches of 1 MiB, linger 5 ms) and one Consumer in a group (poll + commit per poll) in this process.
Redis Streams: Debian's redis-server started here on a loopback port, two configurations — memory only
(`--save "" --appendonly no`, its fastest) and with its log on disk (`--appendonly yes --appendfsync
everysec`; one copy, not three). One stream per partition, XADD pipelined 1000 at a time (each reply
is the entry id, as a producer's offset); then XREADGROUP COUNT 1000 + XACK pipelined per read.
Phases: produce (all acknowledged), consume (all read and committed/acked), and both at once (a
producer thread and a consumer thread, end to end). Each system runs --repeats times, interleaved; the
best counts (the machine is shared). Goal: threefs >= 1.0x Redis's records/s.
"""

from __future__ import annotations

import os
import sys

# This file is named like the stdlib's `queue` (the issue names it): take its directory off the import
# path before anything imports `queue` (redis, concurrent.futures), and put the repository root on it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse
import cProfile
import io
import pstats
import shutil
import subprocess
import tempfile
import threading
import time

from benchmarks.common import local_cluster  # noqa: E402
from threefs.client.client import Client  # noqa: E402
from threefs.common.net import free_port  # noqa: E402
from threefs.queue import Admin, Consumer, Producer  # noqa: E402

ROOT = "/bench-queue"
REDIS_PIPELINE = 1000
REDIS_START_TIMEOUT_S = 10.0


# -- threefs ---------------------------------------------------------------------------------------------
def tfs_produce(fs, topic: str, n: int, value: bytes, partitions: int) -> float:
    t0 = time.perf_counter()
    with Producer(fs, root=ROOT) as p:
        last = None
        for i in range(n):
            last = p.send(topic, value, partition=i % partitions)
        p.flush()
        last.get(timeout=60)
    return time.perf_counter() - t0


def tfs_consume(fs, topic: str, n: int, group: str) -> float:
    t0 = time.perf_counter()
    c = Consumer(fs, topic, group_id=group, root=ROOT, enable_auto_commit=False)
    got = 0
    deadline = time.monotonic() + 300
    while got < n and time.monotonic() < deadline:
        batch = c.poll(timeout_ms=1000)
        got += sum(len(v) for v in batch.values())
        if batch:
            c.commit()
    c.close(commit=False)
    assert got == n, f"threefs consumer read {got} of {n}"
    return time.perf_counter() - t0


def tfs_both(fs, topic: str, n: int, value: bytes, partitions: int, group: str) -> float:
    t0 = time.perf_counter()
    th = threading.Thread(target=tfs_produce, args=(fs, topic, n, value, partitions))
    th.start()
    tfs_consume(fs, topic, n, group)
    th.join()
    return time.perf_counter() - t0


# -- Redis Streams ---------------------------------------------------------------------------------------
class RedisServer:
    def __init__(self, tmp: str, persistent: bool):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(dir=tmp, prefix="redis-")
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "everysec"] if persistent else ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        self.client = redis.Redis(port=self.port)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def redis_produce(r, n: int, value: bytes, partitions: int, tag: str) -> float:
    t0 = time.perf_counter()
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(f"{tag}:{i % partitions}", {b"v": value})
        if (i + 1) % REDIS_PIPELINE == 0:
            pipe.execute()
    pipe.execute()
    return time.perf_counter() - t0


def redis_consume(r, n: int, partitions: int, tag: str, group: str) -> float:
    import redis
    streams = [f"{tag}:{p}" for p in range(partitions)]
    for s in streams:
        try:
            r.xgroup_create(s, group, id="0", mkstream=True)
        except redis.ResponseError:
            pass
    t0 = time.perf_counter()
    got = 0
    deadline = time.monotonic() + 300
    while got < n and time.monotonic() < deadline:
        rsp = r.xreadgroup(group, "c1", {s: ">" for s in streams}, count=REDIS_PIPELINE, block=1000)
        pipe = r.pipeline(transaction=False)
        for stream, entries in rsp or []:
            got += len(entries)
            pipe.xack(stream, group, *[eid for eid, _ in entries])
        pipe.execute()
    assert got == n, f"redis consumer read {got} of {n}"
    return time.perf_counter() - t0


def redis_both(r, port: int, n: int, value: bytes, partitions: int, tag: str, group: str) -> float:
    import redis
    for p in range(partitions):
        try:
            r.xgroup_create(f"{tag}:{p}", group, id="0", mkstream=True)
        except redis.ResponseError:
            pass
    t0 = time.perf_counter()
    th = threading.Thread(target=redis_produce, args=(redis.Redis(port=port), n, value, partitions, tag))
    th.start()
    redis_consume(r, n, partitions, tag, group)
    th.join()
    return time.perf_counter() - t0


# -- the run ---------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--record-bytes", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="cProfile the threefs produce and consume phases")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (apt-get install redis-server; scripts/setup-system.sh)")
    n, value = args.records, os.urandom(args.record_bytes)
    best: dict[tuple[str, str], float] = {}
    tmp = tempfile.mkdtemp(prefix="bench-queue-")
    print(f"load average before: {open('/proc/loadavg').read().strip()}")
    try:
        with local_cluster(tmp, storage=3, replicas=3, fuse=False) as (cluster, _):
            fs = Client.connect(str(cluster.client_config_path))
            admin = Admin(fs, root=ROOT)
            servers = {"redis (memory)": RedisServer(tmp, False), "redis (AOF everysec)": RedisServer(tmp, True)}
            try:
                for rep in range(args.repeats):
                    for phase in ("produce", "consume", "both"):
                        topic = f"t{rep}" if phase != "both" else f"b{rep}"
                        if phase != "consume":
                            admin.create_topic(topic, args.partitions)
                        prof = cProfile.Profile() if args.profile and rep == 0 and phase != "both" else None
                        if prof:
                            prof.enable()
                        if phase == "produce":
                            dt = tfs_produce(fs, topic, n, value, args.partitions)
                        elif phase == "consume":
                            dt = tfs_consume(fs, topic, n, f"g{rep}")
                        else:
                            dt = tfs_both(fs, topic, n, value, args.partitions, f"gb{rep}")
                        if prof:
                            prof.disable()
                            _print_profile(prof, f"threefs {phase}")
                        _keep(best, ("threefs", phase), dt)
                        for name, srv in servers.items():
                            tag = f"{topic}"
                            if phase == "produce":
                                dt = redis_produce(srv.client, n, value, args.partitions, tag)
                            elif phase == "consume":
                                dt = redis_consume(srv.client, n, args.partitions, tag, f"g{rep}")
                            else:
                                dt = redis_both(srv.client, srv.port, n, value, args.partitions, tag, f"gb{rep}")
                            _keep(best, (name, phase), dt)
                    for srv in servers.values():
                        srv.client.flushall()
                ceiling = _redis_benchmark(servers["redis (memory)"].port, n, args.record_bytes)
            finally:
                for srv in servers.values():
                    srv.stop()
                fs.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _report(best, n, args)
    if ceiling:
        print(f"redis-benchmark (Redis's own C client, XADD pipelined 1000, same server): {ceiling:,.0f} rec/s "
              f"— the server's ceiling, beyond any Python client")


def _redis_benchmark(port: int, n: int, record_bytes: int) -> float | None:
    """XADD throughput with redis-benchmark (C), for scale: what the Redis server does without redis-py."""
    if shutil.which("redis-benchmark") is None:
        return None
    out = subprocess.run(["redis-benchmark", "-p", str(port), "-n", str(n), "-P", str(REDIS_PIPELINE), "-q",
                          "XADD", "ceiling", "*", "v", "x" * record_bytes], capture_output=True, text=True,
                         timeout=300).stdout
    for token in out.replace("\r", "\n").split("\n")[::-1]:
        if "requests per second" in token:
            return float(token.split(":")[1].split()[0])
    return None


def _keep(best: dict, key, dt: float) -> None:
    best[key] = min(best.get(key, float("inf")), dt)
    print(f"  {key[0]:22s} {key[1]:8s} {dt:7.2f} s", flush=True)


def _print_profile(prof: cProfile.Profile, title: str) -> None:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    print(f"--- profile: {title} (this thread; the client's loop thread is not in it) ---")
    print("\n".join(out.getvalue().splitlines()[:30]))


def _report(best: dict, n: int, args) -> None:
    print(f"\n{n} records of {args.record_bytes} B, {args.partitions} partitions; best of {args.repeats}; "
          f"load average after: {open('/proc/loadavg').read().strip()}")
    print(f"{'phase':8s} {'threefs rec/s':>14s} {'redis mem':>12s} {'ratio':>6s} {'redis AOF':>12s} {'ratio':>6s}")
    for phase in ("produce", "consume", "both"):
        t = n / best[("threefs", phase)]
        m = n / best[("redis (memory)", phase)]
        a = n / best[("redis (AOF everysec)", phase)]
        print(f"{phase:8s} {t:14,.0f} {m:12,.0f} {t / m:6.2f} {a:12,.0f} {t / a:6.2f}")


if __name__ == "__main__":
    main()
