"""Scale-out: aggregate read throughput over N storage hosts with capped links, and the KV commit rate of
etcd beside SQLite.

    .venv/bin/python benchmarks/scaleout.py reads [--hosts 1,2,3,4] [--mbit 200] [--mib 48]
    .venv/bin/python benchmarks/scaleout.py kv [--seconds 2] [--repeats 3] [--tasks 1,8] [--puts 2] [--no-fsync]
        [--direct]
    .venv/bin/python benchmarks/scaleout.py creates [--clients 8] [--files 800] [--repeats 1] [--direct] [--eager-grv]

reads (root: network namespaces, threefs/testing/netns.py): hosts ctl (mgmtd + meta), s1..sN (one storage
service each, link capped to --mbit each way with tbf) and cli (uncapped), started with `threefs up --spec`.
Chain table R=1, 2 targets per host, so a file's chunks spread over every host. The client writes a
--mib MiB file, then 8 threads read it whole (1 MiB reads); MB/s = bytes read / time. Goal: N hosts >=
0.8 * N x one host, as long as the client and the 2 cores are not the limit.

kv: one process, `--tasks` concurrent asyncio tasks each running `engine.run` on a transaction shaped like a
create (read a parent key, write an entry and an inode) for --seconds, on SQLite (a file) and on a real
3-member etcd cluster on loopback (threefs/testing/etcd_cluster.py), beside plain etcd Txns (a guarded put of
two keys; `--puts N`: N keys on both sides, 7 as a meta create commits) through the same client library
(grpcio) at the same concurrency. Goal: engine >= 0.5x plain. Per row it also prints what bounds the engine:
commits per etcd Txn (batches grow with the tasks), this process's CPU per commit (Python, gRPC) and the
etcd members' CPU per commit. --no-fsync repeats the etcd rows on a cluster run with --unsafe-no-fsync (not
a product figure).

creates: threefs file creates/s with --clients client processes on a local cluster (3 storage, R=3, 2 meta)
keeping metadata on SQLite, then on a 3-member etcd (--direct: also etcd without the engine's replica, every
read from etcd). Goal: etcd >= 0.5x SQLite. Each run prints the CPU per create of the clients and of every
server process (etcd's members included), and the rate 2 cores would allow at that CPU per create.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

# The repo instead of this directory (a benchmark named like a standard module would shadow it).
sys.path[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

from threefs.kv import etcd_wire as wire  # noqa: E402
from threefs.kv import open_engine  # noqa: E402
from threefs.testing.etcd_cluster import EtcdCluster  # noqa: E402
from threefs.testing.netns import NetLab  # noqa: E402

READERS = 8
MIB = 1 << 20


# -- client side, run inside the cli namespace -------------------------------------------------------------
def client_main(command: str, conf: str, arg: str) -> None:
    from threefs.client.client import Client

    with Client.connect(conf) as fs:
        if command == "write":
            data = os.urandom(MIB) * int(arg)
            with fs.open("/big", "wb") as f:
                f.write(data)
            print("written")
            return
        size = fs.stat("/big").length
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                with fs.open("/big", "rb", buffering=0) as f:
                    buf = bytearray(MIB)
                    while f.readinto(buf):
                        pass
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(int(arg))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        if errors:
            raise errors[0]
        print(f"{size * len(threads) / elapsed / 1e6:.1f}")


# -- reads -----------------------------------------------------------------------------------------------
def spec_text(work: Path, addrs: dict[str, str], storage: list[str]) -> str:
    lines = [f'token_file = "{work / "token"}"', f'data_dir = "{work}/{{host}}"', "replicas = 1",
             "targets_per_storage = 2", "[[hosts]]", 'name = "ctl"', f'address = "{addrs["ctl"]}"',
             'services = ["mgmtd", "meta"]']
    for name in storage:
        lines += ["[[hosts]]", f'name = "{name}"', f'address = "{addrs[name]}"', 'services = ["storage"]']
    return "\n".join(lines) + "\n"


def read_throughput(n: int, mbit: int, mib: int) -> float:
    with tempfile.TemporaryDirectory(prefix="threefs-scaleout-") as tmp, NetLab() as lab:
        work = Path(tmp)
        (work / "token").write_text("scaleout-token-" + "2" * 32 + "\n")
        (work / "token").chmod(0o600)
        storage = [f"s{i}" for i in range(1, n + 1)]
        addrs = {h: lab.add_host(h).address for h in ["ctl", *storage, "cli"]}
        for h in storage:
            lab.cap(h, mbit)
        spec = work / "hosts.toml"
        spec.write_text(spec_text(work, addrs, storage))
        for h in ["ctl", *storage]:
            wait = ["--wait"] if h == storage[-1] else []
            result = lab.run(h, [sys.executable, "-m", "threefs.cli.main", "up", "--spec", str(spec), *wait],
                             timeout=120)
            if result.returncode != 0:
                raise SystemExit(f"up on {h} failed: {result.stderr[-2000:]}")
        conf = str(work / storage[-1] / "client.toml")
        me = [sys.executable, os.path.abspath(__file__), "_client"]
        result = lab.run("cli", [*me, "write", conf, str(mib)], timeout=600)
        if result.returncode != 0:
            raise SystemExit(f"write failed: {result.stderr[-2000:]}")
        result = lab.run("cli", [*me, "read", conf, str(READERS)], timeout=600)
        if result.returncode != 0:
            raise SystemExit(f"read failed: {result.stderr[-2000:]}")
        return float(result.stdout.split()[-1])


def cmd_reads(args) -> None:
    base = None
    print(f"aggregate read MB/s, each storage host capped at {args.mbit} Mbit/s ({args.mbit / 8:.1f} MB/s), "
          f"{READERS} reader threads, {args.mib} MiB file, R=1")
    for n in [int(x) for x in args.hosts.split(",")]:
        rate = read_throughput(n, args.mbit, args.mib)
        base = base or rate / n
        print(f"  N={n}: {rate:7.1f} MB/s  = {rate / base:4.2f} x one host  (ideal {n}.00; link sum "
              f"{n * args.mbit / 8:.1f} MB/s)", flush=True)


# -- kv --------------------------------------------------------------------------------------------------
async def kv_rate(url: str, tasks: int, seconds: float, cpu_pids: list[int] | None = None, puts: int = 2) -> float:
    """Create-shaped commits/s of the engine at `url` with `tasks` concurrent tasks. With `cpu_pids` (the etcd
    members), KV_COSTS[url] gets what bounds it: commits per etcd Txn, this process's CPU per commit (the
    engine: Python, gRPC) and the members' CPU per commit (etcd itself)."""
    engine = await open_engine(url)
    done = 0
    stop = time.monotonic() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = 0
        while time.monotonic() < stop:
            async def create(tr, i=i):
                await tr.get(b"dir/%d" % w)
                tr.set(b"dentry/%d/%d" % (w, i), b"x" * 64)
                tr.set(b"inode/%d/%d" % (w, i), b"y" * 128)
                for j in range(puts - 2):  # --puts: a meta create commits 7 (inode, dentry, directory, ...)
                    tr.set(b"more%d/%d/%d" % (j, w, i), b"z" * 96)

            await engine.run(create)
            done += 1
            i += 1

    try:
        stats = getattr(engine, "stats", {})
        batches0 = stats.get("commit_batches", 0)
        etcd0 = sum(_cpu_s(p) for p in cpu_pids or [])
        own0 = time.process_time()
        start = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(tasks)))
        elapsed = time.monotonic() - start
        if cpu_pids and done:
            KV_COSTS[url] = (done / max(stats.get("commit_batches", 0) - batches0, 1),
                             (time.process_time() - own0) / done, (sum(_cpu_s(p) for p in cpu_pids) - etcd0) / done)
        return done / elapsed
    finally:
        await engine.close()


