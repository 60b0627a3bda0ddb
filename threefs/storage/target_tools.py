"""Offline tools for one storage target directory, run by `threefs admin target-*` in a process of their
own (the cli layer does not import storage: docs/architecture.md). Also `python -m threefs.storage.target_tools
check|migrate|compact PATH`. Exit codes: 0 OK, 1 problems found, 2 cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from threefs.common.status import ThreeFSError


def _target(path: str) -> str:
    if not os.path.isdir(path):
        raise SystemExit(f"{path}: not a directory (give a storage target's directory, e.g. "
                         "DIR/data/storage-1/target-101001)")
    return path


def cmd_target_check(args) -> int:
    from threefs.storage.target_check import check_target

    try:
        report = check_target(_target(args.path), checksums=not args.no_checksums)
    except ThreeFSError as e:
        print(f"cannot check {args.path}: {e.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**report.__dict__, "ok": report.ok}, indent=2))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


def cmd_target_migrate(args) -> int:
    from threefs.storage.chunk_engine_v2 import ChunkEngineV2
    from threefs.storage.engines import target_format

    path = _target(args.path)
    before = target_format(path)
    if before == "v2":
        print(f"{path} is already a v2 target")
        return 0
    try:
        with ChunkEngineV2(path) as eng:
            count = eng.chunk_count()
    except ThreeFSError as e:
        print(f"cannot migrate {path}: {e.message}", file=sys.stderr)
        return 2
    print(f"{path}: {'migration resumed and finished' if before == 'migrating' else 'migrated'} to chunk "
          f"engine v2 ({count} chunks); set chunk_engine = \"v2\" (or leave it empty) for this target")
    return 0


def cmd_target_compact(args) -> int:
    from threefs.storage.chunk_engine_v2 import ChunkEngineV2

    try:
        with ChunkEngineV2(_target(args.path), migrate=False) as eng:
            done = eng.compact()
            space = eng.space()
    except ThreeFSError as e:
        print(f"cannot compact {args.path}: {e.message}", file=sys.stderr)
        return 2
    print(f"{args.path}: moved {done['chunks_moved']} chunks ({done['bytes_moved']} bytes) out of sparse groups, "
          f"punched {done['groups_punched']} empty groups, returned {done['bytes_returned']} bytes; "
          f"now {space['used_bytes']} bytes used by chunks, {space['file_bytes']} bytes in data files")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="threefs.storage.target_tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("check")
    p.add_argument("path")
    p.add_argument("--no-checksums", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_target_check)
    for name, fn in (("migrate", cmd_target_migrate), ("compact", cmd_target_compact)):
        p = sub.add_parser(name)
        p.add_argument("path")
        p.set_defaults(fn=fn)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
