"""Service process entry point: `python -m threefs.server CONFIG.toml` runs mgmtd, meta or storage.

The process serves until SIGTERM/SIGINT, then stops its loops, closes its listener and its disks.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvloop

from threefs.common.config import ServiceConfig, load_toml, read_token
from threefs.common.status import ThreeFSError
from threefs.rpc.client import RpcClient
from threefs.rpc.server import RpcServer

log = logging.getLogger("threefs.server")


async def _retry_forever(what: str, fn, interval: float = 0.5):
    """Start-up steps that need a peer (mgmtd) wait for it instead of failing the process."""
    while True:
        try:
            return await fn()
        except ThreeFSError as e:
            log.info("%s: %s; retrying", what, e)
            await asyncio.sleep(interval)


def _user_tokens_from(mgmtd, auth, on_tokens=None):
    """Storage and meta learn the valid user tokens from mgmtd whenever their version changes (meta also
    learns each token's uid/gid through `on_tokens`)."""
    from threefs.rpc.schemas import mgmtd as ms

    async def fetch(routing) -> bool:
        rsp = await mgmtd.call("list_tokens", ms.ListTokensReq(auth.version), ms.ListTokensRsp)
        if rsp.tokens is not None:
            auth.update(rsp.version, rsp.tokens)
            if on_tokens is not None:
                on_tokens(rsp.tokens)
        return True

    return fetch


def mgmtd_kv_url(url: str) -> str:
    """mgmtd's KV URL: on etcd, without the engine's replica unless the URL asks for one. The replica is a copy
    of every key under the prefix, kept by a watch; mgmtd shares the prefix with meta but reads only its own few
    keys, a few times a second at most (lease renewals, routing saves), so its copy of the whole namespace cost
    CPU on every meta commit and bought nothing (benchmarks/scaleout.py creates, 8 clients: mgmtd CPU per
    create 0.70 ms with the copy, 0.10 ms without)."""
    if not url.startswith("etcd://") or "replica=" in url.partition("?")[2]:
        return url
    return url + ("&" if "?" in url else "?") + "replica=off"


async def _build(config: ServiceConfig, token: str, server: RpcServer, metrics) -> tuple[list, list]:
    """Create the service; returns (background coroutines, cleanup callables)."""
    from threefs.cluster.mgmtd_client import MgmtdClient

    if config.type == "mgmtd":
        from threefs.kv import open_engine
        from threefs.mgmtd.admin import MgmtdAdmin
        from threefs.mgmtd.metrics import mgmtd_gauges
        from threefs.mgmtd.service import MgmtdService
        from threefs.mgmtd.store import MgmtdStore

        kv = await open_engine(mgmtd_kv_url(config.kv))
        svc = MgmtdService(config, MgmtdStore(kv), auth=server.authenticate)
        await svc.start()
        server.add_service("mgmtd", svc)
        server.add_service("mgmtd", MgmtdAdmin(svc))
        metrics.add_gauges(mgmtd_gauges(svc))
        return [svc.lease_loop(), svc.run_background()], [svc.release, kv.close]

    rpc_client = RpcClient(token, client_id=f"{config.name}")
    mgmtd = MgmtdClient(rpc_client, config.mgmtd, follow_redirects=config.mgmtd_follow_redirects)
    mgmtd.token_listener = _user_tokens_from(mgmtd, server.authenticate)
    server.authenticate.reload = lambda: mgmtd.token_listener(None)  # a token issued a moment ago
    if config.type == "storage":
        from threefs.storage.metrics import storage_gauges
        from threefs.storage.resync import Resyncer
        from threefs.storage.scrub import Scrubber
        from threefs.storage.service import StorageService

        svc = StorageService(config, rpc_client, mgmtd)
        svc.open_targets()
        resync = svc.resync = Resyncer(svc)
        scrubber = svc.scrubber = Scrubber(svc, config.scrub_interval_s)
        server.add_service("storage", svc)
        server.add_service("storage", resync)  # storage.sync_dump
        server.add_service("storage", scrubber)  # storage.scrub
        metrics.add_gauges(storage_gauges(svc))
        await _retry_forever("register with mgmtd", svc.register)
        return ([svc.heartbeat_loop(), mgmtd.refresh_loop(config.heartbeat_interval_s), resync.run(),
                 scrubber.run()],
                [svc.close, rpc_client.close])
    if config.type == "meta":
        from threefs.cluster.storage_client import StorageClient
        from threefs.kv import open_engine
        from threefs.meta.service import MetaService

        kv = await open_engine(config.kv)
        svc = MetaService(config, kv, mgmtd, StorageClient(rpc_client, mgmtd))
        mgmtd.token_listener = _user_tokens_from(mgmtd, server.authenticate, svc.set_users)
        server.add_service("meta", svc)
        await _retry_forever("register with mgmtd", svc.start)
        return ([*svc.background(), mgmtd.refresh_loop(config.heartbeat_interval_s)],
                [kv.close, rpc_client.close])
    raise SystemExit(f"unknown service type {config.type!r} in config")


def _cannot_listen(config: ServiceConfig, what: str, port: int, exc: OSError) -> str:
    return f"{config.name}: cannot listen for {what} on {config.listen_host}:{port}: {exc.strerror or exc}"


async def serve(config: ServiceConfig) -> None:
    from threefs.common.metrics import ServiceMetrics
    from threefs.rpc.auth import TokenAuthenticator

    token = read_token(config.token_file)
    auth = TokenAuthenticator(token)  # cluster token + user tokens (mgmtd-issued)
    if not 0 <= config.rpc_spin_us <= 100_000:
        raise SystemExit(f"{config.name}: rpc_spin_us = {config.rpc_spin_us} is outside 0 to 100000 (microseconds; "
                         "0 turns spinning off)")
    server = RpcServer(config.name, auth, spin_us=config.rpc_spin_us)
    auth.servers.append(server)
    metrics = ServiceMetrics(config.name, config.node_id)
    server.metrics_hook = metrics.observe_rpc
    # Both listeners bind before the service registers anywhere: a taken port fails fast, and says which.
    try:
        config.port = await server.start(config.listen_host, config.port,
                                         advertise_host=config.advertise_host,
                                         local=config.local_socket)
    except OSError as exc:
        raise SystemExit(_cannot_listen(config, "RPC", config.port, exc)) from None
    if config.metrics_port:
        try:
            metrics.serve(config.listen_host, config.metrics_port)
        except OSError as exc:
            raise SystemExit(_cannot_listen(config, "metrics", config.metrics_port, exc)) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    background, cleanup = await _build(config, token, server, metrics)
    log.info("%s (node %d) serving on %s", config.name, config.node_id, config.addr)
    died = await _supervise(config.name, [*background, metrics.watch_event_loop()], stop)
    await server.stop()
    for fn in cleanup:
        result = fn()
        if asyncio.iscoroutine(result):
            await result
    if died:
        raise SystemExit(f"{config.name}: {died}; the process exits so that its supervisor (`threefs up`, "
                         "systemd) restarts it")


async def _supervise(name: str, loops: list, stop: asyncio.Event) -> str | None:
    """Run the service's loops until `stop` is set. Each loop runs for the process's lifetime, so one
    that ends (an error, or a bug that returns) ends the process: a live process whose heartbeat or
    resync loop died would look healthy while doing nothing. Returns why, or None on a clean stop."""
    tasks = {asyncio.ensure_future(c): getattr(c, "__qualname__", repr(c)) for c in loops}
    stopping = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in [stopping, *tasks]:
            t.cancel()
        await asyncio.gather(stopping, *tasks, return_exceptions=True)
    dead = [t for t in done if t in tasks]
    if not dead:
        log.info("%s stopping", name)
        return None
    task = dead[0]
    error = None if task.cancelled() else task.exception()
    why = f"background loop {tasks[task]} {'failed: ' + repr(error) if error else 'ended'}"
    log.critical("%s: %s", name, why, exc_info=error)
    return why


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m threefs.server CONFIG.toml")
    config = load_toml(argv[0], ServiceConfig)
    logging.basicConfig(level=config.log_level, stream=sys.stderr,
                        format=f"%(asctime)s {config.name} %(levelname)s %(name)s: %(message)s")
    if config.type == "kvcache":  # the KV-cache meta service speaks its own protocol (threefs/kvcache)
        from threefs.kvcache.service import serve as serve_kvcache

        uvloop.run(serve_kvcache(config))
        return
    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
