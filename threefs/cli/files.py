"""`threefs` namespace commands: ls, stat, mkdir, cat, rm, mv, du, df (copies: cli/copy_cmd.py; mounts:
cli/mount_cmd.py). A command that fails on some paths goes on with the others, names each failure on
stderr and exits 1.
"""

from __future__ import annotations

import json
import stat as stat_mod
import sys
import time
from pathlib import PurePosixPath

import msgspec

from threefs.cli import client_for
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.schemas import meta as m

TYPE_NAMES = {m.FILE: "file", m.DIRECTORY: "dir", m.SYMLINK: "symlink"}


def human(n: int) -> str:
    for unit in ("B", "K", "M", "G", "T", "P"):
        if abs(n) < 1024 or unit == "P":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def join_path(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


# -- ls / stat / mkdir / mv / cat ---------------------------------------------------------------------
def _ls_line(name: str, a: m.InodeAttr, human_sizes: bool) -> str:
    kind = {m.DIRECTORY: "d", m.SYMLINK: "l"}.get(a.type, "-")
    size = human(a.length) if human_sizes else str(a.length)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(a.mtime_ns / 1e9))
    link = f" -> {a.symlink_target}" if a.type == m.SYMLINK else ""
    return (f"{kind}{stat_mod.filemode(a.mode)[1:]} {a.nlink:>3} {a.uid:>5} {a.gid:>5} {size:>10} "
            f"{when} {name}{link}")


def cmd_ls(args) -> int:
    failed = 0
    with client_for(args) as fs:
        for path in args.paths or ["/"]:
            try:
                attr = fs.stat(path)
            except ThreeFSError as e:
                print(f"threefs ls: {path}: {e}", file=sys.stderr)
                failed = 1
                continue
            if attr.type != m.DIRECTORY:
                names, attrs = [PurePosixPath(path).name], [attr]
            else:
                names = sorted(e.name for e in fs.scandir(path))
                attrs = fs.batch_stat([join_path(path, n) for n in names], follow=False) if args.long else [None] * len(names)
            if len(args.paths) > 1:
                print(f"{path}:")
            for name, a in zip(names, attrs):
                if isinstance(a, ThreeFSError):
                    continue  # removed while listing
                print(_ls_line(name, a, args.human) if args.long else name)
    return failed


def cmd_stat(args) -> int:
    with client_for(args) as fs:
        for path in args.paths:
            a = fs.stat(path)
            print(json.dumps({"path": path, **msgspec.to_builtins(a),
                              "type": TYPE_NAMES.get(a.type, a.type)}, indent=2))
    return 0


def cmd_mkdir(args) -> int:
    with client_for(args) as fs:
        for p in args.paths:
            fs.mkdir(p, parents=args.parents, exist_ok=args.parents)
    return 0


def cmd_mv(args) -> int:
    with client_for(args) as fs:
        dst = args.dst
        try:
            if fs.stat(dst).type == m.DIRECTORY:  # like mv: into an existing directory
                dst = join_path(dst, PurePosixPath(args.src.rstrip("/")).name)
        except FileNotFoundError:
            pass
        fs.rename(args.src, dst)
    return 0


def cmd_cat(args) -> int:
    out = sys.stdout.buffer
    with client_for(args) as fs:
        for p in args.paths:
            with fs.open(p, "rb") as f:
                while piece := f.read(4 << 20):
                    out.write(piece)
    out.flush()
    return 0


# -- rm / du / df ----------------------------------------------------------------------------------
def cmd_rm(args) -> int:
    failed = 0
    with client_for(args) as fs:
        for p in args.paths:
            try:
                attr = fs.run(fs.aio.lstat(p))
                if attr.type == m.DIRECTORY and not args.recursive:
                    raise status_error(StatusCode.IS_DIRECTORY, f"{p} is a directory (use rm -r)")
                # a tree goes to meta's GC in one transaction; its chunks are removed in the background
                fs.run(fs.aio.remove(p, recursive=attr.type == m.DIRECTORY))
            except FileNotFoundError as e:
                if not args.force:
                    print(f"threefs rm: {p}: {e}", file=sys.stderr)
                    failed = 1
            except ThreeFSError as e:
                print(f"threefs rm: {p}: {e}", file=sys.stderr)
                failed = 1
    return failed


