"""`threefs admin target-check|target-migrate|target-compact PATH`: offline tools for one storage target
directory (the storage service that owns it must be stopped: the target's lock is taken).

    target-check PATH [--no-checksums] [--json]   verify metadata, block ownership, checksums (exit 1 if not OK)
    target-migrate PATH                           convert a v1 target to chunk engine v2 in place (resumable)
    target-compact PATH                           return the space of empty block groups to the file system
"""

from __future__ import annotations

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
    print(f"{args.path}: punched {done['groups_punched']} empty groups, returned {done['bytes_returned']} bytes; "
          f"now {space['used_bytes']} bytes used by chunks, {space['file_bytes']} bytes in data files")
    return 0


def add_admin_target_commands(cmds) -> None:
    p = cmds.add_parser("target-check", help="verify a stopped target offline (metadata, blocks, checksums)")
    p.add_argument("path", help="the target's directory")
    p.add_argument("--no-checksums", action="store_true", help="skip reading the data (metadata and blocks only)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_target_check)
    p = cmds.add_parser("target-migrate", help="convert a stopped v1 target to chunk engine v2 in place")
    p.add_argument("path")
    p.set_defaults(fn=cmd_target_migrate)
    p = cmds.add_parser("target-compact", help="return the space of a stopped v2 target's empty groups")
    p.add_argument("path")
    p.set_defaults(fn=cmd_target_compact)
