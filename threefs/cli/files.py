"""`threefs` file commands: ls, stat, mkdir, put, get, cat, rm, mv, du, df, mount, umount.

Copies (put/get) take many sources and -r like cp, run several files at once, and show a progress bar
on a terminal. A command that fails on some files goes on with the others, names each failure on
stderr and exits 1.
"""

from __future__ import annotations

import json
import os
import stat as stat_mod
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import msgspec

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.schemas import meta as m

TYPE_NAMES = {m.FILE: "file", m.DIRECTORY: "dir", m.SYMLINK: "symlink"}
COPY_WORKERS = 8  # files copied at once by put/get (hides meta round trips of small files)


def _client(args):
    from threefs.client.client import Client

    return Client.connect(args.config)


def human(n: int) -> str:
    for unit in ("B", "K", "M", "G", "T", "P"):
        if abs(n) < 1024 or unit == "P":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


def _join(base: str, name: str) -> str:
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
    with _client(args) as fs:
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
                attrs = fs.batch_stat([_join(path, n) for n in names], follow=False) if args.long else [None] * len(names)
            if len(args.paths) > 1:
                print(f"{path}:")
            for name, a in zip(names, attrs):
                if isinstance(a, ThreeFSError):
                    continue  # removed while listing
                print(_ls_line(name, a, args.human) if args.long else name)
    return failed


def cmd_stat(args) -> int:
    with _client(args) as fs:
        for path in args.paths:
            a = fs.stat(path)
            print(json.dumps({"path": path, **msgspec.to_builtins(a),
                              "type": TYPE_NAMES.get(a.type, a.type)}, indent=2))
    return 0


def cmd_mkdir(args) -> int:
    with _client(args) as fs:
        for p in args.paths:
            fs.mkdir(p, parents=args.parents, exist_ok=args.parents)
    return 0


def cmd_mv(args) -> int:
    with _client(args) as fs:
        dst = args.dst
        try:
            if fs.stat(dst).type == m.DIRECTORY:  # like mv: into an existing directory
                dst = _join(dst, PurePosixPath(args.src.rstrip("/")).name)
        except FileNotFoundError:
            pass
        fs.rename(args.src, dst)
    return 0


def cmd_cat(args) -> int:
    out = sys.stdout.buffer
    with _client(args) as fs:
        for p in args.paths:
            with fs.open(p, "rb") as f:
                while piece := f.read(4 << 20):
                    out.write(piece)
    out.flush()
    return 0


# -- rm / du / df ----------------------------------------------------------------------------------
def cmd_rm(args) -> int:
    failed = 0
    with _client(args) as fs:
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
    with _client(args) as fs:
        for path in args.paths or ["/"]:
            size, files, dirs = fs.disk_usage(path)
            shown = human(size) if args.human else str(size)
            print(f"{shown}\t{path}" + (f"\t({files} files, {dirs} dirs)" if args.verbose else ""))
    return 0


def cmd_df(args) -> int:
    with _client(args) as fs:
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


