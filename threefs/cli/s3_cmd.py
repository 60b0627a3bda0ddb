"""`threefs s3 serve`, `threefs admin s3-key-add|s3-key-list|s3-key-revoke`, and `threefs up --s3`.

    threefs s3 serve [--host H] [--port P] [--root /] [--read-only]   one gateway (any number may run)
    threefs admin s3-key-add USER [--root /]                         a key pair for a threefs user
    threefs up --s3 [--s3-port P]                                    a gateway with the cluster; DIR/s3.env
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from threefs.common.status import StatusCode, status_error

GATEWAY_START_TIMEOUT_S = 30.0
ROOT_USER = "root"


def add_s3_parser(sub) -> None:
    s3 = sub.add_parser("s3", help="S3-compatible gateway (docs/s3.md)")
    cmds = s3.add_subparsers(dest="s3_cmd", required=True)
    p = cmds.add_parser("serve", help="serve S3 on HOST:PORT until interrupted")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--root", default="/", help="threefs directory whose subdirectories are the buckets")
    p.add_argument("--read-only", action="store_true", help="refuse every request that changes something")
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--workers", type=int, default=1, help="gateway processes sharing the port (one core each)")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(fn=cmd_serve)


def add_admin_s3_commands(cmds) -> None:
    """Registered under `threefs admin` (threefs/cli/admin.py)."""
    p = cmds.add_parser("s3-key-add", help="issue an S3 access key pair for a threefs user (shown once)")
    p.add_argument("name", help="a user of `threefs admin user-list`, or root")
    p.add_argument("--root", default="/", help="the gateways' --root")
    p.set_defaults(fn=cmd_key_add)
    p = cmds.add_parser("s3-key-list", help="list S3 access keys (not their secrets)")
    p.add_argument("--root", default="/")
    p.set_defaults(fn=cmd_key_list)
    p = cmds.add_parser("s3-key-revoke", help="revoke an S3 access key (gateways drop it within 5 s)")
    p.add_argument("access_key")
    p.add_argument("--root", default="/")
    p.set_defaults(fn=cmd_key_revoke)


def cmd_serve(args) -> int:
    from threefs.common.config import ClientConfig, find_client_config, load_toml
    from threefs.s3.server import serve

    config = load_toml(find_client_config(args.config), ClientConfig)
    print(f"threefs S3 gateway on http://{args.host}:{args.port} (root {args.root}"
          f"{', read-only' if args.read_only else ''}, {args.workers} worker(s))", flush=True)
    serve(config, args.host, args.port, args.root, args.read_only, args.region, args.log_level, args.workers)
    return 0


def _user_ids(fs, name: str) -> tuple[int, int]:
    if name == ROOT_USER:
        return 0, 0
    from threefs.cli.admin import _call
    from threefs.rpc.schemas import mgmtd as ms
    from threefs.rpc.schemas.common import Empty
    import asyncio

    rsp = asyncio.run(_call(fs.config, "user_list", Empty(), ms.UserListRsp))
    for u in rsp.users:
        if u.name == name:
            return u.uid, u.gid
    raise status_error(StatusCode.NOT_FOUND, f"no threefs user {name!r}: add one with "
                       "`threefs admin user-add NAME --uid U`")


def cmd_key_add(args) -> int:
    from threefs.client.client import Client
    from threefs.s3.keys import add_key

    with Client.connect(args.config) as fs:
        uid, gid = _user_ids(fs, args.name)
        access, secret = add_key(fs, args.root, args.name, uid, gid)
    print(f"S3 key for user {args.name} (uid {uid}, gid {gid}); the secret is shown only this once:\n"
          f"AWS_ACCESS_KEY_ID={access}\nAWS_SECRET_ACCESS_KEY={secret}")
    return 0


def cmd_key_list(args) -> int:
    from threefs.client.client import Client
    from threefs.s3.keys import list_keys

    with Client.connect(args.config) as fs:
        for k in list_keys(fs, args.root):
            print(f"{k['access_key']}  {k['user']} (uid {k['uid']}, gid {k['gid']})  "
                  f"created {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(k['created']))} UTC")
    return 0


def cmd_key_revoke(args) -> int:
    from threefs.client.client import Client
    from threefs.s3.keys import revoke_key

    with Client.connect(args.config) as fs:
        revoke_key(fs, args.root, args.access_key)
    print(f"S3 key {args.access_key} revoked (gateways stop accepting it within 5 s)")
    return 0


# -- a gateway with a local cluster (`threefs up --s3`) -------------------------------------------
def _state_file(cluster) -> Path:
    return cluster.dir / "run" / "s3-gateway.json"


def _alive(pid: int, marker: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"threefs.s3.server" in cmdline and marker.encode() in cmdline and state != "Z"


def start_for_cluster(cluster, port: int | None = None, host: str = "127.0.0.1") -> str:
    """Start a gateway for a local cluster (unless ours runs), write DIR/s3.env (0600) with an admin
    key pair; returns a line for the user."""
    from threefs.client.client import Client
    from threefs.common.net import free_port
    from threefs.s3.keys import add_key

    state = _state_file(cluster)
    env = cluster.dir / "s3.env"
    if state.exists():
        info = json.loads(state.read_text())
        if _alive(info["pid"], str(cluster.client_config_path)) and env.exists():
            return f"S3 gateway already serving on {info['endpoint']} (credentials: source {env})"
    port = port or free_port(host)
    log = open(cluster.dir / "log" / "s3-gateway.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "threefs.s3.server", "--config", str(cluster.client_config_path),
                             "--host", host, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=cluster.dir)
    log.close()
    endpoint = f"http://{host}:{port}"
    state.write_text(json.dumps({"pid": proc.pid, "endpoint": endpoint}))
    wait_listening(host, port, proc)
    with Client.connect(str(cluster.client_config_path)) as fs:
        access, secret = add_key(fs, "/", ROOT_USER, 0, 0)
    fd = os.open(env, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"export AWS_ENDPOINT_URL={endpoint}\nexport AWS_ACCESS_KEY_ID={access}\n"
                f"export AWS_SECRET_ACCESS_KEY={secret}\nexport AWS_DEFAULT_REGION=us-east-1\n"
                f"export AWS_REGION=us-east-1\n")
    os.chmod(env, 0o600)
    return f"S3 gateway serving on {endpoint} (pid {proc.pid}); `source {env}` for boto3, s3fs and the aws CLI"


def wait_listening(host: str, port: int, proc, timeout: float = GATEWAY_START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise status_error(StatusCode.UNAVAILABLE, f"the S3 gateway exited during start-up "
                               f"(code {proc.returncode}); see its log")
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.1)
    raise status_error(StatusCode.TIMEOUT, f"the S3 gateway did not listen on {host}:{port} in {timeout:.0f} s")


def stop_for_cluster(cluster) -> str | None:
    state = _state_file(cluster)
    if not state.exists():
        return None
    info = json.loads(state.read_text())
    pid = info["pid"]
    if _alive(pid, str(cluster.client_config_path)):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(pid, str(cluster.client_config_path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid, str(cluster.client_config_path)):
            os.kill(pid, signal.SIGKILL)
    state.unlink(missing_ok=True)
    return f"S3 gateway (pid {pid}) stopped"
