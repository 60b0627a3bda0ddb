"""GraySort: threefs (pond's two-phase sort through a local cluster) beside DuckDB's single-node sort of the
same records (docs/graysort.md).

    .venv/bin/python benchmarks/graysort.py [--gib 8] [--partitions 64] [--short]

1. a local cluster (1 storage service, 1 replica) in a temporary directory on the local disk;
2. gensort: the records, as `--input-files` files on threefs (timed apart: GraySort starts from its input);
3. threefs GraySort: phase 1 (partition by key range into shuffle files) + phase 2 (sort each partition),
   both through threefs, on pond's local executor with 2 workers; then valsort (timed apart). The input is
   removed after phase 1 unless --keep-input (a shared disk may not hold input, shuffle and output at once);
4. DuckDB: the same records (generated again, checksum equal to threefs's input) as uncompressed Parquet
   files on the local disk, then
   `COPY (SELECT * FROM read_parquet(...) ORDER BY key) TO 'out.parquet'` (threads = CPUs,
   memory_limit --duckdb-memory, spilling to the local disk); the output is checked for count and order.

Prints GB/min of both (input bytes / sort seconds), their ratio, and the load average at each step (the
machine is shared: compare the ratio, not the absolute figures, across runs). `--short` is 0.25 GiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# the repo on the path instead of this directory (a benchmark named like a standard module would shadow it)
sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

from benchmarks.common import local_cluster  # noqa: E402

GIB = 1 << 30


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def proc_cpu(pids) -> float:
    """CPU seconds (user + system) used so far by these processes."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return total


def own_cpu() -> float:
    """CPU seconds of this process and all its descendants: the reaped ones (getrusage) and the live ones with
    what they reaped (pond's forkserver outlives the pool and reaps its workers)."""
    import resource
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    live, frontier = [], [os.getpid()]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        live += kids
        frontier = kids
    for pid in live:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return total