KV_COSTS: dict[str, tuple[float, float, float]] = {}  # url -> (commits per Txn, engine s, etcd s per commit)


async def plain_etcd_rate(endpoint: str, tasks: int, seconds: float, puts: int = 2) -> float:
    """The reference: plain etcd Txns through the same client library (grpcio, the engine's etcd_wire
    messages) at the same concurrency, each a guarded put of two keys (entry key absent -> put entry and inode)."""
    done = 0
    stop = time.monotonic() + seconds
    run = os.urandom(4).hex().encode()
    async with grpc.aio.insecure_channel(endpoint) as channel:
        txn = channel.unary_unary(wire.METHODS["txn"])

        async def worker(w: int) -> None:
            nonlocal done
            i = 0
            while time.monotonic() < stop:
                entry, inode = b"plain/%s/dentry/%d/%d" % (run, w, i), b"plain/%s/inode/%d/%d" % (run, w, i)
                more = [wire.op_put(wire.put_request(b"plain/%s/more%d/%d/%d" % (run, j, w, i), b"z" * 96))
                        for j in range(puts - 2)]
                request = wire.txn_request([wire.compare(entry, wire.CREATE, wire.EQUAL, 0)],
                                           [wire.op_put(wire.put_request(entry, b"x" * 64)),
                                            wire.op_put(wire.put_request(inode, b"y" * 128)), *more])
                reply = wire.txn_response(await txn(request, timeout=10))
                assert reply["succeeded"], reply
                done += 1
                i += 1

        start = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(tasks)))
        return done / (time.monotonic() - start)


