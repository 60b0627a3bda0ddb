"""`threefs mount` / `umount`, and the mount that `threefs up` makes and `down` removes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from threefs.common.status import StatusCode, status_error


def mount_options(args):
    from threefs.client.fuse import MountOptions

    return MountOptions(attr_timeout_s=args.attr_timeout, entry_timeout_s=args.entry_timeout,
                        negative_timeout_s=args.negative_timeout, direct_io=args.direct_io,
                        writeback_cache=args.writeback and not args.no_writeback,
                        keep_cache=not args.no_keep_cache, max_background=args.max_background,
                        read_ahead_kb=args.read_ahead_kb, read_ahead_bytes=args.prefetch_mb << 20,
                        segment_bytes=args.segment_mb << 20, allow_other=allow_other(args),
                        fast_dispatch=not args.pyfuse3_dispatch, dir_cache=not args.no_dir_cache,
                        gate_batch=args.gate_batch, changed_dir_s=args.changed_dir_s,
                        read_around_bytes=args.read_around_kb << 10,
                        read_around_region_bytes=args.read_around_region_kb << 10,
                        read_around_file_max=None if args.read_around_max_mb < 0 else args.read_around_max_mb << 20)


def allow_other(args) -> bool:
    """Other users may use the mount: asked for, or by default when root mounts (as for any file system
    root mounts; with default_permissions the kernel checks their permissions). Without it, FUSE refuses
    every user but the one who mounted, whatever the modes say. Others mounting need user_allow_other in
    /etc/fuse.conf for it, so for them it stays off unless asked for."""
    if args.allow_other:
        return True
    return not args.no_allow_other and os.geteuid() == 0


def mount_args(args) -> list[str]:
    """The options of this `mount` invocation, for the --foreground daemon it spawns."""
    out = ["--attr-timeout", str(args.attr_timeout), "--entry-timeout", str(args.entry_timeout),
           "--negative-timeout", str(args.negative_timeout), "--read-ahead-kb", str(args.read_ahead_kb),
           "--prefetch-mb", str(args.prefetch_mb), "--max-background", str(args.max_background),
           "--segment-mb", str(args.segment_mb), "--gate-batch", str(args.gate_batch),
           "--changed-dir-s", str(args.changed_dir_s), "--read-around-kb", str(args.read_around_kb),
           "--read-around-max-mb", str(args.read_around_max_mb),
           "--read-around-region-kb", str(args.read_around_region_kb)]
    out += ["--direct-io"] * args.direct_io + ["--no-writeback"] * args.no_writeback
    out += ["--writeback"] * args.writeback + ["--no-keep-cache"] * args.no_keep_cache
    out += ["--pyfuse3-dispatch"] * args.pyfuse3_dispatch + ["--no-dir-cache"] * args.no_dir_cache
    return out + ["--allow-other"] * args.allow_other + ["--no-allow-other"] * args.no_allow_other


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
    p.add_argument("--writeback", action="store_true",
                   help="kernel write-back cache (faster small writes; sizes and mtimes other clients "
                        "change are not seen while the kernel caches the file: one-client use only)")
    p.add_argument("--no-writeback", action="store_true", help="no kernel write-back cache (the default)")
    p.add_argument("--no-keep-cache", action="store_true",
                   help="drop the kernel's cached pages of a file at every open")
    p.add_argument("--max-background", type=int, default=64,
                   help="kernel requests in flight in the background (default 64; the kernel's is 12)")
    p.add_argument("--read-ahead-kb", type=int, default=4096, help="kernel read-ahead (default 4096)")
    p.add_argument("--prefetch-mb", type=int, default=16,
                   help="daemon read-ahead per sequentially read file (default 16, 0 = off)")
    p.add_argument("--segment-mb", type=int, default=4,
                   help="storage IO unit of the daemon's read-ahead and write-behind, in whole chunks "
                        "(default 4, at most 8)")
    p.add_argument("--read-around-kb", type=int, default=64,
                   help="a small buffered read that misses the page cache reads the aligned window of this "
                        "many KiB around it, and the kernel's page cache keeps the window (default 64; files "
                        "longer than a quarter of the memory get none; 0 = off: for workloads that never "
                        "re-read, which pay ~80-130 us of daemon CPU more per miss)")
    p.add_argument("--read-around-region-kb", type=int, default=1024,
                   help="a second read-around miss within one aligned region of this many KiB of a file reads "
                        "the whole region into the page cache (default 1024: a file read densely at random "
                        "is cached a region per miss; 0 = windows only)")
    p.add_argument("--read-around-max-mb", type=int, default=-1,
                   help="read-around only for files of at most this many MiB (default -1: a quarter of "
                        "the machine's memory)")
    p.add_argument("--gate-batch", type=int, default=64,
                   help="concurrent kernel reads joined into one storage batch at most (default 64)")
    p.add_argument("--no-dir-cache", action="store_true",
                   help="the kernel does not cache directory listings (by default it does, dropped at "
                        "opendir when the directory changed)")
    p.add_argument("--changed-dir-s", type=float, default=1.0,
                   help="a directory's attributes as this mount's change of its entries committed them "
                        "answer the kernel's next getattr of it, within this many seconds (default 1; 0 = "
                        "meta answers every getattr)")
    p.add_argument("--pyfuse3-dispatch", action="store_true",
                   help="take kernel requests as pyfuse3 does (one worker kept, epoll changes per request); "
                        "for comparison")
    p.add_argument("--attr-timeout", type=float, default=30.0,
                   help="seconds the kernel caches attributes (default 30, as 3FS)")
    p.add_argument("--entry-timeout", type=float, default=30.0,
                   help="seconds the kernel caches names (default 30, as 3FS)")
    p.add_argument("--negative-timeout", type=float, default=5.0,
                   help="seconds the kernel caches that a name does not exist (default 5, as 3FS; 0 = never)")
    others = p.add_mutually_exclusive_group()
    others.add_argument("--allow-other", action="store_true",
                        help="let other users use the mount (the default when root mounts; the kernel checks "
                             "their permissions as on any file system)")
    others.add_argument("--no-allow-other", action="store_true",
                        help="only the user who mounts may use the mount (the default for other users)")


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
