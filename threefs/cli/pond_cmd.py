"""`threefs pond ...`: run pond (smallpond-compatible data processing) from the shell (docs/pond.md).

    sql QUERY -i GLOB... [-n N] [--hash-by COL | --range-by COL] [-o OUT] [--data-root DIR] [--ray ADDR]
        runs QUERY ({0} = the inputs, repartitioned) per partition; prints the rows or writes OUT
    explain QUERY -i GLOB... [...same options]   the optimized plan and its task counts
    jobs DATA_ROOT                               the jobs under a data root and their status
    clean DATA_ROOT JOB                          remove a failed job's files (one recursive remove)

Paths may be local, on the threefs FUSE mount, or threefs:// (client config from --config/$THREEFS_CONFIG).
"""

from __future__ import annotations

import os
import sys


def _frame(args):
    import threefs.pond as pond
    if args.config:
        os.environ["THREEFS_CONFIG"] = args.config
    sp = pond.init(data_root=args.data_root, ray_address=args.ray, num_cpus=args.cpus, progress=None)
    df = sp.read_parquet(args.inputs)
    if args.hash_by:
        df = df.repartition(args.partitions, hash_by=args.hash_by.split(","))
    elif args.range_by:
        df = df.repartition(args.partitions, range_by=args.range_by)
    elif args.partitions > 1:
        df = df.repartition(args.partitions, by_rows=True)
    return sp, sp.partial_sql(args.query, df)


def cmd_sql(args) -> int:
    sp, df = _frame(args)
    try:
        if args.output:
            df.write_parquet(args.output)
            print(f"wrote {df.count()} rows to {args.output}")
        else:
            print(df.to_pandas().to_string(max_rows=args.max_rows))
        if args.timeline:
            print(f"timeline: {sp.dump_timeline(args.timeline)}")
    finally:
        sp.shutdown()
    return 0


def cmd_explain(args) -> int:
    sp, df = _frame(args)
    try:
        print(df.explain())
    finally:
        sp.shutdown()
    return 0


def _jobs(root: str):
    from threefs.pond.io import filesystem as pfs
    for name in pfs.listdir(root):
        status_path = os.path.join(root, name, "log", ".STATUS")
        status = "running or killed"
        if pfs.exists(status_path):
            lines = pfs.read_bytes(status_path).decode().split()
            status = lines[-1] if lines else status
        yield name, status


def cmd_jobs(args) -> int:
    for name, status in _jobs(args.data_root):
        print(f"{name}  {status}")
    return 0


def cmd_clean(args) -> int:
    from threefs.pond.io import filesystem as pfs
    matches = [n for n, _ in _jobs(args.data_root) if n == args.job or n.endswith("." + args.job)]
    if not matches:
        print(f"no job {args.job!r} under {args.data_root} (see `threefs pond jobs {args.data_root}`)",
              file=sys.stderr)
        return 2
    for n in matches:
        pfs.remove_path(os.path.join(args.data_root, n))
        print(f"removed {n}")
    return 0


def add_pond_parser(sub) -> None:
    """Register `threefs pond ...` on the `threefs` argument parser's subparsers."""
    p = sub.add_parser("pond", help="pond data processing: sql, explain, jobs, clean, gensort, graysort, valsort")
    cmds = p.add_subparsers(dest="pond_cmd", required=True)
    run = cmds.add_parser("sql", help="run a SQL query per partition of Parquet inputs")
    explain = cmds.add_parser("explain", help="show the optimized plan of a query")
    for c in (run, explain):
        c.add_argument("query", help="DuckDB SQL; {0} names the (repartitioned) inputs")
        c.add_argument("-i", "--inputs", nargs="+", required=True, help="Parquet files, globs or directories")
        c.add_argument("-n", "--partitions", type=int, default=1)
        g = c.add_mutually_exclusive_group()
        g.add_argument("--hash-by", help="column[,column...] to hash-partition by")
        g.add_argument("--range-by", help="column to range-partition by (sampled split points)")
        c.add_argument("--data-root", default=None, help="job files (default ~/.pond/data)")
        c.add_argument("--ray", default=None, metavar="ADDRESS", help="run on this Ray cluster")
        c.add_argument("--cpus", type=int, default=None, help="local worker processes (default: all CPUs)")
    run.add_argument("-o", "--output", default=None, help="write Parquet here instead of printing")
    run.add_argument("--max-rows", type=int, default=50)
    run.add_argument("--timeline", default=None, metavar="HTML", help="write an HTML timeline of the tasks")
    run.set_defaults(fn=cmd_sql)
    explain.set_defaults(fn=cmd_explain)
    jobs = cmds.add_parser("jobs", help="jobs under a data root and their status")
    jobs.add_argument("data_root")
    jobs.set_defaults(fn=cmd_jobs)
    clean = cmds.add_parser("clean", help="remove one job's directory (one recursive remove)")
    clean.add_argument("data_root")
    clean.add_argument("job", help="job id or directory name")
    clean.set_defaults(fn=cmd_clean)
    from threefs.cli.graysort_cmd import add_graysort_commands  # gensort, graysort, valsort (docs/graysort.md)

    add_graysort_commands(cmds)
