"""`python -m threefs.s3.server`: one gateway (uvicorn + httptools + uvloop), optionally as N worker
processes sharing the port (SO_REUSEPORT: the kernel spreads connections), since one Python process
uses about one core."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from threefs.common.config import ClientConfig, find_client_config, load_toml

KEEP_ALIVE_S = 75  # idle keep-alive connections (boto3 pools them)
BACKLOG = 2048
WORKERS_MAX = 64


def _listen(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def _serve_one(config: ClientConfig, sock: socket.socket, root: str, read_only: bool, region: str,
               log_level: str) -> bool:
    import uvicorn

    from threefs.s3.app import Gateway

    app = Gateway(config, root, read_only, region)
    uv = uvicorn.Config(app, loop="uvloop", http="httptools", lifespan="on", log_level=log_level,
                        access_log=False, timeout_keep_alive=KEEP_ALIVE_S, backlog=BACKLOG, server_header=False,
                        date_header=True, proxy_headers=False)
    server = uvicorn.Server(uv)
    server.run(sockets=[sock])
    return server.started


def serve(config: ClientConfig, host: str, port: int, root: str = "/", read_only: bool = False,
          region: str = "us-east-1", log_level: str = "warning", workers: int = 1) -> None:
    if not 1 <= workers <= WORKERS_MAX:
        raise SystemExit(f"--workers must be between 1 and {WORKERS_MAX}")
    if workers == 1:
        if not _serve_one(config, _listen(host, port, False), root, read_only, region, log_level):
            sys.exit(1)
        return
    children = []
    for _ in range(workers):  # each child binds its own socket: the kernel balances connections
        sock = _listen(host, port, True)
        pid = os.fork()
        if pid == 0:
            ok = _serve_one(config, sock, root, read_only, region, log_level)
            os._exit(0 if ok else 1)
        sock.close()
        children.append(pid)

    def forward(signum, _frame):
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed = 0
    for pid in children:  # the parent lives as long as its workers
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) not in (0, -signal.SIGTERM, -signal.SIGINT)
    if failed:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="threefs-s3", description="S3-compatible gateway to threefs")
    p.add_argument("--config", default=None, help="client config (needs the cluster token)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--root", default="/", help="threefs directory whose subdirectories are the buckets")
    p.add_argument("--read-only", action="store_true")
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--workers", type=int, default=1, help="gateway processes sharing the port")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_toml(find_client_config(args.config), ClientConfig)
    serve(config, args.host, args.port, args.root, args.read_only, args.region, args.log_level, args.workers)


if __name__ == "__main__":
    main()
