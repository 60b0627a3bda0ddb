"""`threefs ckpt ...`: list, inspect, verify and remove checkpoints (threefs.checkpoint).

ROOT is a checkpoint root (the directory holding step-N directories); `--step N` picks a step
(default: the newest complete one). A step directory itself (ROOT/step-0000000100) works too.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import PurePosixPath

from threefs.cli import client_for
from threefs.common.status import StatusCode, status_error


def _manager(fs, root: str):
    from threefs.checkpoint.manager import STEP_RE, CheckpointManager

    p = PurePosixPath("/" + root.strip("/"))
    mt = STEP_RE.match(p.name)
    if mt:
        return CheckpointManager(fs, str(p.parent)), int(mt.group(1))
    return CheckpointManager(fs, str(p)), None


def _step(args, implied):
    if args.step is not None and implied is not None and args.step != implied:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"--step {args.step} contradicts the step directory "
                           f"given ({implied})")
    return args.step if args.step is not None else implied


def cmd_ls(args) -> int:
    from threefs.checkpoint.format import human_bytes

    with client_for(args) as fs:
        m, _ = _manager(fs, args.root)
        rows = []
        for step in m.steps():
            idx = m.index(step)
            rows.append({"step": step, "bytes": idx.nbytes, "tensors": sum(1 for _ in idx.all_tensors()),
                         "ranks": len(idx.ranks), "created": idx.created_unix, "path": m.path_of(step)})
        partial = m.partial() if args.all else []
    if args.json:
        print(json.dumps({"steps": rows, "partial": partial}, indent=2))
        return 0
    if not rows and not partial:
        print(f"no checkpoints under {m.root}")
    for r in rows:
        when = datetime.datetime.fromtimestamp(r["created"]).strftime("%Y-%m-%d %H:%M:%S")
        print(f"{r['step']:>10}  {human_bytes(r['bytes']):>11}  {r['tensors']:>6} tensors  "
              f"{r['ranks']} rank(s)  {when}  {r['path']}")
    for name in partial:
        print(f"{'partial':>10}  {m.root.rstrip('/')}/{name}  (a save that never published)")
    return 0


def cmd_inspect(args) -> int:
    from threefs.checkpoint.format import human_bytes, selector, tree_leaf_names

    with client_for(args) as fs:
        m, implied = _manager(fs, args.root)
        step = m.resolve_step(_step(args, implied))
        idx = m.index(step)
    wanted = selector(None, args.prefix or None)
    tensors = [(r, t) for r, t in idx.all_tensors() if wanted(t.name)]
    values = [(r, n) for r, part in enumerate(idx.ranks) for n, tag in tree_leaf_names(part.tree)
              if tag not in ("T", "N") and wanted(n)]
    if args.json:
        print(json.dumps({"step": idx.step, "created": idx.created_unix, "user_meta": idx.user_meta,
                          "tensors": [{"rank": r, "name": t.name, "kind": t.kind, "dtype": t.dtype,
                                       "shape": t.shape, "bytes": t.nbytes, "file": t.file, "offset": t.offset,
                                       "crc32c": t.crc} for r, t in tensors],
                          "values": [{"rank": r, "name": n} for r, n in values]}, indent=2))
        return 0
    print(f"{m.path_of(step)}: step {idx.step}, {len(idx.ranks)} rank(s), {len(tensors)} tensors, "
          f"{human_bytes(sum(t.nbytes for _, t in tensors))}")
    for k, v in idx.user_meta.items():
        print(f"  meta {k} = {v}")
    multi = len(idx.ranks) > 1
    for r, t in tensors:
        dtype = t.dtype if t.kind == "torch" else f"numpy {t.dtype}"
        print(f"  {f'[{r}] ' if multi else ''}{t.name}  {dtype}  {list(t.shape)}  {human_bytes(t.nbytes)}")
    if values:
        print(f"  plain values: {', '.join(n for _, n in values[:20])}" + (" ..." if len(values) > 20 else ""))
    return 0


def cmd_verify(args) -> int:
    with client_for(args) as fs:
        m, implied = _manager(fs, args.root)
        step = m.resolve_step(_step(args, implied))
        problems = m.verify(step)
    for p in problems:
        print(f"DAMAGED {p}", file=sys.stderr)
    if problems:
        print(f"{m.path_of(step)}: {len(problems)} damaged tensor(s)", file=sys.stderr)
        return 1
    print(f"{m.path_of(step)}: every tensor matches its checksum")
    return 0


def cmd_rm(args) -> int:
    with client_for(args) as fs:
        m, implied = _manager(fs, args.root)
        steps = list(args.step or ([] if implied is None else [implied]))
        if not steps and not args.partial:
            raise status_error(StatusCode.INVALID_ARGUMENT, "say which: --step N [N ...] and/or --partial")
        for s in steps:
            m.remove(s)
            print(f"removed {m.path_of(s)}")
        if args.partial:
            for name in m.clean_partial():
                print(f"removed partial {name}")
    return 0


def add_ckpt_parser(sub) -> None:
    ck = sub.add_parser("ckpt", help="checkpoints: ls, inspect, verify, rm (docs/checkpoint.md)")
    cs = ck.add_subparsers(dest="ckpt_cmd", required=True)
    ls = cs.add_parser("ls", help="complete checkpoints under ROOT (--all: also partial saves)")
    ls.add_argument("root")
    ls.add_argument("--all", action="store_true")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_ls)
    ins = cs.add_parser("inspect", help="tensors (name, dtype, shape, size) of a checkpoint")
    ins.add_argument("root")
    ins.add_argument("--step", type=int, default=None)
    ins.add_argument("--prefix", action="append", help="only names under this prefix (repeatable)")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(fn=cmd_inspect)
    ver = cs.add_parser("verify", help="read every tensor and check its checksum (exit 1 if damaged)")
    ver.add_argument("root")
    ver.add_argument("--step", type=int, default=None)
    ver.set_defaults(fn=cmd_verify)
    rm = cs.add_parser("rm", help="remove steps (--step N ...) and/or partial saves (--partial)")
    rm.add_argument("root")
    rm.add_argument("--step", type=int, nargs="+", default=None)
    rm.add_argument("--partial", action="store_true")
    rm.set_defaults(fn=cmd_rm)
