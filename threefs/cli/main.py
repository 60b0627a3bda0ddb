"""`threefs` command line: cluster life cycle (up/down/status) and file operations.

Errors print one line (`threefs: [NOT_FOUND] ...`) and exit non-zero: 2 for usage and bad input,
1 for everything else.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from threefs.cli import client_for
from threefs.cli.files import add_file_commands
from threefs.cli.mount_cmd import (
    add_mount_flags,
    mount_args,
    mount_for_cluster,
    unmount_for_cluster,
)
from threefs.common.status import StatusCode, ThreeFSError


def cmd_up(args) -> int:
    from threefs.cli.cluster import LocalCluster

    if args.spec:
        return _up_spec(args)
    cluster = LocalCluster(args.dir)
    cfg = cluster.up(args.storage, args.replicas, **({"kv": args.kv} if args.kv else {}))
    print(f"threefs cluster in {cluster.dir} is serving: "
          f"{len(cluster.running())} processes, client config {cluster.client_config_path}")
    if not args.no_mount:
        print(mount_for_cluster(cluster, args.mount, mount_args(args)))
    if args.s3:  # [s3] a gateway with the cluster, credentials in DIR/s3.env
        from threefs.cli.s3_cmd import start_for_cluster

        print(start_for_cluster(cluster, args.s3_port))
    if args.detach:
        return 0
    print("Press Ctrl-C to stop the cluster.")
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.2)
    unmount_for_cluster(cluster)
    from threefs.cli.s3_cmd import stop_for_cluster  # [s3]

    stop_for_cluster(cluster)
    print(f"stopped: {', '.join(cluster.down())}")
    del cfg
    return 0


def _up_spec(args) -> int:
    """`up --spec FILE`: this host's share of a cluster over several hosts (threefs/cli/multihost.py)."""
    from threefs.cli import multihost

    spec = multihost.load_spec(args.spec)
    host = args.host or multihost.local_host(spec)
    started = multihost.up_host(spec, host)
    print(f"host {host}: started {', '.join(started) or 'nothing (all running)'}")
    if args.wait:
        import asyncio

        from threefs.common.config import ClientConfig, load_toml

        client = load_toml(spec.data_dir_of(host) / "client.toml", ClientConfig)
        asyncio.run(multihost.wait_ready(spec, client))
        print(f"cluster is serving; client config {spec.data_dir_of(host) / 'client.toml'}")
    return 0


def cmd_down(args) -> int:
    from threefs.cli.cluster import LocalCluster

    if args.spec:
        from threefs.cli import multihost

        spec = multihost.load_spec(args.spec)
        stopped = multihost.down_host(spec, args.host or multihost.local_host(spec))
        print(f"stopped {len(stopped)} processes" + (f": {', '.join(stopped)}" if stopped else ""))
        return 0
    cluster = LocalCluster(args.dir)
    unmounted = unmount_for_cluster(cluster)
    from threefs.cli.s3_cmd import stop_for_cluster  # [s3]

    if (stopped_s3 := stop_for_cluster(cluster)) is not None:
        print(stopped_s3)
    if unmounted:
        print(f"unmounted {unmounted}")
    stopped = cluster.down()
    print(f"stopped {len(stopped)} processes" + (f": {', '.join(stopped)}" if stopped else ""))
    return 0


def cmd_status(args) -> int:
    from threefs.cli.status import no_primary_report, render_status, watch_status
    from threefs.common.config import ClientConfig, find_client_config, load_toml

    try:
        fs = client_for(args)
    except ThreeFSError as e:
        if e.code != StatusCode.UNAVAILABLE:
            raise
        config = load_toml(find_client_config(args.config), ClientConfig)
        raise ThreeFSError(StatusCode.UNAVAILABLE, no_primary_report(config, e)) from None
    with fs:
        if args.watch is not None:
            return watch_status(fs, args.watch, as_json=args.json)
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
    up.add_argument("--kv", default=None, metavar="URL",
                    help="metadata KV: etcd://host:port[,host:port...][/prefix] (default: SQLite in --dir)")
    up.add_argument("--spec", default=None, metavar="HOSTS.toml",
                    help="start this host's services of a cluster over several hosts (docs/operations.md)")
    up.add_argument("--host", default=None, help="with --spec: which host this is (default: by address)")
    up.add_argument("--wait", action="store_true", help="with --spec: wait until the whole cluster serves")
    up.add_argument("--no-mount", action="store_true", help="do not mount FUSE")
    up.add_argument("--mount", default="mnt", help="FUSE mount point (default ./mnt)")
    add_mount_flags(up)
    up.add_argument("--s3", action="store_true", help="also start an S3 gateway; credentials in DIR/s3.env")
    up.add_argument("--s3-port", type=int, default=None, help="the gateway's port (default: a free one)")
    up.set_defaults(fn=cmd_up)
    down = sub.add_parser("down", help="stop every process of a local cluster")
    down.add_argument("--dir", default=".threefs")
    down.add_argument("--spec", default=None, metavar="HOSTS.toml", help="stop this host's share of --spec")
    down.add_argument("--host", default=None, help="with --spec: which host this is (default: by address)")
    down.set_defaults(fn=cmd_down)

    add_file_commands(sub)
    status = sub.add_parser("status", help="nodes, targets and chains of the cluster")
    status.add_argument("--json", action="store_true")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                        help="refresh every SECONDS (default 2) until Ctrl-C")
    status.set_defaults(fn=cmd_status)
    from threefs.cli.admin import add_admin_parser

    add_admin_parser(sub)
    from threefs.cli.ckpt_cmd import add_ckpt_parser

    add_ckpt_parser(sub)
    from threefs.cli.ffrecord_cmd import add_ffrecord_parser

    add_ffrecord_parser(sub)
    from threefs.cli.queue_cmd import add_queue_parser

    add_queue_parser(sub)
    from threefs.cli.kvcache_cmd import add_kvcache_parser

    add_kvcache_parser(sub)
    from threefs.cli.s3_cmd import add_s3_parser

    add_s3_parser(sub)
    from threefs.cli.pond_cmd import add_pond_parser

    add_pond_parser(sub)
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
