"""Metadata operations per second (mdtest-like): threefs through RPC beside meta's engine without RPC.

    .venv/bin/python benchmarks/metadata.py [--files 1600] [--clients 1,8] [--repeats 2] [--dir DIR]

Phases, each timed from a barrier to a barrier across all client processes:
  create   open(O_CREAT|O_EXCL|O_WRONLY) + close of an empty file   (mdtest's file creation)
  stat     stat of each file by path
  readdir  list the client's directory, 5 times (entries listed per second)
  unlink   unlink of each file
Every client is its own process (8 clients = 8 processes, as real clients are) with its own connection
(threefs: its own Client), working in its own directory of `--files` files (divided among clients with
--clients > 1, so the total stays the same).

Systems (each run --repeats times, interleaved; the best run counts, since the machine is shared):
  threefs  a local cluster (2 meta servers on one SQLite KV, 3 storage) in a temp dir, via the public Client
           API: `with fs.open(path, "xb"): pass`, fs.stat, fs.listdir, fs.remove on /bench-TAG-cK/fN, as deep
           as the engine's /cK/fN (the same path walk on both sides; a fresh cluster per client
           count; default GC delay, so unlinked files' chunks are removed after the run, as in 3FS)
  meta no RPC  "the engine without RPC": meta's MetaStore run inside each client process on its own SQLite KV,
           doing what the servers do for the same calls (an open per create, and the untouched files'
           sessions ended in batches of DEFERRED_CLOSES_MAX, as the client library sends them): meta's own
           cost, apart from the transport's
  raw KV   the same SQLite engine, opened by each client process, running the same kind of transactions
           (the same keys and value sizes: dentry + inode + parent + session on create, sessions ended in
           batches; a GC entry on unlink) with none of meta's logic: no path walk, permission checks, id
           blocks, idempotency records, RPC
  local    os.* in a temp dir on this machine's disk
CPU per operation is measured too (threefs: the client processes and the two meta servers, from /proc; the
engine: its client processes): with 8 clients on this 2-core machine, CPU per operation is what bounds the
rates. The machine is shared and noisy: compare the ratios within one run. Goal: threefs >= 0.5x the engine
without RPC, one client and 8.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from threefs.cli.cluster import LocalCluster  # noqa: E402
from threefs.client.client import DEFERRED_CLOSES_MAX, Client  # noqa: E402
from threefs.kv import open_engine  # noqa: E402
from threefs.meta import schema  # noqa: E402
from threefs.meta.schema import FILE, Dentry, GcEntry, Inode, WriteSession  # noqa: E402
from threefs.meta.store import Caller, MetaStore  # noqa: E402

PHASES = ("create", "stat", "readdir", "unlink")
SYSTEMS = ("threefs", "meta no RPC", "raw KV", "local")
READDIR_ROUNDS = 5
WRITE_NEW = os.O_CREAT | os.O_EXCL | os.O_WRONLY


# -- the three systems, one client each ------------------------------------------------------------------


class ThreefsClient:
    def __init__(self, config: str, k: int, tag: str):
        self.fs = Client.connect(config)
        # One level below the root, as the engine's /c{k}: the same path walk (a dentry per level) on both
        # sides. (It was /bench-{tag}/c{k}: one dentry more per call than the engine read.)
        self.dir = f"/bench-{tag}-c{k}"
        self.fs.mkdir(self.dir, parents=True, exist_ok=True)

    def create(self, i: int) -> None:
        with self.fs.open(f"{self.dir}/f{i}", "xb"):
            pass

    def end_phase(self) -> None:
        """The last partial batch of ended write sessions (empty files closed, DEFERRED_CLOSES_MAX a batch),
        sent now, untimed, as the engine's end_phase sends its own: left to the client library's timer it
        went out up to 0.2 s later, inside the next phase's (stat's) timed window."""
        self.fs._flush_closes()

    def stat(self, i: int) -> None:
        self.fs.stat(f"{self.dir}/f{i}")

    def readdir(self) -> int:
        return len(self.fs.listdir(self.dir))

    def unlink(self, i: int) -> None:
        self.fs.remove(f"{self.dir}/f{i}")

    def close(self) -> None:
        self.fs.close()


class InProcessMetaClient:
    """meta's operations (MetaStore) run in the client process on the SQLite KV: threefs without the RPC
    hop, to tell meta's own cost from the transport's."""

    def __init__(self, url: str, k: int, tag: str):
        self.loop = asyncio.new_event_loop()
        self.kv = self.loop.run_until_complete(open_engine(url))
        self.store = MetaStore(self.kv, table_info=lambda table_id: (table_id, 1, 4))
        self.caller = Caller(client_id=f"bench-{k}")
        self.rids = iter(range(1, 1 << 62))
        self.dir = f"/c{k}"
        self.untouched: list[tuple[int, str]] = []  # sessions to end in a batch, as the client library does
        self._run(self.store.init())
        self._run(self.store.mkdir(self.dir, parents=True))

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    def _call(self) -> Caller:
        return self.caller._replace(request_id=next(self.rids))

    def create(self, i: int) -> None:
        rsp = self._run(self.store.open(f"{self.dir}/f{i}", WRITE_NEW, caller=self._call()))
        self.untouched.append((rsp.attr.inode, rsp.session))
        if len(self.untouched) >= DEFERRED_CLOSES_MAX:
            self.end_phase()

    def end_phase(self) -> None:
        if self.untouched:
            self._run(self.store.end_sessions(self.untouched, self.caller.client_id))
            self.untouched = []

    def stat(self, i: int) -> None:
        self._run(self.store.stat(f"{self.dir}/f{i}"))

    def readdir(self) -> int:
        count, after = 0, ""
        while True:
            entries, more = self._run(self.store.readdir(self.dir, after))
            count += len(entries)
            if not more:
                return count
            after = entries[-1].name

    def unlink(self, i: int) -> None:
        self._run(self.store.unlink(f"{self.dir}/f{i}", caller=self._call()))

    def close(self) -> None:
        self.loop.run_until_complete(self.kv.close())
        self.loop.close()


class LocalClient:
    def __init__(self, root: str, k: int, tag: str):
        self.dir = f"{root}/c{k}"
        os.makedirs(self.dir, exist_ok=True)

    def create(self, i: int) -> None:
        os.close(os.open(f"{self.dir}/f{i}", WRITE_NEW, 0o644))

    def stat(self, i: int) -> None:
        os.stat(f"{self.dir}/f{i}")

    def readdir(self) -> int:
        return len(os.listdir(self.dir))

    def unlink(self, i: int) -> None:
        os.unlink(f"{self.dir}/f{i}")

    def close(self) -> None:
        pass


class RawKVClient:
    """Meta's transactions without meta: the same keys, values and conflict footprint, nothing else."""

    DIR_BASE = 1 << 40  # directory inode ids of the clients; files get ids above them

    def __init__(self, url: str, k: int, tag: str):
        self.loop = asyncio.new_event_loop()
        self.kv = self.loop.run_until_complete(open_engine(url))
        self.dir_id = self.DIR_BASE + k
        self.next_inode = self.DIR_BASE + (k + 1) * 10_000_000
        now = time.time_ns()
        self.dir = Inode(type=2, mode=0o755, uid=0, gid=0, nlink=1, atime_ns=now, mtime_ns=now, ctime_ns=now)
        self.loop.run_until_complete(self.kv.run(self._mkdir))
        self.ids: dict[int, int] = {}
        self.untouched: list[tuple[int, str]] = []

    async def _mkdir(self, tr) -> None:
        tr.set(schema.inode_key(self.dir_id), schema.encode(self.dir))

    def _run(self, fn):
        return self.loop.run_until_complete(self.kv.run(fn))

    def create(self, i: int) -> None:
        name, inode_id, now = f"f{i}", self.next_inode, time.time_ns()
        self.next_inode += 1
        session = os.urandom(8).hex()

        async def create(tr):
            if await tr.get(schema.dentry_key(self.dir_id, name)) is not None:
                raise FileExistsError(name)
            parent = schema.decode_inode(await tr.get(schema.inode_key(self.dir_id), snapshot=True))
            parent.mtime_ns = parent.ctime_ns = now
            inode = Inode(type=FILE, mode=0o644, uid=0, gid=0, nlink=1, atime_ns=now, mtime_ns=now,
                          ctime_ns=now)
            tr.set(schema.inode_key(inode_id), schema.encode(inode))
            tr.set(schema.dentry_key(self.dir_id, name), schema.encode(Dentry(inode_id, FILE)))
            tr.set(schema.inode_key(self.dir_id), schema.encode(parent))
            tr.set(schema.session_key(inode_id, session), schema.encode(WriteSession("c", now)))

        self._run(create)
        self.ids[i] = inode_id
        self.untouched.append((inode_id, session))
        if len(self.untouched) >= DEFERRED_CLOSES_MAX:
            self.end_phase()

    def end_phase(self) -> None:
        untouched, self.untouched = self.untouched, []

        async def end_sessions(tr):
            for inode_id, session in untouched:
                await tr.get(schema.session_key(inode_id, session))
                tr.clear(schema.session_key(inode_id, session))

        if untouched:
            self._run(end_sessions)

    def stat(self, i: int) -> None:
        async def stat(tr):
            raw = await tr.get(schema.dentry_key(self.dir_id, f"f{i}"), snapshot=True)
            dentry = schema.decode_dentry(raw)
            return schema.decode_inode(await tr.get(schema.inode_key(dentry.inode), snapshot=True))

        self._run(stat)

    def readdir(self) -> int:
        begin, end = schema.dentry_range(self.dir_id)

        async def page(tr, start):
            return await tr.get_range(start, end, limit=1025, snapshot=True)

        count, start = 0, begin
        while True:  # pages of 1024, as meta's readdir
            rows = self._run(lambda tr: page(tr, start))
            count += len(rows[:1024])
            [schema.decode_dentry(v) for _, v in rows[:1024]]
            if len(rows) <= 1024:
                return count
            start = rows[1023][0] + b"\x00"

    def unlink(self, i: int) -> None:
        name, now = f"f{i}", time.time_ns()

        async def unlink(tr):
            key = schema.dentry_key(self.dir_id, name)
            dentry = schema.decode_dentry(await tr.get(key))
            inode = schema.decode_inode(await tr.get(schema.inode_key(dentry.inode)))
            parent = schema.decode_inode(await tr.get(schema.inode_key(self.dir_id), snapshot=True))
            inode.nlink, parent.mtime_ns = 0, now
            tr.clear(key)
            tr.set(schema.inode_key(dentry.inode), schema.encode(inode))
            entry = GcEntry(dentry.inode, None, 0, now)
            tr.set(schema.gc_key(entry), schema.encode(entry))
            tr.set(schema.inode_key(self.dir_id), schema.encode(parent))

        self._run(unlink)

    def close(self) -> None:
        self.loop.run_until_complete(self.kv.close())
        self.loop.close()