def cmd_du(args) -> int:
    with client_for(args) as fs:
        for path in args.paths or ["/"]:
            size, files, dirs = fs.disk_usage(path)
            shown = human(size) if args.human else str(size)
            print(f"{shown}\t{path}" + (f"\t({files} files, {dirs} dirs)" if args.verbose else ""))
    return 0


def cmd_df(args) -> int:
    with client_for(args) as fs:
        st = fs.run(fs.aio.statfs())
    fmt = human if args.human else str
    use = f"{100 * st.used_bytes / st.capacity_bytes:.0f}%" if st.capacity_bytes else "-"
    print(f"{'Filesystem':<12} {'Size':>14} {'Used':>14} {'Avail':>14} {'Use%':>5} {'Replicas':>8} "
          f"{'Targets':>8}")
    print(f"{'threefs':<12} {fmt(st.capacity_bytes):>14} {fmt(st.used_bytes):>14} {fmt(st.free_bytes):>14} "
          f"{use:>5} {st.replicas:>8} {st.targets_reporting:>4}/{st.targets:<3}")
    if st.targets_reporting < st.targets:
        print(f"threefs df: only {st.targets_reporting} of {st.targets} targets reported free space; "
              "see `threefs status`", file=sys.stderr)
    return 0


def add_file_commands(sub) -> None:
    """Register the file commands on the `threefs` argument parser's subparsers."""
    from threefs.cli import copy_cmd, mount_cmd

    ls = sub.add_parser("ls", help="list directories")
    ls.add_argument("-l", dest="long", action="store_true", help="long format")
    ls.add_argument("-H", "--human", action="store_true", help="sizes in K/M/G")
    ls.add_argument("paths", nargs="*")
    ls.set_defaults(fn=cmd_ls)
    st = sub.add_parser("stat", help="show attributes (JSON)")
    st.add_argument("paths", nargs="+")
    st.set_defaults(fn=cmd_stat)
    mk = sub.add_parser("mkdir", help="create directories")
    mk.add_argument("-p", dest="parents", action="store_true", help="create parents, accept existing")
    mk.add_argument("paths", nargs="+")
    mk.set_defaults(fn=cmd_mkdir)
    for name, helptext, fn in (("put", "copy local files in: put [-r] LOCAL... REMOTE", copy_cmd.cmd_put),
                               ("get", "copy files out: get [-r] REMOTE... LOCAL", copy_cmd.cmd_get)):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("-r", dest="recursive", action="store_true", help="copy directories")
        p.add_argument("-q", dest="quiet", action="store_true", help="no progress bar or summary")
        p.add_argument("paths", nargs="+", metavar="PATH")
        p.set_defaults(fn=fn)
    cat = sub.add_parser("cat", help="print files")
    cat.add_argument("paths", nargs="+")
    cat.set_defaults(fn=cmd_cat)
    rm = sub.add_parser("rm", help="remove files (-r: directories)")
    rm.add_argument("-r", dest="recursive", action="store_true")
    rm.add_argument("-f", dest="force", action="store_true", help="ignore missing paths")
    rm.add_argument("paths", nargs="+")
    rm.set_defaults(fn=cmd_rm)
    mv = sub.add_parser("mv", help="rename (into DST if it is a directory)")
    mv.add_argument("src")
    mv.add_argument("dst")
    mv.set_defaults(fn=cmd_mv)
    du = sub.add_parser("du", help="bytes of file data under paths")
    du.add_argument("-H", "--human", action="store_true")
    du.add_argument("-v", dest="verbose", action="store_true", help="also count files and directories")
    du.add_argument("paths", nargs="*")
    du.set_defaults(fn=cmd_du)
    df = sub.add_parser("df", help="space used by the file system")
    df.add_argument("-H", "--human", action="store_true")
    df.set_defaults(fn=cmd_df)
    mnt = sub.add_parser("mount", help="mount threefs with FUSE")
    mnt.add_argument("mountpoint")
    mnt.add_argument("--foreground", action="store_true", help="serve in this process")
    mnt.add_argument("--log", help="daemon log file (background mode)")
    mount_cmd.add_mount_flags(mnt)
    mnt.set_defaults(fn=mount_cmd.cmd_mount)
    um = sub.add_parser("umount", help="unmount (also after a crashed daemon)")
    um.add_argument("mountpoint")
    um.set_defaults(fn=mount_cmd.cmd_umount)


