"""`threefs pond gensort | graysort | valsort`: the GraySort benchmark on pond and threefs (docs/graysort.md).

    gensort OUT (--records N | --gib G) [-n FILES] [--skew] [--seed B]    gensort-1.5 records, FILES files
    graysort --gib G --partitions P [--executor local|ray] [--root URL]   gensort into ROOT/input (reused when
        it already holds the same records), phase 1, phase 2, valsort; per-phase times and GB/min
    valsort OUT [--input DIR]                                             global order, count, checksum

Paths are threefs:// (client config from --config or $THREEFS_CONFIG) or local.
"""

from __future__ import annotations

import os
import sys

GIB = 1 << 30


def _records(args) -> int:
    if getattr(args, "records", None) is not None:
        return args.records
    return int(args.gib * GIB) // 100


def _common(args) -> dict:
    if getattr(args, "config", None):
        os.environ["THREEFS_CONFIG"] = args.config
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    return dict(executor=args.executor, num_cpus=args.cpus, ray_address=args.ray, progress=progress)


def _guard(fn):
    def run(args) -> int:
        from threefs.pond.common import PondError
        try:
            return fn(args)
        except PondError as e:
            print(f"threefs pond {args.pond_cmd}: {e}", file=sys.stderr)
            return 1
    return run


@_guard
def cmd_gensort(args) -> int:
    from threefs.pond import graysort as G
    n = _records(args)
    m = G.gensort(args.out, n, args.files, skew=args.skew, first_record=args.seed, job_id=args.job_id,
                  **_common(args))
    print(f"wrote {m.records} records ({m.nbytes / 1e9:.3f} GB) in {len(m.files)} files to {args.out}; "
          f"checksum {m.checksum}")
    return 0


def _reusable_input(input_dir: str, records: int, skew: bool, seed: int):
    from threefs.pond.graysort import fileio
    from threefs.pond.graysort.job import MANIFEST, Manifest
    path = os.path.join(input_dir, MANIFEST)
    try:
        if not fileio.exists(path):
            return None
        m = Manifest.load(path)
    except Exception:
        return None
    if m.records == records and m.skew == skew and m.first_record == seed and all(fileio.exists(f) for f in m.files):
        return m
    return None


@_guard
def cmd_graysort(args) -> int:
    from threefs.pond import graysort as G
    from threefs.pond.graysort import fileio
    common = _common(args)
    root = args.root.rstrip("/")
    input_dir = args.input or f"{root}/input"
    output_dir = f"{root}/output"
    if not args.input:
        n = _records(args)
        m = _reusable_input(input_dir, n, args.skew, args.seed)
        if m is None:
            fileio.remove(input_dir)
            stats = []
            m = G.gensort(input_dir, n, args.input_files or args.partitions, skew=args.skew, first_record=args.seed,
                          job_id=f"{args.job_id}-gen" if args.job_id else None, stats=stats, **common)
            print(stats[0].line(m.nbytes))
        else:
            print(f"gensort: reusing the {m.records} records of {input_dir}")
    report = G.graysort(input_dir, output_dir, args.partitions, sample=args.sample, job_id=args.job_id,
                        validate=not args.no_validate, **common)
    print(report.summary())
    if not args.keep:
        fileio.remove(output_dir)
    return 0 if report.validation is None or report.validation.ok else 1


@_guard
def cmd_valsort(args) -> int:
    from threefs.pond import graysort as G
    v = G.valsort(args.out, input_dir=args.input, **_common(args))
    print(v.summary())
    return 0 if v.ok else 1


def _exec_flags(c) -> None:
    c.add_argument("--executor", choices=("local", "ray"), default="local")
    c.add_argument("--ray", default=None, metavar="ADDRESS", help="the Ray cluster (default: start one here)")
    c.add_argument("--cpus", type=int, default=None, help="local worker processes (default: all CPUs)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None, help="progress bars")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    c.add_argument("--job-id", default=None, help="resume the killed or failed job of this id (same --root)")


def add_graysort_commands(cmds) -> None:
    """Register gensort, graysort and valsort under `threefs pond`."""
    gen = cmds.add_parser("gensort", help="write GraySort records (gensort 1.5 binary format) in parallel tasks")
    gen.add_argument("out", help="output directory (threefs://... or local)")
    size = gen.add_mutually_exclusive_group(required=True)
    size.add_argument("--records", type=int, help="number of 100-byte records")
    size.add_argument("--gib", type=float, help="GiB of records")
    gen.add_argument("-n", "--files", type=int, default=16, help="files (parallel tasks), default 16")
    gen.add_argument("--skew", action="store_true", help="skewed keys (gensort -s)")
    gen.add_argument("--seed", type=int, default=0, help="the first record number (gensort -b), default 0")
    _exec_flags(gen)
    gen.set_defaults(fn=cmd_gensort)

    gs = cmds.add_parser("graysort", help="the GraySort benchmark: gensort, two-phase sort, valsort")
    gs.add_argument("--gib", type=float, default=1.0, help="GiB of records to sort (default 1)")
    gs.add_argument("--partitions", type=int, required=True, help="output partitions (a power of 2 unless --sample)")
    gs.add_argument("--root", default="threefs:///graysort",
                    help="working directory: input/, output/, pond/ (default threefs:///graysort)")
    gs.add_argument("--input", default=None, help="sort this directory of records instead of generating them")
    gs.add_argument("--input-files", type=int, default=None, help="gensort files (default: --partitions)")
    gs.add_argument("--skew", action="store_true", help="generate skewed keys (gensort -s)")
    gs.add_argument("--seed", type=int, default=0, help="the first record number (gensort -b)")
    gs.add_argument("--sample", action="store_true",
                    help="split points sampled from the keys (even partitions for skewed keys) instead of key bits")
    gs.add_argument("--no-validate", action="store_true", help="skip valsort")
    gs.add_argument("--keep", action="store_true", help="keep the sorted output (ROOT/output)")
    _exec_flags(gs)
    gs.set_defaults(fn=cmd_graysort)

    val = cmds.add_parser("valsort", help="check sorted record files: order, count, checksum")
    val.add_argument("out", help="directory of part-NNNNN.dat files")
    val.add_argument("--input", default=None, help="the input directory, to compare count and checksum")
    _exec_flags(val)
    val.set_defaults(fn=cmd_valsort)