# -- put / get --------------------------------------------------------------------------------------
class Progress:
    """A rich progress bar on a terminal, silence elsewhere."""

    def __init__(self, enabled: bool, total: int, what: str):
        self._bar = None
        if enabled:
            from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TimeRemainingColumn,
                                       TransferSpeedColumn)
            self._bar = Bar("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
            self._task = self._bar.add_task(what, total=total)

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
        return self

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()


def _plan_put(fs, sources: list[str], remote: str, recursive: bool) -> list[tuple[str, str, int]]:
    """(local file, remote path, bytes) for every file to copy; creates the remote directories."""
    try:
        into = fs.stat(remote).type == m.DIRECTORY
    except FileNotFoundError:
        into = False
    if len(sources) > 1 and not into:
        raise status_error(StatusCode.NOT_DIRECTORY, f"copying several sources needs an existing "
                           f"directory as target; {remote} is not one")
    plan = []
    for src in sources:
        base = _join(remote, Path(src).name) if into else remote
        if not os.path.isdir(src):
            plan.append((src, base, os.path.getsize(src)))
            continue
        if not recursive:
            raise status_error(StatusCode.IS_DIRECTORY, f"{src} is a directory (use put -r)")
        for dirpath, _dirs, filenames in os.walk(src):
            rel = os.path.relpath(dirpath, src)
            target = base if rel == "." else _join(base, rel.replace(os.sep, "/"))
            fs.mkdir(target, parents=True, exist_ok=True)
            for name in sorted(filenames):
                local = os.path.join(dirpath, name)
                plan.append((local, _join(target, name), os.path.getsize(local)))
    return plan


def _plan_get(fs, sources: list[str], local: str, recursive: bool) -> list[tuple[str, str, int]]:
    """(remote file, local path, bytes) for every file to copy; creates the local directories."""
    into = os.path.isdir(local)
    if len(sources) > 1 and not into:
        raise status_error(StatusCode.NOT_DIRECTORY, f"copying several sources needs an existing "
                           f"directory as target; {local} is not one")
    plan = []
    for src in sources:
        attr = fs.stat(src)
        base = os.path.join(local, PurePosixPath(src.rstrip("/")).name or "root") if into else local
        if attr.type != m.DIRECTORY:
            plan.append((src, base, attr.length))
            continue
        if not recursive:
            raise status_error(StatusCode.IS_DIRECTORY, f"{src} is a directory (use get -r)")
        prefix = src.rstrip("/")
        os.makedirs(base, exist_ok=True)
        for path, a in fs.walk_files(src):
            target = os.path.join(base, *PurePosixPath(path[len(prefix):].lstrip("/")).parts)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            plan.append((path, target, a.length))
    return plan


def _copy_all(plan, copy_one, show_progress: bool, what: str) -> tuple[int, int]:
    """Run copy_one(src, dst, progress) over the plan, COPY_WORKERS at once; returns (files, bytes)."""
    total = sum(n for _, _, n in plan)
    done_files, done_bytes, failed = 0, 0, []
    with Progress(show_progress, total, what) as bar, ThreadPoolExecutor(COPY_WORKERS) as pool:
        futures = [(src, pool.submit(copy_one, src, dst, bar.advance)) for src, dst, _ in plan]
        for src, fut in futures:
            try:
                done_bytes += fut.result()
                done_files += 1
            except OSError as e:
                failed.append(f"{src}: {e}")
    for f in failed:
        print(f"threefs {what}: {f}", file=sys.stderr)
    if failed:
        raise status_error(StatusCode.IO_ERROR, f"{len(failed)} of {len(plan)} files failed (listed above)")
    return done_files, done_bytes


def _progress_wanted(args) -> bool:
    return not args.quiet and sys.stderr.isatty()


def cmd_put(args) -> int:
    *sources, remote = args.paths
    with _client(args) as fs:
        plan = _plan_put(fs, sources, remote, args.recursive)
        t0 = time.perf_counter()
        files, nbytes = _copy_all(plan, lambda s, d, p: fs.put(s, d, progress=p), _progress_wanted(args),
                                  "put")
    _summary(files, nbytes, time.perf_counter() - t0, remote, args.quiet)
    return 0


def cmd_get(args) -> int:
    *sources, local = args.paths
    with _client(args) as fs:
        plan = _plan_get(fs, sources, local, args.recursive)
        t0 = time.perf_counter()
        files, nbytes = _copy_all(plan, lambda s, d, p: fs.get(s, d, progress=p), _progress_wanted(args),
                                  "get")
    _summary(files, nbytes, time.perf_counter() - t0, local, args.quiet)
    return 0


def _summary(files: int, nbytes: int, seconds: float, dest: str, quiet: bool) -> None:
    if not quiet:
        rate = nbytes / seconds / 1e6 if seconds > 0 else 0.0
        print(f"{files} file{'s' if files != 1 else ''}, {nbytes} bytes -> {dest} "
              f"in {seconds:.2f} s ({rate:.0f} MB/s)")


# -- mount / umount ---------------------------------------------------------------------------------
def mount_options(args):
    from threefs.client.fuse import MountOptions

    return MountOptions(attr_timeout_s=args.attr_timeout, direct_io=args.direct_io,
                        writeback_cache=not args.no_writeback, read_ahead_kb=args.read_ahead_kb,
                        read_ahead_bytes=args.prefetch_mb << 20, allow_other=args.allow_other)


def mount_args(args) -> list[str]:
    """The options of this `mount` invocation, for the --foreground daemon it spawns."""
    out = ["--attr-timeout", str(args.attr_timeout), "--read-ahead-kb", str(args.read_ahead_kb),
           "--prefetch-mb", str(args.prefetch_mb)]
    out += ["--direct-io"] * args.direct_io + ["--no-writeback"] * args.no_writeback
    return out + ["--allow-other"] * args.allow_other


def cmd_mount(args) -> int:
    from threefs.client import fuse_mount
    from threefs.common.config import ClientConfig, find_client_config, load_toml

    config_path = find_client_config(args.config)
    if args.foreground:
        import logging
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return fuse_mount.run_foreground(load_toml(config_path, ClientConfig), args.mountpoint,
                                         mount_options(args))
    proc = fuse_mount.spawn(str(config_path), args.mountpoint, mount_args(args), args.log)
    print(f"threefs mounted at {os.path.abspath(args.mountpoint)} (daemon pid {proc.pid}); "
          f"`threefs umount {args.mountpoint}` unmounts it")
    return 0


def cmd_umount(args) -> int:
    from threefs.client import fuse_mount

    if not fuse_mount.unmount(args.mountpoint):
        raise status_error(StatusCode.NOT_FOUND, f"nothing is mounted at {os.path.abspath(args.mountpoint)}")
    print(f"unmounted {os.path.abspath(args.mountpoint)}")
    return 0


def add_mount_flags(p) -> None:
    p.add_argument("--direct-io", action="store_true", help="bypass the kernel page cache")
    p.add_argument("--no-writeback", action="store_true", help="no kernel write-back cache")
    p.add_argument("--read-ahead-kb", type=int, default=4096, help="kernel read-ahead (default 4096)")
    p.add_argument("--prefetch-mb", type=int, default=16,
                   help="daemon read-ahead per sequentially read file (default 16, 0 = off)")
    p.add_argument("--attr-timeout", type=float, default=1.0, help="attribute cache seconds (default 1)")
    p.add_argument("--allow-other", action="store_true", help="let other users use the mount")


def add_file_commands(sub) -> None:
    """Register the file commands on the `threefs` argument parser's subparsers."""
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
    for name, helptext, fn in (("put", "copy local files in: put [-r] LOCAL... REMOTE", cmd_put),
                               ("get", "copy files out: get [-r] REMOTE... LOCAL", cmd_get)):
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
    add_mount_flags(mnt)
    mnt.set_defaults(fn=cmd_mount)
    um = sub.add_parser("umount", help="unmount (also after a crashed daemon)")
    um.add_argument("mountpoint")
    um.set_defaults(fn=cmd_umount)


def _mount_record(cluster) -> Path:
    return cluster.dir / "run" / "fuse-mount.json"


def mount_for_cluster(cluster, mountpoint: str, extra_args: list[str]) -> str:
    """`threefs up`: mount the cluster at mountpoint if FUSE is usable; returns what to tell the user."""
    from threefs.client import fuse_mount

    reason = fuse_mount.fuse_unavailable_reason()
    if reason:
        return (f"FUSE mount skipped: {reason}. Use the `threefs` CLI or the Python client "
                "(threefs.connect()) meanwhile.")
    mnt = os.path.abspath(mountpoint)
    if fuse_mount.is_threefs_mount(mnt):
        try:
            os.stat(mnt)
            return f"FUSE: already mounted at {mnt}"
        except OSError:
            pass  # a dead daemon's mount: spawn() cleans it up
    log_path = str(cluster.dir / "log" / "fuse.log")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, extra_args, log_path)
    _mount_record(cluster).write_text(json.dumps({"mountpoint": mnt, "pid": proc.pid}))
    return f"FUSE: mounted at {mnt} (daemon pid {proc.pid}, log {log_path})"


def unmount_for_cluster(cluster) -> str | None:
    """`threefs down`: unmount what `up` mounted; returns the mount point, or None."""
    from threefs.client import fuse_mount

    record = _mount_record(cluster)
    if not record.exists():
        return None
    info = json.loads(record.read_text())
    mnt = info["mountpoint"]
    done = fuse_mount.unmount(mnt) if fuse_mount.is_threefs_mount(mnt) else False
    _wait_exit(info.get("pid"), fuse_mount.UNMOUNT_TIMEOUT_S)
    record.unlink()
    return mnt if done else None


def _wait_exit(pid: int | None, timeout_s: float) -> None:
    """The daemon exits by itself once unmounted; reap it if it is our child."""
    if not pid:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:  # not our child: poll for its exit
            if not os.path.exists(f"/proc/{pid}"):
                return
        time.sleep(0.05)
