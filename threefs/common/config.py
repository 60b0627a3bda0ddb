"""Configuration files (TOML) of services and clients, as typed structs."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from threefs.common.status import StatusCode, status_error


CLIENT_TIMEOUT_S_DEFAULT = 30.0  # [client] timeout_s: one RPC of a client


class TargetConfig(msgspec.Struct):
    target_id: int
    path: str
    engine: str = ""  # chunk engine: "v1", "v2", "" = the service's chunk_engine (threefs/storage/engines.py)


class ServiceConfig(msgspec.Struct, kw_only=True):
    type: str  # mgmtd | meta | storage
    name: str  # e.g. storage-1
    node_id: int
    listen_host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""  # defaults to listen_host
    mgmtd: list[str] = []  # mgmtd addresses host:port
    token_file: str = ""
    kv: str = ""  # KV URL (mgmtd, meta)
    targets: list[TargetConfig] = []  # storage
    failure_domain: str = ""
    heartbeat_interval_s: float = 1.0
    # T (storage fences itself after T/2 without an accepted heartbeat). Derived in docs/architecture.md,
    # "The margins, derived": T/2 must exceed the heartbeat gap of an unclean mgmtd failover,
    # H + L + 0.27 s + 3C + 2 rtt (3.77 s + 3C + 2 rtt with these values); T = 12 s leaves 2.23 s for the
    # commits, round trips and event-loop stalls, and a dead node is failed well inside clients' 20 s retries.
    heartbeat_timeout_s: float = 12.0
    chain_update_interval_s: float = 0.5
    # mgmtd HA: the primary renews a lease in the KV every renew interval; a standby takes an expired one.
    # L - R is how late a renewal may be (a KV commit behind writeback, an event-loop stall) before the lease
    # moves: 2 s, against 0.67 s measured under the pressure harness (a 1.17 s gap between renewals).
    mgmtd_lease_s: float = 2.5
    mgmtd_lease_renew_s: float = 0.5
    # Follow a standby's "primary is at ADDR" redirect. False when mgmtd is reached through proxies or NAT:
    # the address mgmtd advertises is then not the one to use from here, so only `mgmtd` addresses are tried.
    mgmtd_follow_redirects: bool = True
    gc_interval_s: float = 0.5
    meta_gc_delay_s: float = 60.0  # meta: an unlinked file's chunks are removed this long after its unlink
    client_session_timeout_s: float = 120.0  # meta: write sessions of clients silent this long are pruned
    fsync: bool = False
    # storage, chunk engine v2: False writes chunk data with RWF_DONTCACHE (Linux >= 6.14; older kernels and
    # file systems without it fall back to plain writes): written pages leave the page cache once on disk.
    # On VMs that hand free memory back to the host, filling new page-cache pages is most of a write's CPU
    # (docs/chunk-engine.md, "Write cache"); reads of recently written data then come from the disk.
    write_cache: bool = True
    # storage, chunk engine v2: whole committed chunks (>= 128 KiB) not in the page cache are read with O_DIRECT
    # into pooled buffers (a buffered cold read costs 1.5-1.9 CPU-s/GB here, O_DIRECT 0.08-0.11) and stay out
    # of the page cache, as 3FS's storage reads; False reads them buffered, so a hot set read again in whole
    # chunks is served from memory (docs/chunk-engine.md, "Cold reads").
    direct_reads: bool = True
    chunk_engine: str = ""  # storage: "v1" | "v2" | "" (an existing target's own, else the default; storage/engines.py)
    scrub_interval_s: float = 600.0  # storage: one full checksum pass per interval (0 = off)
    metrics_port: int = 0  # 0 = no Prometheus endpoint
    # Also listen on a Unix socket (Linux abstract namespace, named for the TCP address): clients in the
    # same network namespace connect through it instead of loopback TCP (common/local_socket.py; docs/operations.md).
    local_socket: bool = True
    # After a request, poll for the next one instead of sleeping (for twice the average time between
    # requests), while they come closer together than this on average and no more tasks run than CPUs
    # (0 = always sleep; common/spin.py Spinner, docs/architecture.md)
    rpc_spin_us: float = 1000.0
    log_level: str = "INFO"

    @property
    def addr(self) -> str:
        return f"{self.advertise_host or self.listen_host}:{self.port}"


class ClientConfig(msgspec.Struct, kw_only=True):
    mgmtd: list[str]
    token: str
    timeout_s: float = CLIENT_TIMEOUT_S_DEFAULT
    request_to_send: int = 0  # > 0: storage asks before sending read data; at most this many at once
    cluster_dir: str = ""


def load_toml(path: str | Path, type_: type):
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise status_error(StatusCode.NOT_FOUND, f"config file {path} does not exist") from None
    try:
        return msgspec.toml.decode(data, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"config file {path}: {e}") from None


def save_toml(path: str | Path, obj, mode: int = 0o644) -> None:
    """Atomic write (temp + rename) so a crash never leaves a half-written config."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.toml.encode(obj))
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def read_token(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except FileNotFoundError:
        raise status_error(StatusCode.NOT_FOUND, f"token file {path} does not exist") from None


def find_client_config(explicit: str | None = None) -> Path:
    """--config, then $THREEFS_CONFIG, then ./.threefs/client.toml."""
    for candidate in (explicit, os.environ.get("THREEFS_CONFIG"), ".threefs/client.toml"):
        if candidate:
            if Path(candidate).is_file():
                return Path(candidate)
            if candidate is explicit or candidate == os.environ.get("THREEFS_CONFIG"):
                raise status_error(StatusCode.NOT_FOUND, f"client config {candidate} does not exist")
    raise status_error(
        StatusCode.NOT_FOUND,
        "no client config: pass --config FILE, set THREEFS_CONFIG, or run `threefs up` here "
        "(it writes ./.threefs/client.toml)",
    )
