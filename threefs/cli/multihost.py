"""A cluster over several hosts, described in one TOML file: `threefs up --spec hosts.toml [--host NAME]`.

Every host gets the same file and runs `up` for its own share; the file alone decides node ids, addresses
and ports, so the hosts agree without talking to each other. Example (docs/operations.md, "Several hosts"):

    token_file = "/etc/threefs/token"          # the same token on every host (0600)
    kv = "etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379/prod"
    data_dir = "/var/lib/threefs"              # per host; "{host}" is replaced by the host's name
    replicas = 3
    [[hosts]]
    name = "h1"
    address = "10.0.0.1"
    services = ["mgmtd", "meta", "storage"]
    [[hosts]]
    name = "h2"
    address = "10.0.0.2"
    services = ["storage"]

Node ids follow the order of the hosts: the i-th mgmtd is node i, the i-th meta 50 + i, the i-th storage
100 + i. Adding a host = appending it to the file, copying the file everywhere and running `up` on the new
host (its targets join chains once a chain table uses them: `threefs admin create-chain-table`).
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import msgspec

from threefs.cli.cluster import LocalCluster
from threefs.common.config import ClientConfig, ServiceConfig, TargetConfig, load_toml, save_toml
from threefs.common.ids import target_id
from threefs.common.status import StatusCode, ThreeFSError, status_error

SERVICE_TYPES = ("mgmtd", "meta", "storage")
META_NODE_BASE, STORAGE_NODE_BASE = 50, 100
MGMTD_MAX, META_MAX = 49, 49  # node ids of the three kinds never overlap
READY_TIMEOUT_S = 60.0


class HostEntry(msgspec.Struct, kw_only=True):
    name: str
    address: str  # what the other hosts and the clients connect to
    services: list[str]
    listen_host: str = ""  # what the services bind; default `address` (use 0.0.0.0 behind NAT)


class HostsSpec(msgspec.Struct, kw_only=True):
    hosts: list[HostEntry]
    token_file: str
    kv: str = ""  # KV URL of mgmtd + meta; "" = SQLite in data_dir, allowed when they all run on one host
    data_dir: str = "/var/lib/threefs/{host}"
    replicas: int = 3
    targets_per_storage: int = 4
    mgmtd_port: int = 8000
    meta_port: int = 8100
    storage_port: int = 8200
    heartbeat_timeout_s: float = 5.0

    def host(self, name: str) -> HostEntry:
        for h in self.hosts:
            if h.name == name:
                return h
        raise status_error(StatusCode.NOT_FOUND, f"no host {name!r} in the spec (hosts: "
                           f"{', '.join(h.name for h in self.hosts)})")

    def data_dir_of(self, name: str) -> Path:
        return Path(self.data_dir.replace("{host}", name))

    def mgmtd_addrs(self) -> list[str]:
        return [f"{h.address}:{self.mgmtd_port}" for h in self.hosts if "mgmtd" in h.services]


def load_spec(path: str | Path) -> HostsSpec:
    """Read and check a hosts spec; INVALID_ARGUMENT says what to fix."""
    spec = load_toml(path, HostsSpec)
    names = [h.name for h in spec.hosts]
    problems = []
    if len(set(names)) != len(names):
        problems.append("host names repeat")
    for h in spec.hosts:
        bad = [s for s in h.services if s not in SERVICE_TYPES]
        if bad or len(set(h.services)) != len(h.services):
            problems.append(f"host {h.name}: services must be distinct of {SERVICE_TYPES}, not {h.services}")
    count = {t: sum(t in h.services for h in spec.hosts) for t in SERVICE_TYPES}
    if not 1 <= count["mgmtd"] <= MGMTD_MAX or not 1 <= count["meta"] <= META_MAX or not count["storage"]:
        problems.append(f"needs 1..{MGMTD_MAX} mgmtd, 1..{META_MAX} meta and >= 1 storage, has {count}")
    if not 1 <= spec.replicas <= count["storage"]:
        problems.append(f"replicas {spec.replicas} must be in 1..{count['storage']} (the storage hosts)")
    kv_hosts = {h.name for h in spec.hosts if {"mgmtd", "meta"} & set(h.services)}
    if not spec.kv and len(kv_hosts) > 1:
        problems.append(f"mgmtd and meta run on {sorted(kv_hosts)}: they need a shared KV, set kv = "
                        f"\"etcd://...\" (SQLite is one host's file)")
    if problems:
        raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"hosts spec {path}: {'; '.join(problems)}")
    return spec


def service_configs(spec: HostsSpec) -> list[tuple[str, ServiceConfig]]:
    """(host name, config) of every service of the cluster, the same on every host."""
    kv = spec.kv
    if not kv:
        kv_host = next(h.name for h in spec.hosts if {"mgmtd", "meta"} & set(h.services))
        kv = f"sqlite://{spec.data_dir_of(kv_host).absolute() / 'kv' / 'meta.db'}"
    out: list[tuple[str, ServiceConfig]] = []
    seen = dict.fromkeys(SERVICE_TYPES, 0)
    for h in spec.hosts:
        common = dict(listen_host=h.listen_host or h.address, advertise_host=h.address,
                      mgmtd=spec.mgmtd_addrs(), token_file=spec.token_file,
                      heartbeat_timeout_s=spec.heartbeat_timeout_s)
        for kind in SERVICE_TYPES:  # a fixed order: node ids depend only on the file
            if kind not in h.services:
                continue
            seen[kind] += 1
            i = seen[kind]
            if kind == "mgmtd":
                config = ServiceConfig(type=kind, name=f"mgmtd-{i}", node_id=i, port=spec.mgmtd_port, kv=kv,
                                       **common)
            elif kind == "meta":
                config = ServiceConfig(type=kind, name=f"meta-{i}", node_id=META_NODE_BASE + i,
                                       port=spec.meta_port, kv=kv, **common)
            else:
                node = STORAGE_NODE_BASE + i
                data = spec.data_dir_of(h.name).absolute() / "data"
                targets = [TargetConfig(target_id(node, s), str(data / f"target-{target_id(node, s)}"))
                           for s in range(1, spec.targets_per_storage + 1)]
                config = ServiceConfig(type=kind, name=f"storage-{i}", node_id=node, port=spec.storage_port,
                                       targets=targets, failure_domain=h.name, **common)
            out.append((h.name, config))
    return out


def local_host(spec: HostsSpec) -> str:
    """The host of the spec whose address is on this machine (bindable); NOT_FOUND if none or several."""
    mine = []
    for h in spec.hosts:
        try:
            with socket.socket() as sock:
                sock.bind((h.address, 0))
            mine.append(h.name)
        except OSError:
            pass
    if len(mine) != 1:
        raise status_error(StatusCode.NOT_FOUND, f"cannot tell which host this is (addresses here: {mine}); "
                           f"pass --host NAME")
    return mine[0]


def up_host(spec: HostsSpec, host: str) -> list[str]:
    """Start the services of `host` that are not running; returns their names. Writes DATA_DIR/client.toml."""
    spec.host(host)
    directory = spec.data_dir_of(host)
    for sub in ("conf", "run", "log", "data", "kv"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(directory)
    token = Path(spec.token_file).read_text().strip()
    started = []
    for where, config in service_configs(spec):
        if where == host and cluster.pid_of(config.name) is None:
            cluster.start_service(config)
            started.append(config.name)
    save_toml(directory / "client.toml", ClientConfig(mgmtd=spec.mgmtd_addrs(), token=token), mode=0o600)
    return started


def down_host(spec: HostsSpec, host: str) -> list[str]:
    """Stop every service of `host` (started by up_host)."""
    return LocalCluster(spec.data_dir_of(host)).down()


async def wait_ready(spec: HostsSpec, client: ClientConfig, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until every storage host registered, create chain table 1 if missing, and meta answers."""
    from threefs.client.aio import AsyncClient
    from threefs.rpc.schemas import mgmtd as ms

    storage = sum("storage" in h.services for h in spec.hosts)
    aio = AsyncClient(client)
    deadline = time.monotonic() + timeout_s
    last: ThreeFSError | None = None
    try:
        while time.monotonic() < deadline:  # bounded by the deadline
            try:
                routing = await aio.mgmtd.refresh(force=True)
                if len(routing.nodes_of_type(ms.STORAGE)) < storage:
                    raise status_error(StatusCode.UNAVAILABLE, f"{len(routing.nodes_of_type(ms.STORAGE))} of "
                                       f"{storage} storage hosts registered")
                if 1 not in routing.info.tables:
                    await aio.mgmtd.call("create_chain_table", ms.CreateChainTableReq(1, spec.replicas),
                                         ms.CreateChainTableRsp)
                    continue
                await aio.stat("/")
                return
            except ThreeFSError as exc:
                last = exc
            await asyncio.sleep(0.3)
        raise status_error(StatusCode.TIMEOUT, f"cluster not ready after {timeout_s:.0f} s "
                           f"({last.message if last else 'no answer'})")
    finally:
        await aio.close()