# -- driver ------------------------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_main(system: str, target: str, k: int, files: int, barrier, results, tag: str,
                 server_pids: list[int]) -> None:
    kinds = {"threefs": ThreefsClient, "meta no RPC": InProcessMetaClient, "raw KV": RawKVClient,
             "local": LocalClient}
    client = kinds[system](target, k, tag)
    try:
        for phase in PHASES:
            barrier.wait()
            s0 = sum(_cpu_s(p) for p in server_pids) if k == 0 else 0.0
            c0, t0 = time.process_time(), time.perf_counter()
            if phase == "readdir":
                ops = sum(client.readdir() for _ in range(READDIR_ROUNDS))
            else:
                for i in range(files):
                    getattr(client, phase)(i)
                ops = files
            t1, c1 = time.perf_counter(), time.process_time()
            barrier.wait()
            s1 = sum(_cpu_s(p) for p in server_pids) if k == 0 else 0.0
            getattr(client, "end_phase", lambda: None)()  # the last partial batch of sessions, untimed
            results.put((phase, k, ops, t0, t1, c1 - c0, s1 - s0))
    finally:
        client.close()


def run_system(system: str, target: str, clients: int, files: int, tag: str,
               server_pids: list[int]) -> dict[str, tuple[float, float, float]]:
    """Per phase: (ops/s over the span from the first start to the last end, client CPU µs per op, server
    CPU µs per op)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(clients), ctx.Queue()
    per_client = files // clients
    procs = [ctx.Process(target=_client_main, args=(system, target, k, per_client, barrier, results, tag,
                                                    server_pids))
             for k in range(clients)]
    for p in procs:
        p.start()
    rows = [results.get(timeout=600) for _ in range(clients * len(PHASES))]
    for p in procs:
        p.join(60)
    out = {}
    for phase in PHASES:
        mine = [r for r in rows if r[0] == phase]
        span = max(r[4] for r in mine) - min(r[3] for r in mine)
        ops = sum(r[2] for r in mine)
        out[phase] = (ops / span, sum(r[5] for r in mine) / ops * 1e6, sum(r[6] for r in mine) / ops * 1e6)
    return out


def measure(work: str, clients: int, files: int, repeats: int) -> dict[str, dict[str, tuple]]:
    """Best of `repeats` runs per system and phase, systems interleaved (the machine is shared: the best
    run is the one least disturbed). A fresh cluster per client count, so no GC backlog carries over."""
    cluster = LocalCluster(os.path.join(work, f"cluster-{clients}"))
    cluster.up(3, 3, meta=2)
    meta_pids = [pid for name, pid in cluster.running().items() if name.startswith("meta")]
    best: dict[str, dict[str, tuple]] = {s: dict.fromkeys(PHASES, (0.0, 0.0, 0.0)) for s in SYSTEMS}
    try:
        for rep in range(repeats):
            tag = f"n{clients}-r{rep}"
            targets = {"threefs": str(cluster.client_config_path),
                       "meta no RPC": f"sqlite:///{work}/meta-{tag}.db",
                       "raw KV": f"sqlite:///{work}/raw-{tag}.db",
                       "local": os.path.join(work, "local", tag)}
            os.makedirs(targets["local"])
            for system in SYSTEMS:
                rates = run_system(system, targets[system], clients, files, tag,
                                   meta_pids if system == "threefs" else [])
                for phase in PHASES:
                    if rates[phase][0] > best[system][phase][0]:
                        best[system][phase] = rates[phase]
    finally:
        cluster.down()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=1600, help="files per run (split among clients)")
    parser.add_argument("--clients", default="1,8", help="client counts to run, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system; the best counts")
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed after)")
    args = parser.parse_args()
    work = args.dir or tempfile.mkdtemp(prefix="threefs-mdbench-")
    table = []
    load_before = open("/proc/loadavg").read().split()[:3]
    try:
        for n in [int(c) for c in args.clients.split(",")]:
            best = measure(work, n, args.files, args.repeats)
            for phase in PHASES:
                table.append((phase, n, *(best[s][phase] for s in SYSTEMS)))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'phase':<8} {'clients':>7} {'threefs/s':>10} {'no RPC/s':>10} {'raw KV/s':>10} "
          f"{'local/s':>10} {'vs no RPC':>9} {'vs raw':>7} {'vs local':>8}   CPU us/op: {'3fs client':>10} "
          f"{'3fs meta':>8} {'no RPC':>7}")
    for phase, n, ours, inproc, raw, local in table:
        print(f"{phase:<8} {n:>7} {ours[0]:>10,.0f} {inproc[0]:>10,.0f} {raw[0]:>10,.0f} {local[0]:>10,.0f} "
              f"{ours[0] / inproc[0]:>8.2f}x {ours[0] / raw[0]:>6.2f}x {ours[0] / local[0]:>7.3f}x   "
              f"{'':>10} {ours[1]:>10.0f} {ours[2]:>8.0f} {inproc[1]:>7.0f}")
    print(f"(best of --repeats runs; clients are processes; readdir: entries listed per second; load average "
          f"before {' '.join(load_before)}, after {' '.join(open('/proc/loadavg').read().split()[:3])}; "
          f"goal: threefs >= 0.5x the engine without RPC)")


if __name__ == "__main__":
    main()
