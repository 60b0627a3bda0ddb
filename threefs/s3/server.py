"""`python -m threefs.s3.server`: one gateway process (uvicorn + httptools + uvloop)."""

from __future__ import annotations

import argparse
import logging
import sys

from threefs.common.config import ClientConfig, find_client_config, load_toml

KEEP_ALIVE_S = 75  # idle keep-alive connections (boto3 pools them)
BACKLOG = 2048


def serve(config: ClientConfig, host: str, port: int, root: str = "/", read_only: bool = False,
          region: str = "us-east-1", log_level: str = "warning") -> None:
    import uvicorn

    from threefs.s3.app import Gateway

    app = Gateway(config, root, read_only, region)
    uv = uvicorn.Config(app, host=host, port=port, loop="uvloop", http="httptools", lifespan="on",
                        log_level=log_level, access_log=False, timeout_keep_alive=KEEP_ALIVE_S,
                        backlog=BACKLOG, server_header=False, date_header=True, proxy_headers=False)
    server = uvicorn.Server(uv)
    server.run()
    if not server.started:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="threefs-s3", description="S3-compatible gateway to threefs")
    p.add_argument("--config", default=None, help="client config (needs the cluster token)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--root", default="/", help="threefs directory whose subdirectories are the buckets")
    p.add_argument("--read-only", action="store_true")
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = load_toml(find_client_config(args.config), ClientConfig)
    serve(config, args.host, args.port, args.root, args.read_only, args.region, args.log_level)


if __name__ == "__main__":
    main()