def cmd_kv(args) -> None:
    if args.puts < 2:
        raise SystemExit("scaleout.py kv: --puts must be at least 2 (the entry and the inode)")
    print(f"create-shaped commits/s (read a parent key, write {args.puts} keys: entry, inode, ...), {args.seconds} s "
          f"per sample, "
          f"{args.repeats} interleaved samples per row (the machine is shared: the best counts, the median is "
          f"shown too); load {open('/proc/loadavg').read().split()[:3]}")
    with tempfile.TemporaryDirectory(prefix="threefs-kvrate-") as tmp:
        variants = [("", [])] + ([(" no-fsync", ["--unsafe-no-fsync"])] if args.no_fsync else [])
        for label, extra in variants:
            with EtcdCluster(Path(tmp) / f"etcd{label.strip()}", members=3, extra_args=extra) as etcd:
                first = etcd.endpoints.split(",")[0]
                for tasks in [int(x) for x in args.tasks.split(",")]:
                    samples: dict[str, list[float]] = {}
                    for rep in range(args.repeats):
                        members = [m.process.pid for m in etcd.members if m.process is not None]
                        rows = [("etcd x3", lambda: kv_rate(etcd.kv_url(f"b{tasks}-{rep}"), tasks, args.seconds,
                                                            members, args.puts)),
                                ("plain etcd txn", lambda: plain_etcd_rate(first, tasks, args.seconds, args.puts))]
                        if args.direct:
                            rows.append(("etcd x3 direct", lambda: kv_rate(
                                etcd.kv_url(f"d{tasks}-{rep}") + "?replica=off", tasks, args.seconds, None,
                                args.puts)))
                        if not label:
                            rows.append(("sqlite", lambda: kv_rate(f"sqlite:///{tmp}/kv{tasks}-{rep}.db", tasks,
                                                                   args.seconds, None, args.puts)))
                        for name, run in rows:
                            samples.setdefault(name, []).append(asyncio.run(run()))
                    for name, rates in samples.items():
                        print(f"  {name + label:24} {tasks:2} tasks: best {max(rates):6.0f} /s  median "
                              f"{statistics.median(rates):6.0f}  ({', '.join(f'{r:.0f}' for r in rates)})")
                    costs = [KV_COSTS[etcd.kv_url(f"b{tasks}-{rep}")] for rep in range(args.repeats)]
                    print(f"  {'etcd x3' + label:24} {tasks:2} tasks, per commit (median of samples): "
                          f"{statistics.median(c[0] for c in costs):.2f} commits per etcd Txn, engine process CPU "
                          f"{statistics.median(c[1] for c in costs) * 1e3:.3f} ms, etcd members' CPU "
                          f"{statistics.median(c[2] for c in costs) * 1e3:.3f} ms")
                    ours, ref = samples["etcd x3"], samples["plain etcd txn"]
                    paired = [a / b for a, b in zip(ours, ref)]
                    print(f"  -> etcd engine / plain etcd txn{label}: best {max(ours) / max(ref):.2f}x, "
                          f"median of paired samples {statistics.median(paired):.2f}x (goal >= 0.5x); load "
                          f"{open('/proc/loadavg').read().split()[:3]}", flush=True)


# -- creates -------------------------------------------------------------------------------------------
STATS_KEYS = ("requests", "txns", "commits", "commit_batches", "conflicts", "clear_rounds", "grv", "reads",
              "spec_resends", "spec_stale", "stale_errors", "conflict_rvs", "grv_wait_s", "replica_wait_s",
              "commit_wait_s", "txn_call_s")


def kv_stats(stats_dir: str) -> dict[str, float]:
    """The sum of the etcd engines' counters (THREEFS_KV_STATS_DIR dumps of the meta and mgmtd processes)."""
    import json

    total = dict.fromkeys(STATS_KEYS, 0.0)
    for name in os.listdir(stats_dir):
        if name.endswith(".json"):
            try:
                with open(os.path.join(stats_dir, name)) as f:
                    stats = json.load(f)
            except (OSError, ValueError):
                continue
            for key in STATS_KEYS:
                total[key] += stats.get(key, 0)
    return total


