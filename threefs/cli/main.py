"""`threefs` command line: cluster life cycle (up/down/status) and file operations.

Errors print one line (`threefs: [NOT_FOUND] ...`) and exit non-zero: 2 for usage and bad input,
1 for everything else.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat as stat_mod
import sys
import time
from pathlib import Path

import msgspec

from threefs.common.status import StatusCode, ThreeFSError

TYPE_NAMES = {1: "file", 2: "dir", 3: "symlink"}


def _client(args):
    from threefs.client.client import Client

    return Client.connect(args.config)


def cmd_up(args) -> int:
    from threefs.cli.cluster import LocalCluster

    cluster = LocalCluster(args.dir)
    cfg = cluster.up(args.storage, args.replicas)
    print(f"threefs cluster in {cluster.dir} is serving: "
          f"{len(cluster.running())} processes, client config {cluster.client_config_path}")
    if not args.no_mount:
        print("FUSE mount: not part of this release yet (see docs/architecture.md); use the "
              "`threefs` CLI or the Python client (threefs.connect()).")
    if args.detach:
        return 0
    print("Press Ctrl-C to stop the cluster.")
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.2)
    print(f"stopped: {', '.join(cluster.down())}")
    del cfg
    return 0


def cmd_down(args) -> int:
    from threefs.cli.cluster import LocalCluster

    stopped = LocalCluster(args.dir).down()
    print(f"stopped {len(stopped)} processes" + (f": {', '.join(stopped)}" if stopped else ""))
    return 0


def _fmt_time(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ns / 1e9))


def cmd_ls(args) -> int:
    with _client(args) as fs:
        attr = fs.stat(args.path)
        if attr.type != 2:
            entries = [(Path(args.path).name, attr)]
        else:
            entries = [(e.name, fs.stat(f"{args.path.rstrip('/')}/{e.name}") if args.long else None)
                       for e in fs.scandir(args.path)]
        for name, a in entries:
            if args.long and a is not None:
                kind = "d" if a.type == 2 else "-"
                print(f"{kind}{stat_mod.filemode(a.mode)[1:]} {a.nlink:>3} {a.uid:>5} {a.gid:>5} "
                      f"{a.length:>12} {_fmt_time(a.mtime_ns)} {name}")
            else:
                print(name)
    return 0


def cmd_stat(args) -> int:
    with _client(args) as fs:
        a = fs.stat(args.path)
        print(json.dumps({"path": args.path, "type": TYPE_NAMES.get(a.type, a.type),
                          **msgspec.to_builtins(a)}, indent=2))
    return 0


def cmd_mkdir(args) -> int:
    with _client(args) as fs:
        for p in args.paths:
            fs.mkdir(p, parents=args.parents, exist_ok=args.parents)
    return 0


def cmd_put(args) -> int:
    with _client(args) as fs:
        n = fs.put(args.local, args.remote)
    print(f"{args.local} -> {args.remote}: {n} bytes")
    return 0


def cmd_get(args) -> int:
    with _client(args) as fs:
        n = fs.get(args.remote, args.local)
    print(f"{args.remote} -> {args.local}: {n} bytes")
    return 0


def cmd_cat(args) -> int:
    out = sys.stdout.buffer
    with _client(args) as fs:
        for p in args.paths:
            with fs.open(p, "rb") as f:
                while chunk := f.read(4 << 20):
                    out.write(chunk)
    out.flush()
    return 0


def _rm_tree(fs, path: str) -> None:
    for entry in fs.scandir(path):
        child = f"{path.rstrip('/')}/{entry.name}"
        if entry.type == 2:
            _rm_tree(fs, child)
        else:
            fs.remove(child)
    fs.rmdir(path)


def cmd_rm(args) -> int:
    with _client(args) as fs:
        for p in args.paths:
            if fs.stat(p).type == 2:
                if not args.recursive:
                    raise ThreeFSError(StatusCode.IS_DIRECTORY, f"{p} is a directory (use rm -r)")
                _rm_tree(fs, p)
            else:
                fs.remove(p)
    return 0


def cmd_mv(args) -> int:
    with _client(args) as fs:
        fs.rename(args.src, args.dst)
    return 0


def cmd_status(args) -> int:
    from threefs.cli.status import render_status

    with _client(args) as fs:
        return render_status(fs, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="threefs", description="threefs: 3FS in Python over TCP")
    p.add_argument("--config", help="client config (default: $THREEFS_CONFIG or ./.threefs/client.toml)")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start a local cluster (mgmtd, meta, N storage services)")
    up.add_argument("--dir", default=".threefs")
    up.add_argument("--storage", type=int, default=None, help="storage services (default 3)")
    up.add_argument("--replicas", type=int, default=None, help="replication factor R (default 3)")
    up.add_argument("--detach", action="store_true", help="return once the cluster serves")
    up.add_argument("--no-mount", action="store_true", help="do not mount FUSE")
    up.set_defaults(fn=cmd_up)
    down = sub.add_parser("down", help="stop every process of a local cluster")
    down.add_argument("--dir", default=".threefs")
    down.set_defaults(fn=cmd_down)

    ls = sub.add_parser("ls", help="list a directory")
    ls.add_argument("-l", dest="long", action="store_true")
    ls.add_argument("path", nargs="?", default="/")
    ls.set_defaults(fn=cmd_ls)
    st = sub.add_parser("stat", help="show a file's attributes")
    st.add_argument("path")
    st.set_defaults(fn=cmd_stat)
    mk = sub.add_parser("mkdir", help="create directories")
    mk.add_argument("-p", dest="parents", action="store_true")
    mk.add_argument("paths", nargs="+")
    mk.set_defaults(fn=cmd_mkdir)
    put = sub.add_parser("put", help="copy a local file into threefs")
    put.add_argument("local")
    put.add_argument("remote")
    put.set_defaults(fn=cmd_put)
    get = sub.add_parser("get", help="copy a threefs file to local disk")
    get.add_argument("remote")
    get.add_argument("local")
    get.set_defaults(fn=cmd_get)
    cat = sub.add_parser("cat", help="print files")
    cat.add_argument("paths", nargs="+")
    cat.set_defaults(fn=cmd_cat)
    rm = sub.add_parser("rm", help="remove files (-r: directories)")
    rm.add_argument("-r", dest="recursive", action="store_true")
    rm.add_argument("paths", nargs="+")
    rm.set_defaults(fn=cmd_rm)
    mv = sub.add_parser("mv", help="rename")
    mv.add_argument("src")
    mv.add_argument("dst")
    mv.set_defaults(fn=cmd_mv)
    status = sub.add_parser("status", help="nodes, targets and chains of the cluster")
    status.add_argument("--json", action="store_true")
    status.set_defaults(fn=cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "config", None) is None and os.environ.get("THREEFS_CONFIG"):
        args.config = os.environ["THREEFS_CONFIG"]
    try:
        return args.fn(args)
    except ThreeFSError as e:
        print(f"threefs: {e}", file=sys.stderr)
        return 2 if e.code in (StatusCode.INVALID_ARGUMENT, StatusCode.INVALID_PATH) else 1
    except OSError as e:  # local files (put/get)
        print(f"threefs: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