def write_parquet_inputs(manifest, out_dir: str) -> int:
    """The records of the manifest generated again here (the generator is deterministic), one Parquet file per
    input file (key: 10 bytes, payload: 90 bytes, uncompressed); returns their checksum, which must equal the
    manifest's: DuckDB sorts the very records threefs sorted."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from threefs.pond.graysort import records as R
    os.makedirs(out_dir, exist_ok=True)
    total, first = 0, manifest.first_record
    block = 1 << 20
    for i, n in enumerate(manifest.records_per_file):
        with pq.ParquetWriter(os.path.join(out_dir, f"part-{i:05d}.parquet"),
                              pa.schema([("key", pa.binary(10)), ("payload", pa.binary(90))]),
                              compression="none") as writer:
            for pos in range(0, n, block):
                recs = R.gensort(first + pos, min(block, n - pos), manifest.skew)
                total += R.checksum(recs)
                key = pa.FixedSizeBinaryArray.from_buffers(pa.binary(10), len(recs),
                                                           [None, pa.py_buffer(np.ascontiguousarray(recs[:, :10]))])
                pay = pa.FixedSizeBinaryArray.from_buffers(pa.binary(90), len(recs),
                                                           [None, pa.py_buffer(np.ascontiguousarray(recs[:, 10:]))])
                writer.write_table(pa.table({"key": key, "payload": pay}), row_group_size=block)
        first += n
    return total


def duckdb_sort(in_dir: str, out_path: str, temp: str, memory: str, threads: int) -> float:
    import duckdb
    con = duckdb.connect(":memory:", config={"threads": threads, "memory_limit": memory, "temp_directory": temp,
                                             "preserve_insertion_order": True})
    con.execute("set enable_progress_bar=false")
    t = time.perf_counter()
    con.execute(f"COPY (SELECT * FROM read_parquet('{in_dir}/*.parquet') ORDER BY key) TO '{out_path}' "
                "(FORMAT PARQUET, COMPRESSION UNCOMPRESSED)")
    dt = time.perf_counter() - t
    con.close()
    return dt


def check_duckdb_output(path: str) -> tuple[int, bool]:
    """(rows, keys in order) of DuckDB's output, reading the key column one row group at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    f = pq.ParquetFile(path)
    rows, ordered, last = 0, True, None
    for g in range(f.num_row_groups):
        col = f.read_row_group(g, columns=["key"]).column("key").combine_chunks().cast(pa.large_binary())
        offsets = np.frombuffer(col.buffers()[1], np.int64)[col.offset:col.offset + len(col) + 1]
        if len(col) == 0:
            continue
        if not (np.diff(offsets) == 10).all():
            return rows, False
        raw = np.frombuffer(col.buffers()[2], np.uint8)[offsets[0]:offsets[-1]].reshape(-1, 10)
        k8 = raw[:, :8].copy().view(">u8").ravel().astype(np.uint64)
        k2 = raw[:, 8:].copy().view(">u2").ravel().astype(np.uint16)
        if last is not None and (int(k8[0]), int(k2[0])) < last:
            ordered = False
        if ((k8[1:] < k8[:-1]) | ((k8[1:] == k8[:-1]) & (k2[1:] < k2[:-1]))).any():
            ordered = False
        last = (int(k8[-1]), int(k2[-1]))
        rows += len(col)
    return rows, ordered


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--short", action="store_true", help="0.25 GiB (for a loaded machine)")
    ap.add_argument("--partitions", type=int, default=None, help="default: 8 per GiB, at least 4 (a power of 2)")
    ap.add_argument("--input-files", type=int, default=None, help="default: --partitions")
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--duckdb-memory", default="8GB")
    ap.add_argument("--skip-duckdb", action="store_true")
    ap.add_argument("--keep-input", action="store_true",
                    help="keep the input on threefs during phase 2 (needs room for input, shuffle and output)")
    ap.add_argument("--dir", default=None, help="where the cluster and DuckDB's files go (default: a temp dir)")
    args = ap.parse_args()
    gib = 0.25 if args.short else args.gib
    parts = args.partitions or max(4, 1 << max(0, round(gib * 8) - 1).bit_length())
    nfiles = args.input_files or parts
    records = int(gib * GIB) // 100
    nbytes = records * 100
    from threefs.pond import graysort as G
    from threefs.pond.graysort import fileio
    from threefs.pond.io import filesystem as pfs
    tmp = tempfile.mkdtemp(prefix="bench-graysort-", dir=args.dir)
    free = shutil.disk_usage(tmp).free
    need = int(nbytes * (3.3 if args.keep_input else 2.3))
    if free < need:
        print(f"need about {need / 1e9:.1f} GB free under {tmp} (shuffle and output on threefs, or DuckDB's input, "
              "output and spill), "
              f"have {free / 1e9:.1f} GB; use --gib smaller or --dir elsewhere", file=sys.stderr)
        os.rmdir(tmp)
        return 2
    print(f"GraySort benchmark: {records} records ({nbytes / 1e9:.3f} GB, {gib} GiB), {parts} partitions, "
          f"{nfiles} input files, {args.cpus} workers; load {load()}")
    rows = {}
    try:
        with local_cluster(tmp, storage=1, replicas=1, fuse=False) as (cluster, _):
            os.environ["THREEFS_CONFIG"] = str(cluster.client_config_path)
            pfs.threefs_fs.cache_clear()
            root = "threefs:///graysort"
            stats = []
            t = time.perf_counter()
            m = G.gensort(f"{root}/input", records, nfiles, num_cpus=args.cpus, stats=stats, progress=True)
            print(f"gensort: {time.perf_counter() - t:.1f} s, checksum {m.checksum}; load {load()}")
            load_before = load()
            services = list(cluster.running().values())
            cpu0, svc0 = own_cpu(), proc_cpu(services)
            rep = G.graysort(f"{root}/input", f"{root}/output", parts, num_cpus=args.cpus, progress=True,
                             validate=False, remove_input=not args.keep_input)
            svc = proc_cpu(services) - svc0
            cpu = own_cpu() - cpu0 + svc
            load_after = load()
            print(rep.summary())
            print(f"load before {load_before}, after {load_after}; CPU seconds of the sort: {cpu:.1f} (of which the "
                  f"cluster services {svc:.1f}: {svc / (4 * nbytes / 1e9):.2f} s per GB moved; driver and workers "
                  f"{(cpu - svc) / (nbytes / 1e9):.2f} s per GB sorted)")
            t = time.perf_counter()
            v = G.valsort(f"{root}/output", input_dir=f"{root}/input", num_cpus=args.cpus, progress=True)
            print(f"valsort: {time.perf_counter() - t:.1f} s\n{v.summary()}")
            rows["threefs"] = (rep.sort_seconds, rep.gb_per_min, f"{load_before} / {load_after}",
                               "valid" if v.ok else "INVALID", cpu)
            fileio.remove(f"{root}/output")
        shutil.rmtree(os.path.join(tmp, "cluster"), ignore_errors=True)  # the cluster's disk space, before DuckDB's
        if not args.skip_duckdb:
            t = time.perf_counter()
            sum_local = write_parquet_inputs(m, os.path.join(tmp, "duck-in"))
            same = sum_local == m.checksum_int
            print(f"DuckDB input: the {records} records generated again as Parquet on the local disk in "
                  f"{time.perf_counter() - t:.1f} s; checksum {sum_local:x}, the same records: {same}")
            if not same:
                print("the records for DuckDB differ from threefs's", file=sys.stderr)
                return 1
            load_before = load()
            cpu0 = own_cpu()
            out = os.path.join(tmp, "duck-out.parquet")
            dt = duckdb_sort(os.path.join(tmp, "duck-in"), out, os.path.join(tmp, "duck-temp"), args.duckdb_memory,
                             args.cpus)
            after = load()
            cpu = own_cpu() - cpu0
            n_out, ordered = check_duckdb_output(out)
            print(f"DuckDB COPY ... ORDER BY key: {dt:.1f} s, {nbytes / 1e9 / (dt / 60):.2f} GB/min; {n_out} rows, "
                  f"in order: {ordered}; load before {load_before}, after {after}")
            rows["duckdb"] = (dt, nbytes / 1e9 / (dt / 60), f"{load_before} / {after}",
                              "valid" if ordered and n_out == records else "INVALID", cpu)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(f"| {gib} GiB, {parts} partitions | sort s | GB/min | CPU s | load (1/5/15 min) before / after | output |")
    print("|---|---|---|---|---|---|")
    for name, (s, rate, ld, ok, cpu) in rows.items():
        print(f"| {name} | {s:.1f} | {rate:.2f} | {cpu:.0f} | {ld} | {ok} |")
    if "duckdb" in rows:
        print(f"threefs / DuckDB throughput: {rows['threefs'][1] / rows['duckdb'][1]:.2f}x (goal >= 1.0x); "
              f"CPU seconds threefs / DuckDB: {rows['threefs'][4] / rows['duckdb'][4]:.2f} (threefs's includes "
              "the cluster services)")
    print(f"threefs GB/min on {args.cpus} cores: {rows['threefs'][1]:.2f} (goal >= 0.84)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
