"""threefs.kvstore beside Redis (GET/SET), in one run.

    .venv/bin/python benchmarks/kvstore.py [--ops 3000] [--threads 1,8] [--value-bytes 100] [--big-mib 256]

Small values: put, get and compare-and-set ops/s from T threads of one process (each op one meta RPC and
one KV transaction on SQLite), beside redis-py SET, GET and the WATCH/GET/MULTI/SET/EXEC idiom of CAS from T
threads against Debian's redis-server (memory only) on a loopback port, not pipelined: both are
request/response per op; and batches of 1000 puts (threefs: one atomic batch, one transaction; Redis: a
pipeline of 1000 SETs). Large values: one put and one get of --big-mib MiB (threefs: a blob file, three
replicas on disk; Redis: one SET/GET of the same bytes, in memory); --stream-gib streams a local file in
and out. The best of --repeats counts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import local_cluster  # noqa: E402
from threefs.client.client import Client  # noqa: E402
from threefs.common.net import free_port  # noqa: E402
from threefs.kvstore import KVStore  # noqa: E402

BATCH = 1000


def _threads(n: int, fn) -> float:
    errors = []

    def run(t):
        try:
            fn(t)
        except BaseException as e:  # report, do not hang
            errors.append(e)
    ths = [threading.Thread(target=run, args=(t,)) for t in range(n)]
    t0 = time.perf_counter()
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def bench_threefs(kv: KVStore, ops: int, threads: int, value: bytes) -> dict[str, float]:
    per = ops // threads
    out = {}
    out["put"] = ops / _threads(threads, lambda t: [kv.put(b"k%d-%d" % (t, i), value) for i in range(per)])
    out["get"] = ops / _threads(threads, lambda t: [kv.get(b"k%d-%d" % (t, i)) for i in range(per)])

    def cas(t):
        for i in range(per):
            kv.compare_and_set(b"k%d-%d" % (t, i), value, value[::-1])
    out["cas"] = ops / _threads(threads, cas)

    def batched(t):  # one atomic batch (one transaction) per 1000 keys
        for i in range(0, per, BATCH):
            kv.put_many([(b"b%d-%d" % (t, j), value) for j in range(i, min(per, i + BATCH))])
    out["put_many"] = ops / _threads(threads, batched)
    return out


def bench_redis(port: int, ops: int, threads: int, value: bytes) -> dict[str, float]:
    import redis
    clients = [redis.Redis(port=port) for _ in range(threads)]
    per = ops // threads
    out = {}
    out["put"] = ops / _threads(threads, lambda t: [clients[t].set(b"k%d-%d" % (t, i), value) for i in range(per)])
    out["get"] = ops / _threads(threads, lambda t: [clients[t].get(b"k%d-%d" % (t, i)) for i in range(per)])

    def cas(t):  # Redis's CAS idiom: WATCH, GET, MULTI/SET/EXEC
        r = clients[t]
        for i in range(per):
            key = b"k%d-%d" % (t, i)
            with r.pipeline() as p:
                p.watch(key)
                if p.get(key) == value:
                    p.multi()
                    p.set(key, value[::-1])
                    p.execute()
    out["cas"] = ops / _threads(threads, cas)

    def batched(t):  # a pipeline of 1000 SETs (not atomic: MULTI would be)
        for i in range(0, per, BATCH):
            p = clients[t].pipeline(transaction=False)
            for j in range(i, min(per, i + BATCH)):
                p.set(b"b%d-%d" % (t, j), value)
            p.execute()
    out["put_many"] = ops / _threads(threads, batched)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--threads", default="1,8")
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--big-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stream-gib", type=float, default=0,
                    help="also put a local file of this many GiB (streamed) and get_to it back, checked")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed (apt-get install redis-server; scripts/setup-system.sh)")
    value = os.urandom(args.value_bytes)
    tmp = tempfile.mkdtemp(prefix="bench-kv-")
    port = free_port()
    redis_proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
    print(f"load average before: {open('/proc/loadavg').read().strip()}")
    rows = {}
    try:
        import redis
        r = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        with local_cluster(tmp, storage=3, replicas=3, fuse=False) as (cluster, _):
            fs = Client.connect(str(cluster.client_config_path))
            kv = KVStore.create(fs, "/bench-kv")
            for rep in range(args.repeats):
                for t in [int(x) for x in args.threads.split(",")]:
                    for name, res in (("threefs", bench_threefs(kv, args.ops, t, value)),
                                      ("redis", bench_redis(port, args.ops, t, value))):
                        for op, v in res.items():
                            key = (op, t, name)
                            rows[key] = max(rows.get(key, 0), v)
                            print(f"  {name:8s} {op:8s} {t:2d} threads {v:10,.0f} ops/s", flush=True)
            big = os.urandom(args.big_mib << 20)
            t0 = time.perf_counter()
            kv.put(b"big", big)
            t_put = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert kv.get(b"big") == big
            t_get = time.perf_counter() - t0
            t0 = time.perf_counter()
            r.set(b"big", big)
            r_put = time.perf_counter() - t0
            t0 = time.perf_counter()
            assert r.get(b"big") == big
            r_get = time.perf_counter() - t0
            streamed = _stream(kv, tmp, args.stream_gib) if args.stream_gib else None
            fs.close()
    finally:
        redis_proc.kill()
        redis_proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nvalues of {args.value_bytes} B, {args.ops} ops per phase; best of {args.repeats}; "
          f"load average after: {open('/proc/loadavg').read().strip()}")
    print(f"{'op':8s} {'threads':>7s} {'threefs ops/s':>14s} {'redis ops/s':>12s} {'ratio':>6s}")
    for (op, t, name) in sorted(rows):
        if name == "threefs":
            a, b = rows[(op, t, "threefs")], rows[(op, t, "redis")]
            print(f"{op:8s} {t:7d} {a:14,.0f} {b:12,.0f} {a / b:6.2f}")
    mib = args.big_mib
    print(f"{mib} MiB value: threefs put {mib / t_put:,.0f} MiB/s get {mib / t_get:,.0f} MiB/s (R=3 on disk); "
          f"redis SET {mib / r_put:,.0f} MiB/s GET {mib / r_get:,.0f} MiB/s (memory)")
    if streamed:
        gib, put_s, get_s = streamed
        print(f"{gib:g} GiB value streamed from a local file: put {gib * 1024 / put_s:,.0f} MiB/s, get_to a local "
              f"file {gib * 1024 / get_s:,.0f} MiB/s, sha256 equal")


def _stream(kv: KVStore, tmp: str, gib: float) -> tuple[float, float, float]:
    import hashlib
    src, dst = os.path.join(tmp, "src.bin"), os.path.join(tmp, "dst.bin")
    h = hashlib.sha256()
    piece = os.urandom(8 << 20)
    with open(src, "wb") as f:
        for _ in range(int(gib * 128)):
            f.write(piece)
            h.update(piece)
    t0 = time.perf_counter()
    with open(src, "rb") as f:
        kv.put(b"stream", f)
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(dst, "wb") as f:
        kv.get_to(b"stream", f)
    get_s = time.perf_counter() - t0
    h2 = hashlib.sha256()
    with open(dst, "rb") as f:
        while b := f.read(8 << 20):
            h2.update(b)
    assert h2.digest() == h.digest(), "the streamed value came back different"
    kv.delete(b"stream")
    return gib, put_s, get_s


if __name__ == "__main__":
    main()
