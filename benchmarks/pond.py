"""pond against smallpond 0.15.0, side by side in one run, on the same generated data.

Data: 8 Parquet files, 10 M rows (ticker: 1,000 values, when: int64, price: double).
Workloads (each in a fresh process per framework, after its init; init is reported apart):
  (a) repartition(8, hash_by="ticker") + GROUP BY + write_parquet
  (b) repartition(8, by_rows=True) + partial_sort("price") + write_parquet
  (c) the README example: repartition(3, hash_by="ticker") + min/max per ticker + write_parquet + to_pandas
on a local directory and on threefs (data and data_root on the FUSE mount of a local cluster).

smallpond runs from its own venv (`pip install smallpond==0.15.0 "duckdb<1.4"`, default .bench/sp-venv or
--smallpond-python), with Ray pre-started on loopback and no dashboard; pond uses its local executor.

    .venv/bin/python benchmarks/pond.py [--rows 10000000] [--repeat 1] [--no-threefs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

WORKLOAD = r'''
import json, os, sys, time
mode, data, root, out = sys.argv[1:5]

def tree_cpu():
    """CPU seconds of this process and all its descendants (Ray's raylet, GCS and workers; pond's
    forkserver and workers): under a shared, loaded machine this is the fairer figure."""
    tick = os.sysconf("SC_CLK_TCK")
    procs = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                procs[int(p)] = (int(fields[1]), sum(int(x) for x in fields[11:15]) / tick)
            except (OSError, ValueError):
                pass
    me, total = os.getpid(), 0.0
    for pid, (ppid, cpu) in procs.items():
        x = pid
        for _ in range(64):
            if x == me or x not in procs or x <= 1:
                break
            x = procs[x][0]
        if x == me:
            total += cpu
    return total
t0 = time.time()
if mode == "smallpond":
    import ray, smallpond
    addr = ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                    log_to_driver=False).address_info["gcs_address"]
    t1 = time.time()
    sp = smallpond.init(data_root=root, ray_address=addr)
else:
    import threefs.pond as smallpond
    t1 = time.time()
    sp = smallpond.init(data_root=root, progress=False)
    sp._executor.warm_up()
t2 = time.time()
res = {"import_ray_s": t1 - t0, "init_s": t2 - t1}
glob = os.path.join(data, "*.parquet")

def a():
    df = sp.read_parquet(glob).repartition(8, hash_by="ticker")
    df = sp.partial_sql("select ticker, min(price) as lo, max(price) as hi, count(*) as n from {0} group by ticker", df)
    df.write_parquet(os.path.join(out, "a"))

def b():
    df = sp.read_parquet(glob).repartition(8, by_rows=True).partial_sort("price")
    df.write_parquet(os.path.join(out, "b"))

def c():
    df = sp.read_parquet(glob)
    df = df.repartition(3, hash_by="ticker")
    df = sp.partial_sql("SELECT ticker, min(price), max(price) FROM {0} GROUP BY ticker", df)
    df.write_parquet(os.path.join(out, "c"))
    pdf = df.to_pandas()
    assert len(pdf) == 1000, len(pdf)

for name, fn in (("a", a), ("b", b), ("c", c)):
    s, c0 = time.time(), tree_cpu()
    fn()
    res[name] = time.time() - s
    res[name + "_cpu"] = tree_cpu() - c0
print("RESULT " + json.dumps(res))
sys.stdout.flush()
if mode == "pond":
    sp.shutdown()  # stops the worker processes (they would hold this process's pipes open)
else:
    ray.shutdown()
os._exit(0)
'''


def generate(data_dir: str, rows: int, files: int = 8) -> None:
    import duckdb
    os.makedirs(data_dir, exist_ok=True)
    con = duckdb.connect()
    per = rows // files
    for i in range(files):
        con.execute(f"""COPY (select 'T' || lpad(((i * 7919) % 1000)::VARCHAR, 4, '0') as ticker,
                              (1700000000000 + i)::BIGINT as "when",
                              round(100 + 50 * sin(i / 1000.0) + (hash(i) % 1000) / 100.0, 2)::DOUBLE as price
                       from range({i * per}, {(i + 1) * per}) t(i))
                       TO '{data_dir}/part-{i}.parquet' (FORMAT PARQUET)""")


def run(python: str, mode: str, data: str, root: str, out: str, env=None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    proc = subprocess.run([python, "-c", WORKLOAD, mode, data, root, out], capture_output=True, text=True,
                          timeout=900, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{mode} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def check_same(out_pond: str, out_sp: str) -> str:
    """The GROUP BY results of both frameworks, compared as multisets."""
    import duckdb
    q = "select ticker, lo, hi, n from read_parquet('{}/a/*.parquet') order by ticker"
    a = duckdb.sql(q.format(out_pond)).fetchall()
    b = duckdb.sql(q.format(out_sp)).fetchall()
    return "identical" if a == b else f"DIFFERENT ({len(a)} vs {len(b)} rows)"


def bench(label: str, base: str, data: str, sp_python: str, repeat: int) -> list:
    rows = []
    for r in range(repeat):
        load = open("/proc/loadavg").read().split()[0]
        sp = run(sp_python, "smallpond", data, os.path.join(base, "sp-root"), os.path.join(base, "sp-out"))
        pd_ = run(sys.executable, "pond", data, os.path.join(base, "pond-root"), os.path.join(base, "pond-out"))
        same = check_same(os.path.join(base, "pond-out"), os.path.join(base, "sp-out"))
        for w in ("a", "b", "c"):
            rows.append((label, w, sp[w], pd_[w], pd_[w] / sp[w], sp[w + "_cpu"], pd_[w + "_cpu"], load))
        print(f"[{label} run {r + 1}] init: smallpond {sp['init_s']:.2f} s (+ ray.init {sp['import_ray_s']:.2f} s), "
              f"pond {pd_['init_s']:.2f} s; (a) results {same}; load {load}", flush=True)
        for w in ("a", "b", "c"):
            print(f"   ({w}) smallpond {sp[w]:6.2f} s   pond {pd_[w]:6.2f} s   ratio {pd_[w] / sp[w]:.2f}   "
                  f"cpu: smallpond {sp[w + '_cpu']:.2f} s, pond {pd_[w + '_cpu']:.2f} s, "
                  f"ratio {pd_[w + '_cpu'] / max(sp[w + '_cpu'], 1e-9):.2f}", flush=True)
    return rows


def access_paths(cluster, mnt: str, tdata: str) -> list:
    """DuckDB on threefs two ways: through the FUSE mount (POSIX) and as threefs:// (fsspec, no mount)."""
    import duckdb
    import fsspec
    os.environ["THREEFS_CONFIG"] = str(cluster.client_config_path)
    fs = fsspec.filesystem("threefs", config=str(cluster.client_config_path))
    rel = tdata[len(mnt):]
    out = []
    for label, con_setup, base in (("mount", None, tdata), ("threefs://", fs, "threefs://" + rel)) * 3:
        con = duckdb.connect(config={"threads": 2})
        if con_setup is not None:
            con.register_filesystem(con_setup)
        t = time.time()
        con.execute(f"select count(*), sum(price) from read_parquet('{base}/*.parquet')").fetchall()
        scan = time.time() - t
        target = (os.path.join(os.path.dirname(tdata), "w-mount.parquet") if con_setup is None
                  else "threefs://" + os.path.dirname(rel) + "/w-url.parquet")
        t = time.time()
        con.execute(f"COPY (select * from read_parquet('{base}/part-0.parquet')) TO '{target}' "
                    "(FORMAT PARQUET, OVERWRITE_OR_IGNORE true)").fetchall()
        write = time.time() - t
        out.append((label, scan, write))
        print(f"   duckdb via {label:10}: scan 8 files {scan:.2f} s, write 1 file {write:.2f} s", flush=True)
    # removing a job's temporaries: a walk through the mount against one remove_tree call
    for rep in range(2):
        times = {}
        for how in ("rmtree via mount", "remove_tree via client"):
            top = os.path.join(os.path.dirname(tdata), f"tmp-{rep}-{how[:6]}")
            for d in range(10):
                os.makedirs(os.path.join(top, f"d{d}"), exist_ok=True)
                for f in range(20):
                    with open(os.path.join(top, f"d{d}", f"f{f}"), "wb") as fh:
                        fh.write(b"x")
            t = time.time()
            if how.startswith("rmtree"):
                shutil.rmtree(top)
            else:
                fs.client.remove_tree(top[len(mnt):])
            times[how] = time.time() - t
        print("   remove 10 dirs x 20 files: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--smallpond-python", default=os.path.join(ROOT, ".bench", "sp-venv", "bin", "python"))
    ap.add_argument("--no-threefs", action="store_true")
    ap.add_argument("--storage", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--access-paths-only", action="store_true", help="only DuckDB via the mount vs threefs://")
    args = ap.parse_args()
    if not os.path.exists(args.smallpond_python):
        sys.exit("smallpond venv missing: python3 -m venv .bench/sp-venv && "
                 ".bench/sp-venv/bin/pip install smallpond==0.15.0 'duckdb<1.4'")
    tmp = tempfile.mkdtemp(prefix="pond-bench-")
    rows = []
    try:
        data = os.path.join(tmp, "data")
        t = time.time()
        generate(data, args.rows)
        print(f"data: {args.rows} rows in 8 files, {sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data)) / 1e6:.0f} MB "
              f"({time.time() - t:.1f} s)", flush=True)
        if not args.access_paths_only:
            rows += bench("local", os.path.join(tmp, "local"), data, args.smallpond_python, args.repeat)
        if not args.no_threefs:
            from benchmarks.common import local_cluster
            with local_cluster(tmp, args.storage, args.replicas, fuse=True) as (cluster, mnt):
                if mnt is None:
                    print("threefs rows skipped: no FUSE mount here")
                else:
                    base = os.path.join(mnt, "bench")
                    os.makedirs(base, exist_ok=True)
                    tdata = os.path.join(base, "data")
                    shutil.copytree(data, tdata)
                    if not args.access_paths_only:
                        rows += bench("threefs", base, tdata, args.smallpond_python, args.repeat)
                    access_paths(cluster, mnt, tdata)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nstorage  workload  smallpond_s  pond_s  ratio  smallpond_cpu_s  pond_cpu_s  cpu_ratio  load")
    for label, w, s, p, ratio, scpu, pcpu, load in rows:
        print(f"{label:8} ({w})       {s:8.2f}  {p:6.2f}  {ratio:5.2f}  {scpu:15.2f}  {pcpu:10.2f}  "
              f"{pcpu / max(scpu, 1e-9):9.2f}  {load}")


if __name__ == "__main__":
    main()
