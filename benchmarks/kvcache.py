"""KVCache on threefs side by side with Redis (pipelined MSET/MGET of the same pages), in one run.

    .venv/bin/python benchmarks/kvcache.py [--pages-kib 64,256,1024] [--batch 64] [--clients 1,4]
                                           [--redis-mib 256] [--cache-ratio 4] [--get-batches 12]
                                           [--storage 3] [--replicas 3]

Redis: Debian's redis-server, started here on a loopback port and a Unix socket with `--maxmemory REDIS_MIB`
(allkeys-lru, no persistence), reached the way threefs's clients reach this host's services (its Unix socket;
loopback TCP with THREEFS_RPC_LOCAL=0); clients: redis-py + hiredis, one pipeline per batch (MSETs of at most
8 MiB of its pages / one MGET of its keys).
threefs: a local cluster (`threefs up`'s shape: STORAGE storage processes, R replicas) and one KVCache of
`cache-ratio` x REDIS_MIB, filled completely, so it holds that many times the RAM Redis was given.
For each page size: puts (the fill, 1 client; then C clients on the full cache, evicting), gets of random
batches of present keys (C clients, each its own process, `--get-batches` batches each). threefs reads land
in the caller's preallocated buffers and are crc-checked; Redis's MGET results are left where hiredis put
them (no copy: Redis's advantage). GB/s = 10^9 B/s of pages stored or found (misses move no bytes) over the wall time of all clients; p50/p99
per batch.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import local_cluster  # noqa: E402
from threefs.common.net import free_port  # noqa: E402
from benchmarks.refserver import default_transport  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
DISTINCT_PAGES = 16  # page contents cycled through (random bytes; every key has one)
MSET_BYTES_MAX = 8 << 20


def page_pool(page_bytes: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, page_bytes, dtype=np.uint8).tobytes() for _ in range(DISTINCT_PAGES)]


def key_of(i: int) -> bytes:
    return b"page-%09d" % i


# -- workers (each its own process) ----------------------------------------------------------------
def _threefs_worker(conf, root, page, batch, op, keys, start_at, out):
    from threefs.client.client import Client
    from threefs.kvcache import KVCache

    with Client.connect(conf) as fs:
        cache = KVCache(fs, root, page_bytes=0, capacity_bytes=0)
        pool = page_pool(page, 1)
        arena = np.empty((batch, page), dtype=np.uint8)
        bufs = [arena[i] for i in range(batch)]
        lat, nbytes, bad = [], 0, 0
        while time.monotonic() < start_at:
            time.sleep(0.001)
        t0 = time.monotonic()
        for b in keys:
            ks = [key_of(i) for i in b]
            t = time.perf_counter()
            if op == "put":
                ok = cache.batch_put(ks, [pool[i % DISTINCT_PAGES] for i in b])
                bad += ok.count(False)
            else:
                got = cache.batch_get_into(ks, bufs[:len(ks)])
                bad += sum(1 for g in got if g != page)
            lat.append(time.perf_counter() - t)
            nbytes += len(ks) * page if op == "put" else sum(g for g in got if g > 0)  # hits only
        out.put((t0, time.monotonic(), nbytes, lat, bad))
        cache.close()


def _redis_worker(port, page, batch, op, keys, start_at, out):
    import redis

    r = _redis(port)
    pool = page_pool(page, 1)
    lat, nbytes, bad = [], 0, 0
    while time.monotonic() < start_at:
        time.sleep(0.001)
    t0 = time.monotonic()
    for b in keys:
        ks = [key_of(i) for i in b]
        t = time.perf_counter()
        if op == "put":  # one pipeline; MSETs of <= 8 MiB (a 64 MiB MSET's query buffer alone can exceed
            pipe = r.pipeline(transaction=False)  # maxmemory, and Redis answers OOM)
            step = max(1, MSET_BYTES_MAX // page)
            for j in range(0, len(ks), step):
                pipe.mset({k: pool[i % DISTINCT_PAGES] for k, i in zip(ks[j:j + step], b[j:j + step])})
            pipe.execute()
        else:
            got = r.mget(ks)
            bad += sum(1 for g in got if g is None or len(g) != page)
        lat.append(time.perf_counter() - t)
        nbytes += len(ks) * page if op == "put" else sum(len(g) for g in got if g is not None)  # hits only
    out.put((t0, time.monotonic(), nbytes, lat, bad))
    r.close()


def _guarded(target, *args):
    """Run a worker; a failure is reported through the queue (the parent must never wait for nothing)."""
    out = args[-1]
    try:
        target(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which stops the run
        out.put(("error", f"{target.__name__}: {exc!r}"))
        raise


def run(target, args_of, clients: int) -> dict:
    """Start `clients` processes, let them set up, start them together; aggregate their figures."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.monotonic() + 3.0 + clients  # after imports, connects and cache opens
    procs = [ctx.Process(target=_guarded, args=(target, *args_of(c), start_at, out)) for c in range(clients)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [r[1] for r in results if r[0] == "error"]
    if errors:
        raise SystemExit(f"a client failed: {errors[0]}")
    t0, t1 = min(r[0] for r in results), max(r[1] for r in results)
    lat = np.array([x for r in results for x in r[3]])
    return {"gbps": sum(r[2] for r in results) / (t1 - t0) / 1e9, "p50": np.percentile(lat, 50) * 1e3,
            "p99": np.percentile(lat, 99) * 1e3, "bad": sum(r[4] for r in results),
            "late_start": t0 - start_at}


def _redis(where):
    """A client of the benchmark's Redis: `where` is its Unix socket's path, or its loopback TCP port."""
    import redis

    if isinstance(where, str):
        return redis.Redis(unix_socket_path=where)
    return redis.Redis(host="127.0.0.1", port=where)


def start_redis(maxmemory_mib: int, workdir: str) -> tuple[subprocess.Popen, int | str]:
    """Redis on a loopback port and a Unix socket; returns the process and what clients use: the socket
    when threefs's clients use Unix sockets to reach services on this host (THREEFS_RPC_LOCAL unset or 1),
    the port otherwise, so that both systems are reached the same way."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server; "
                         "scripts/setup-system.sh does it)")
    port = free_port()
    unix = os.path.join(workdir, "redis.sock")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", unix,
                             "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                             "--maxmemory", f"{maxmemory_mib}mb", "--maxmemory-policy", "allkeys-lru",
                             "--dir", workdir, "--proto-max-bulk-len", "512mb", "--client-query-buffer-limit", "1gb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    deadline = time.monotonic() + 20
    while True:
        try:
            where = unix if default_transport() == "unix" else port
            _redis(where).ping()
            return proc, where
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit("redis-server did not start")
            time.sleep(0.05)


def batches_of(keys: np.ndarray, batch: int) -> list[list[int]]:
    return [keys[i:i + batch].tolist() for i in range(0, len(keys) - batch + 1, batch)]


def bench_page(page: int, a, conf: str, redis_port: int, rows: list) -> None:
    import redis

    root = f"/bench/kv-{page // KiB}k"
    cache_bytes = a.cache_ratio * a.redis_mib * MiB
    from threefs.client.client import Client
    from threefs.kvcache import KVCache

    with Client.connect(conf) as fs:
        KVCache(fs, root, page_bytes=page, capacity_bytes=cache_bytes).close()
    n_cache = cache_bytes // page
    n_redis = int(0.5 * a.redis_mib * MiB // page)  # what surely stays in Redis's memory (its LRU is approximate)
    fill = batches_of(np.arange(n_cache), a.batch)
    _redis(redis_port).flushall()
    res = {}
    res["put", 1, "threefs"] = run(_threefs_worker, lambda c: (conf, root, page, a.batch, "put", fill), 1)
    res["put", 1, "redis"] = run(_redis_worker, lambda c: (redis_port, page, a.batch, "put", fill), 1)
    info = _redis(redis_port).info("memory")
    with Client.connect(conf) as fs:
        held = KVCache(fs, root, page_bytes=0, capacity_bytes=0).stats()["used_bytes"]
    rng = np.random.default_rng(page)
    for c in a.clients:
        picks = [batches_of(rng.integers(0, n_cache, a.batch * a.get_batches), a.batch) for _ in range(c)]
        res["get", c, "threefs"] = run(_threefs_worker, lambda i: (conf, root, page, a.batch, "get", picks[i]), c)
        recent = [batches_of(rng.integers(n_cache - n_redis, n_cache, a.batch * a.get_batches), a.batch)
                  for _ in range(c)]
        res["get", c, "redis"] = run(_redis_worker, lambda i: (redis_port, page, a.batch, "get", recent[i]), c)
    for c in a.clients:
        if c == 1:
            continue
        fresh = [batches_of(np.arange(n_cache * (i + 1), n_cache * (i + 1) + a.batch * a.get_batches), a.batch)
                 for i in range(c)]
        res["put", c, "threefs"] = run(_threefs_worker, lambda i: (conf, root, page, a.batch, "put", fresh[i]), c)
        res["put", c, "redis"] = run(_redis_worker, lambda i: (redis_port, page, a.batch, "put", fresh[i]), c)
    print(f"\npage {page // KiB} KiB, batch {a.batch}: threefs cache holds {held / MiB:.0f} MiB "
          f"({held / (a.redis_mib * MiB):.1f}x Redis maxmemory {a.redis_mib} MiB; Redis used "
          f"{info['used_memory'] / MiB:.0f} MiB), load {open('/proc/loadavg').read().split()[0]}")
    print(f"  {'op':<4} {'clients':>7} {'system':<8} {'GB/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'misses':>6} {'ratio':>6}")
    for (op, c, system), r in sorted(res.items(), key=lambda kv: (kv[0][0] != "put", kv[0][1], kv[0][2] != "redis")):
        base = res[op, c, "redis"]["gbps"]
        ratio = f"{r['gbps'] / base:5.2f}x" if system == "threefs" else ""
        print(f"  {op:<4} {c:>7} {system:<8} {r['gbps']:7.3f} {r['p50']:8.1f} {r['p99']:8.1f} {r['bad']:>6} {ratio:>6}")
        rows.append((page, op, c, system, r))


def _meta_worker(conf, seconds, start_at, out):
    from threefs.client.client import Client
    from threefs.kvcache import KVCache

    with Client.connect(conf) as fs:
        cache = KVCache(fs, "/bench/meta", page_bytes=4096, capacity_bytes=1 << 30)
        keys = [key_of(i) for i in range(64)]
        cache.batch_put(keys[:32], [b"x"] * 32)
        while time.monotonic() < start_at:
            time.sleep(0.001)
        t0, lat = time.monotonic(), []
        while time.monotonic() - t0 < seconds:
            t = time.perf_counter()
            cache.batch_exists(keys)
            lat.append(time.perf_counter() - t)
        out.put((t0, time.monotonic(), len(lat), lat, 0))


def meta_rate(conf: str, clients: list[int]) -> None:
    """Batched lookups per second of the kvcache service (64 keys each), from 1 and N client processes."""
    for c in clients:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        start_at = time.monotonic() + 3.0 + c
        procs = [ctx.Process(target=_guarded, args=(_meta_worker, conf, 2.0, start_at, out)) for _ in range(c)]
        for p in procs:
            p.start()
        res = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(60)
        if any(r[0] == "error" for r in res):
            raise SystemExit(f"a client failed: {[r[1] for r in res if r[0] == 'error'][0]}")
        wall = max(r[1] for r in res) - min(r[0] for r in res)
        n = sum(r[2] for r in res)
        lat = np.array([x for r in res for x in r[3]]) * 1e6
        print(f"kvcache service, {c} client(s): {n / wall:.0f} lookups of 64 keys/s ({n * 64 / wall:.0f} keys/s), "
              f"p50 {np.percentile(lat, 50):.0f} us, p99 {np.percentile(lat, 99):.0f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages-kib", default="64,256,1024")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--clients", default="1,4")
    p.add_argument("--redis-mib", type=int, default=256)
    p.add_argument("--cache-ratio", type=int, default=4)
    p.add_argument("--get-batches", type=int, default=12)
    p.add_argument("--storage", type=int, default=3)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--meta-only", action="store_true", help="only the kvcache service's lookup rate")
    a = p.parse_args()
    a.clients = [int(x) for x in a.clients.split(",")]
    if a.redis_mib * MiB < 8 * MSET_BYTES_MAX * max(a.clients):  # query buffers count against maxmemory
        raise SystemExit(f"--redis-mib {a.redis_mib} is too small for {max(a.clients)} clients' MSETs of "
                         f"{MSET_BYTES_MAX // MiB} MiB (Redis answers OOM)")
    print(f"load average at start: {open('/proc/loadavg').read().strip()}; transport to this host's services "
          f"(threefs and Redis): {default_transport()}")
    rows: list = []
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        rproc, rport = start_redis(a.redis_mib, tmp)
        try:
            with local_cluster(tmp, a.storage, a.replicas, fuse=False) as (cluster, _):
                conf = str(cluster.client_config_path)
                print(f"threefs: {a.storage} storage processes, {a.replicas} replica(s); Redis on 127.0.0.1:{rport}")
                for kib in (int(x) for x in a.pages_kib.split(",")) if not a.meta_only else ():
                    bench_page(kib * KiB, a, conf, rport, rows)
                print()
                meta_rate(conf, a.clients)
        finally:
            rproc.kill()
            rproc.wait(10)
    print(f"load average at end: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
