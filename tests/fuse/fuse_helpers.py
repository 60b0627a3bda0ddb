"""Helpers shared by the FUSE tests (imported by conftest and the test modules)."""

from __future__ import annotations

import pytest

from threefs.client import fuse_mount


def require_fuse() -> None:
    reason = fuse_mount.fuse_unavailable_reason()
    if reason:
        pytest.skip(f"FUSE unavailable: {reason}")


stop_daemon = fuse_mount.stop  # unmount, wait, kill if needed: nothing left behind


def daemon_counters(proc, log: str, seen: int) -> tuple[dict, dict, dict]:
    """(statistics, kernel requests per operation, meta calls per method) of a daemon so far, from the line
    SIGUSR1 makes it log (the one after the `seen` lines already read)."""
    import ast
    import os
    import re
    import signal
    import time

    os.kill(proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = [x for x in open(log) if "requests served" in x]
        if len(lines) > seen:
            line = lines[-1]
            return tuple(ast.literal_eval(re.search(rf"{label}: (\{{.*?\}})", line).group(1))
                         for label in ("requests served", "kernel requests", "meta calls"))
        time.sleep(0.05)
    raise AssertionError(f"the daemon logged no statistics within 30 s (see {log})")


def run_on_daemon_ops(cluster, scenario, options=None) -> None:
    """Run `await scenario(aio, ops, ctx)` against the daemon's operations without a kernel (the requests
    called as pyfuse3 would): a ThreeFSOperations over a client of the shared cluster, and a request
    context of this process's user. Closes both afterwards."""
    import asyncio
    import os
    import types

    from threefs.client.aio import AsyncClient
    from threefs.client.fuse import MountOptions, ThreeFSOperations
    from threefs.common.config import ClientConfig, load_toml

    async def main() -> None:
        aio = await AsyncClient(load_toml(str(cluster.client_config_path), ClientConfig)).start()
        ops = ThreeFSOperations(aio, options or MountOptions())
        ctx = types.SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=os.getpid(), umask=0o022)
        try:
            await scenario(aio, ops, ctx)
        finally:
            ops._coalescer.close()
            await aio.close()

    asyncio.run(main())