def _connect(conf: str):
    """Client.connect, retried for CONNECT_RETRY_S: on a loaded machine mgmtd's 1.5 s primary lease can lapse
    for a moment (a lease pass delayed past it), and a client starting then is told to retry."""
    from threefs.client.client import Client
    from threefs.common.status import StatusCode, ThreeFSError

    deadline = time.monotonic() + CONNECT_RETRY_S
    while True:
        try:
            return Client.connect(conf)
        except ThreeFSError as exc:
            if exc.code != StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


CONNECT_RETRY_S = 30.0
BARRIER_TIMEOUT_S = 120.0


def _counted_client(conf: str, k: int, files: int, tag: str, barrier, results) -> None:
    with _connect(conf) as fs:
        d = f"/counted-{tag}/c{k}"
        fs.mkdir(d, parents=True, exist_ok=True)
        barrier.wait(BARRIER_TIMEOUT_S)  # connected, directory made
        barrier.wait(BARRIER_TIMEOUT_S)  # the counters and CPU times read: go
        start = time.perf_counter()
        for i in range(files):
            with fs.open(f"{d}/f{i}", "xb"):
                pass
        fs.close()  # the deferred closes (close_many) belong to the creates
        results.put((start, time.perf_counter()))


def _cpu_s(pid: int) -> float:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counted_creates(conf: str, clients: int, files: int, tag: str, stats_dir: str,
                    pids: dict[str, list[int]]) -> dict[str, float]:
    """Creates by `clients` processes with the etcd engines' counters read before and after: per create,
    etcd requests, transactions, commits and conflicts (what bounds the rate), and the rate itself."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [ctx.Process(target=_counted_client, args=(conf, k, files // clients, tag, barrier, results))
             for k in range(clients)]
    for p in procs:
        p.start()
    try:
        barrier.wait(BARRIER_TIMEOUT_S)  # every client connected and has its directory
        time.sleep(STATS_SETTLE_S)
        before = kv_stats(stats_dir)
        cpu0 = {group: sum(_cpu_s(p) for p in members) for group, members in pids.items()}
        # Only then do the clients start (they once started at the first barrier, and a fast pass was over
        # before `before` was read: its counters and CPU then covered only part of the creates, or none).
        barrier.wait(BARRIER_TIMEOUT_S)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    spans = [results.get(timeout=600) for _ in procs]
    cpu1 = {group: sum(_cpu_s(p) for p in members) for group, members in pids.items()}
    for p in procs:
        p.join(60)
    time.sleep(STATS_SETTLE_S)
    after = kv_stats(stats_dir)
    n = files // clients * clients
    out = {key: (after[key] - before[key]) / n for key in STATS_KEYS}
    for group in pids:
        out["cpu " + group] = (cpu1[group] - cpu0[group]) / n
    out["rate"] = n / (max(e for _, e in spans) - min(s for s, _ in spans))
    return out


STATS_SETTLE_S = 1.2  # the engines dump their counters every 0.5 s


def cmd_creates(args) -> None:
    """threefs creates/s (open O_CREAT|O_EXCL + close, metadata.py's create phase, one process per client)
    on a local cluster whose mgmtd + 2 meta keep the metadata on SQLite, then on a 3-member etcd."""
    from benchmarks.metadata import run_system  # the mdtest-like driver: barrier-timed client processes
    from threefs.cli.cluster import LocalCluster

    print(f"threefs creates/s, {args.clients} client processes, {args.files} files in all; "
          f"load {open('/proc/loadavg').read().split()[:3]}")
    with tempfile.TemporaryDirectory(prefix="threefs-creates-") as tmp:
        stats_dir = os.path.join(tmp, "kv-stats")
        os.makedirs(stats_dir)
        os.environ["THREEFS_KV_STATS_DIR"] = stats_dir  # inherited by the clusters' services
        with EtcdCluster(Path(tmp) / "etcd", members=args.members) as etcd:
            rates = {}
            for rep in range(args.repeats):
                systems = [("sqlite", ""), ("etcd", etcd.kv_url(f"fs{rep}"))]
                if args.direct:
                    systems.append(("etcd direct", etcd.kv_url(f"fd{rep}") + "?replica=off"))
                if args.eager_grv:
                    systems.append(("etcd eager", etcd.kv_url(f"fe{rep}")))
                for name, kv in systems:
                    cluster = LocalCluster(os.path.join(tmp, f"cluster-{name.replace(' ', '-')}-{rep}"))
                    os.environ["THREEFS_ETCD_EAGER_GRV"] = "1" if name == "etcd eager" else "0"
                    try:
                        cluster.up(3, 3, meta=2, kv=kv)  # inside: a failed start leaves services to stop
                        if name != "sqlite" and rep == 0:  # before run_system, whose unlinks keep GC busy
                            running = cluster.running()
                            pids = {"meta": [p for n, p in running.items() if n.startswith("meta")],
                                    "etcd": [m.process.pid for m in etcd.members if m.process is not None],
                                    "mgmtd": [p for n, p in running.items() if n.startswith("mgmtd")],
                                    "storage": [p for n, p in running.items()
                                                if not n.startswith(("meta", "mgmtd"))]}
                            c = counted_creates(str(cluster.client_config_path), args.clients, args.files,
                                                f"r{rep}", stats_dir, pids)
                            print(f"  {name:8} per create (a second, counted pass at {c['rate']:.0f}/s): "
                                  f"{c['requests']:.2f} etcd requests, {c['txns']:.2f} transactions, "
                                  f"{c['commits']:.2f} commits in {c['commit_batches']:.2f} etcd Txns, "
                                  f"{c['conflicts']:.3f} conflicts, {c['clear_rounds']:.3f} clear rounds, "
                                  f"{c['grv']:.2f} read versions, {c['reads']:.2f} etcd reads; waits "
                                  f"{c['grv_wait_s'] * 1e3:.1f} ms read version, {c['replica_wait_s'] * 1e3:.1f} ms "
                                  f"replica, {c['commit_wait_s'] * 1e3:.1f} ms commit (summed over the "
                                  f"create's transactions; etcd Txn calls "
                                  f"{c['txn_call_s'] / max(c['commit_batches'], 1e-9) * 1e3:.1f} ms each); CPU ms "
                                  f"per create: "
                                  + ", ".join(f"{g} {c['cpu ' + g] * 1e3:.2f}" for g in pids), flush=True)
                        # every server process of the system: the cluster's, and etcd's members on etcd
                        servers = list(cluster.running().values())
                        if name != "sqlite":
                            servers += [m.process.pid for m in etcd.members if m.process is not None]
                        rate, client_us, server_us = run_system("threefs", str(cluster.client_config_path),
                                                                args.clients, args.files, f"r{rep}",
                                                                servers)["create"]
                    finally:
                        cluster.down()
                    rates[name] = max(rates.get(name, 0.0), rate)
                    print(f"  {name:8} run {rep + 1}: {rate:7.0f} creates/s; CPU per create: clients "
                          f"{client_us:.0f} µs, servers {server_us:.0f} µs (2 cores: at most "
                          f"{2e6 / (client_us + server_us):.0f} creates/s at this CPU per create); load "
                          f"{open('/proc/loadavg').read().split()[:3]}", flush=True)
            print(f"  -> etcd ({args.members} members) / sqlite = {rates['etcd'] / rates['sqlite']:.2f}x (best runs; "
                  f"goal >= 0.5x)")
            if args.direct:
                print(f"  -> etcd without its replica / sqlite = {rates['etcd direct'] / rates['sqlite']:.2f}x")
            if args.eager_grv:
                print(f"  -> etcd asking read versions eagerly / sqlite = "
                      f"{rates['etcd eager'] / rates['sqlite']:.2f}x")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_client":
        client_main(*sys.argv[2:5])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(required=True)
    r = sub.add_parser("reads")
    r.add_argument("--hosts", default="1,2,3,4")
    r.add_argument("--mbit", type=int, default=200)
    r.add_argument("--mib", type=int, default=48)
    r.set_defaults(fn=cmd_reads)
    k = sub.add_parser("kv")
    k.add_argument("--seconds", type=float, default=2.0)
    k.add_argument("--repeats", type=int, default=3)
    k.add_argument("--tasks", default="1,8")
    k.add_argument("--direct", action="store_true", help="also the engine with ?replica=off")
    k.add_argument("--puts", type=int, default=2, help="keys each commit writes, both sides (a meta create: 7)")
    k.add_argument("--no-fsync", action="store_true", help="also a cluster with --unsafe-no-fsync (not the "
                   "product figure: shows what etcd's fsync costs)")
    k.set_defaults(fn=cmd_kv)
    c = sub.add_parser("creates")
    c.add_argument("--clients", type=int, default=8)
    c.add_argument("--files", type=int, default=800)
    c.add_argument("--repeats", type=int, default=1)
    c.add_argument("--members", type=int, default=3, help="etcd members (1: what one member costs, not HA)")
    c.add_argument("--direct", action="store_true", help="also etcd with ?replica=off (every read from etcd)")
    c.add_argument("--eager-grv", action="store_true", help="also etcd with speculative transactions asking "
                   "their read version at the start (THREEFS_ETCD_EAGER_GRV=1)")
    c.set_defaults(fn=cmd_creates)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
