"""A local cluster in one directory: `threefs up` / `threefs down` (also used by the tests).

    DIR/token            cluster token (0600)          DIR/cluster.toml   shape + ports, fixed at first up
    DIR/conf/NAME.toml   service configs               DIR/run/NAME.pid   pids of running services
    DIR/log/NAME.log     service logs                  DIR/data/...       storage targets
    DIR/kv/meta.db       SQLite KV (mgmtd + meta)      DIR/client.toml    what clients need (addresses, token)

`up` on a partly running cluster starts only the missing processes, with their old identities.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from threefs.common.config import (ClientConfig, ServiceConfig, TargetConfig, load_toml, save_toml)
from threefs.common.ids import target_id
from threefs.common.net import free_port
from threefs.common.status import StatusCode, ThreeFSError, status_error

READY_TIMEOUT_S = 60.0
TARGETS_PER_STORAGE_MAX = 64
STOP_TIMEOUT_S = 10.0


class ClusterSpec(msgspec.Struct, kw_only=True):
    storage: int = 3
    replicas: int = 3
    targets_per_storage: int = 4
    meta: int = 2  # stateless; clients spread calls over them and fail over
    mgmtd: int = 2  # one primary (by lease in the shared KV) and standbys
    mgmtd_port: int = 0  # the first mgmtd's (clusters made before HA have only this one)
    mgmtd_ports: list[int] = []
    meta_ports: list[int] = []
    storage_ports: list[int] = []
    metrics_ports: dict[str, int] = {}  # service name -> Prometheus port
    storage_targets: dict[str, int] = {}  # service name -> targets, where not targets_per_storage
    heartbeat_timeout_s: float = 12.0  # ServiceConfig's defaults (docs/architecture.md, "The margins, derived")
    mgmtd_lease_s: float = 2.5
    meta_gc_delay_s: float = 60.0  # unlinked files' chunks are removed this long after the unlink
    client_session_timeout_s: float = 120.0  # write sessions of clients silent this long are pruned
    host: str = "127.0.0.1"
    kv: str = ""  # KV URL of mgmtd + meta (e.g. etcd://h:p,h:p/name); "" = the SQLite file DIR/kv/meta.db
    kvcache: int = 1  # kvcache meta services (threefs/kvcache/service.py); its index is DIR/kvcache/index.db
    kvcache_port: int = 0
    chunk_engine: str = ""  # storage targets' chunk engine ("" = default, storage/engines.py)
    write_cache: bool = True  # storage: False = chunk data written with RWF_DONTCACHE (ServiceConfig.write_cache)
    direct_reads: bool = True  # storage: False = cold whole chunks read buffered (ServiceConfig.direct_reads)

    def mgmtd_addrs(self) -> list[str]:
        return [f"{self.host}:{p}" for p in (self.mgmtd_ports or [self.mgmtd_port])]


class LocalCluster:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory).absolute()
        self._procs: dict[str, subprocess.Popen] = {}  # started by this object (poll() is exact)

    # -- layout ----------------------------------------------------------------------------------
    @property
    def client_config_path(self) -> Path:
        return self.dir / "client.toml"

    def _spec(self, storage: int | None, replicas: int | None, **extra) -> ClusterSpec:
        path = self.dir / "cluster.toml"
        if path.exists():
            spec = load_toml(path, ClusterSpec)
            if spec.kvcache and not spec.kvcache_port:  # a cluster made before the kvcache service
                spec.kvcache_port = free_port(spec.host)
                (self.dir / "kvcache").mkdir(parents=True, exist_ok=True)
                save_toml(path, spec)
            if extra.get("kv") and extra["kv"] != spec.kv:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"cluster in {self.dir} was created with KV "
                                   f"{spec.kv or 'sqlite (default)'!r}; it cannot move to {extra['kv']!r}")
            if storage is not None and storage != spec.storage or replicas is not None and replicas != spec.replicas:
                raise status_error(StatusCode.INVALID_ARGUMENT,
                                   f"cluster in {self.dir} was created with --storage {spec.storage} "
                                   f"--replicas {spec.replicas}; use a new --dir for another shape")
            return spec
        spec = ClusterSpec(storage=storage or 3, replicas=replicas or 3, **extra)
        if spec.replicas > spec.storage:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"--replicas {spec.replicas} needs at least as "
                               f"many storage services (--storage {spec.storage})")
        spec.mgmtd_ports = [free_port(spec.host) for _ in range(spec.mgmtd)]
        spec.mgmtd_port = spec.mgmtd_ports[0]
        spec.meta_ports = [free_port(spec.host) for _ in range(spec.meta)]
        spec.storage_ports = [free_port(spec.host) for _ in range(spec.storage)]
        names = ([f"mgmtd-{i}" for i in range(1, spec.mgmtd + 1)]
                 + [f"meta-{i}" for i in range(1, spec.meta + 1)]
                 + [f"storage-{i}" for i in range(1, spec.storage + 1)])
        spec.metrics_ports = {name: free_port(spec.host) for name in names}
        spec.kvcache_port = free_port(spec.host) if spec.kvcache else 0
        for sub in ("conf", "run", "log", "data", "kv", "kvcache"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        save_toml(path, spec)
        return spec

    def _token(self) -> str:
        path = self.dir / "token"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
        os.chmod(path, 0o600)
        return path.read_text().strip()

    def service_configs(self, spec: ClusterSpec) -> list[ServiceConfig]:
        common = dict(listen_host=spec.host, mgmtd=spec.mgmtd_addrs(), token_file=str(self.dir / "token"),
                      heartbeat_timeout_s=spec.heartbeat_timeout_s, mgmtd_lease_s=spec.mgmtd_lease_s)
        kv = spec.kv or f"sqlite://{self.dir / 'kv' / 'meta.db'}"
        configs = [ServiceConfig(type="mgmtd", name=f"mgmtd-{i}", node_id=i, port=port, kv=kv, **common)
                   for i, port in enumerate(spec.mgmtd_ports or [spec.mgmtd_port], 1)]
        for i, port in enumerate(spec.meta_ports, 1):
            configs.append(ServiceConfig(type="meta", name=f"meta-{i}", node_id=50 + i, port=port, kv=kv,
                                         meta_gc_delay_s=spec.meta_gc_delay_s,
                                         client_session_timeout_s=spec.client_session_timeout_s, **common))
        for i, port in enumerate(spec.storage_ports, 1):
            node = 100 + i
            slots = spec.storage_targets.get(f"storage-{i}", spec.targets_per_storage)
            targets = [TargetConfig(target_id(node, slot), str(self.dir / "data" / f"storage-{i}" /
                                                             f"target-{target_id(node, slot)}"))
                       for slot in range(1, slots + 1)]
            configs.append(ServiceConfig(type="storage", name=f"storage-{i}", node_id=node, port=port,
                                         targets=targets, failure_domain=f"storage-{i}",
                                         chunk_engine=spec.chunk_engine, write_cache=spec.write_cache,
                                         direct_reads=spec.direct_reads, **common))
        if spec.kvcache:
            configs.append(ServiceConfig(type="kvcache", name="kvcache-1", node_id=200, port=spec.kvcache_port,
                                         kv=str(self.dir / "kvcache" / "index.db"), **common))
        for c in configs:
            c.metrics_port = spec.metrics_ports.get(c.name, 0)
        return configs

    def config_of(self, name: str) -> ServiceConfig:
        """The config `up` gives service `name` (tests start variants of it with `start_service`)."""
        for c in self.service_configs(self.existing_spec()):
            if c.name == name:
                return c
        raise status_error(StatusCode.NOT_FOUND, f"no service {name} in the cluster in {self.dir}")

    def existing_spec(self) -> ClusterSpec:
        if not (self.dir / "cluster.toml").exists():
            raise status_error(StatusCode.NOT_FOUND, f"no cluster in {self.dir} (start one with `threefs up`)")
        return self._spec(None, None)

    def metrics_url(self, name: str) -> str:
        spec = self.existing_spec()
        port = spec.metrics_ports.get(name)
        if not port:
            raise status_error(StatusCode.NOT_FOUND, f"{name} has no metrics port in {self.dir}")
        return f"http://{spec.host}:{port}/metrics"

    def add_storage(self, targets: int | None = None) -> str:
        """Start one more storage service (a new node with its own failure domain) in this cluster.

        Its targets join no chain until a chain table uses them (`threefs admin create-chain-table`).
        Returns the new service's name once mgmtd lists it.
        """
        spec = self.existing_spec()
        if targets is not None and not 1 <= targets <= TARGETS_PER_STORAGE_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"targets per storage service must be in 1..{TARGETS_PER_STORAGE_MAX}")
        spec.storage += 1
        spec.storage_ports.append(free_port(spec.host))
        name = f"storage-{spec.storage}"
        if targets is not None:
            spec.storage_targets[name] = targets
        spec.metrics_ports[name] = free_port(spec.host)
        save_toml(self.dir / "cluster.toml", spec)
        self.up()
        return name

    # -- processes -------------------------------------------------------------------------------
    def pid_of(self, name: str) -> int | None:
        """The pid of our running service `name`, checked against /proc (never someone else's)."""
        try:
            pid = int((self.dir / "run" / f"{name}.pid").read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None
        conf = str(self.dir / "conf" / f"{name}.toml").encode()
        if b"threefs.server" in cmdline and conf in cmdline:
            try:
                if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                    return None  # exited, not yet reaped
            except FileNotFoundError:
                return None
            return pid
        return None

    def start_service(self, config: ServiceConfig) -> int:
        conf = self.dir / "conf" / f"{config.name}.toml"
        save_toml(conf, config)
        log = open(self.dir / "log" / f"{config.name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "threefs.server", str(conf)], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=self.dir)
        log.close()
        self._procs[config.name] = proc
        (self.dir / "run" / f"{config.name}.pid").write_text(str(proc.pid))
        return proc.pid

    def up(self, storage: int | None = None, replicas: int | None = None, **extra) -> ClientConfig:
        """Start what is not running, wait until the cluster serves, write client.toml."""
        self.dir.mkdir(parents=True, exist_ok=True)
        spec = self._spec(storage, replicas, **extra)
        token = self._token()
        started = []
        for config in self.service_configs(spec):
            if self.pid_of(config.name) is None:
                self.start_service(config)
                started.append(config.name)
        client = ClientConfig(mgmtd=spec.mgmtd_addrs(), token=token, cluster_dir=str(self.dir))
        try:
            asyncio.run(self._wait_ready(spec, client))
        except ThreeFSError as e:
            raise status_error(e.code, f"{e.message}; see the logs in {self.dir / 'log'}") from None
        save_toml(self.client_config_path, client, mode=0o600)
        return client

    async def _wait_ready(self, spec: ClusterSpec, client: ClientConfig) -> None:
        from threefs.client.aio import AsyncClient
        from threefs.rpc.schemas import mgmtd as ms

        aio = AsyncClient(client)
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = None
        try:
            while time.monotonic() < deadline:
                for name in self._dead_services(spec):
                    raise status_error(StatusCode.UNAVAILABLE, f"{name} exited during start-up; the end of "
                                       f"its log:\n{self.log_tail(name)}")
                try:
                    routing = await aio.mgmtd.refresh(force=True)
                    if len(routing.nodes_of_type(ms.STORAGE)) < spec.storage:
                        raise status_error(StatusCode.UNAVAILABLE, "storage services not registered yet")
                    if 1 not in routing.info.tables:
                        await aio.mgmtd.call("create_chain_table", ms.CreateChainTableReq(1, spec.replicas),
                                             ms.CreateChainTableRsp)
                        continue
                    metas = routing.nodes_of_type(ms.META)
                    if len(metas) < spec.meta:
                        raise status_error(StatusCode.UNAVAILABLE, "meta services not registered yet")
                    if any(n.hb_version == 0 for n in metas):  # heartbeats start once a meta is fully up
                        raise status_error(StatusCode.UNAVAILABLE, "meta services still starting")
                    await aio.stat("/")
                    if spec.kvcache:  # kvcache-1 publishes its address once it serves
                        await aio.stat("/.kvcache/service.json")
                    return
                except ThreeFSError as e:
                    last = e
                await asyncio.sleep(0.2)
            raise status_error(StatusCode.TIMEOUT, f"cluster not ready after {READY_TIMEOUT_S:.0f} s "
                               f"({last.message if last else 'no answer'})")
        finally:
            await aio.close()

    def log_tail(self, name: str, lines: int = 15) -> str:
        try:
            with open(self.dir / "log" / f"{name}.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16384))
                text = f.read().decode(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def _dead_services(self, spec: ClusterSpec) -> list[str]:
        return [c.name for c in self.service_configs(spec) if not self._alive(c.name)]

    def _alive(self, name: str) -> bool:
        proc = self._procs.get(name)
        if proc is not None:  # a fresh child may not have exec'd yet: /proc would show our cmdline
            return proc.poll() is None
        return self.pid_of(name) is not None

    def running(self) -> dict[str, int]:
        run = self.dir / "run"
        names = sorted(p.stem for p in run.glob("*.pid")) if run.exists() else []
        return {n: pid for n in names if (pid := self.pid_of(n)) is not None}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send a signal to one service (fault tests: kill -9)."""
        pid = self.pid_of(name)
        if pid is None:
            raise status_error(StatusCode.NOT_FOUND, f"{name} is not running")
        os.kill(pid, sig)
        if sig == signal.SIGKILL:
            _wait_gone([pid], 5.0)
            proc = self._procs.pop(name, None)
            if proc is not None:
                proc.wait(timeout=5)
        return pid

    def down(self) -> list[str]:
        """Stop every process of this cluster (SIGTERM, then SIGKILL after a grace period)."""
        running = self.running()
        for pid in running.values():
            os.kill(pid, signal.SIGTERM)
        left = _wait_gone(list(running.values()), STOP_TIMEOUT_S)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        _wait_gone(left, 5.0)
        for name in running:
            (self.dir / "run" / f"{name}.pid").unlink(missing_ok=True)
            proc = self._procs.pop(name, None)
            if proc is not None:
                proc.wait(timeout=5)
        return sorted(running)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait for processes to exit (reaping our own children); returns those still alive."""
    deadline = time.monotonic() + timeout
    left = list(pids)
    while left and time.monotonic() < deadline:
        still = []
        for pid in left:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done == 0:
                    still.append(pid)
            except ChildProcessError:  # not our child: poll /proc
                try:
                    state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
                    if state != "Z":
                        still.append(pid)
                except FileNotFoundError:
                    pass
        left = still
        if left:
            time.sleep(0.05)
    return left
