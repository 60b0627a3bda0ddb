"""`threefs admin target-check|target-migrate|target-compact PATH`: offline tools for one storage target
directory (the storage service that owns it must be stopped: the target's lock is taken).

    target-check PATH [--no-checksums] [--json]   verify metadata, block ownership, checksums (exit 1 if not OK)
    target-migrate PATH                           convert a v1 target to chunk engine v2 in place (resumable)
    target-compact PATH                           move chunks out of sparse block groups, return empty groups' space

The work is done by `python -m threefs.storage.target_tools` in a process of its own (the cli layer does
not import storage; docs/architecture.md).
"""

from __future__ import annotations

import subprocess
import sys


def _run(tool: str, args, extra: list[str]) -> int:
    return subprocess.run([sys.executable, "-m", "threefs.storage.target_tools", tool, *extra, args.path]).returncode


def cmd_target_check(args) -> int:
    extra = (["--no-checksums"] if args.no_checksums else []) + (["--json"] if args.json else [])
    return _run("check", args, extra)


def cmd_target_migrate(args) -> int:
    return _run("migrate", args, [])


def cmd_target_compact(args) -> int:
    return _run("compact", args, [])


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
