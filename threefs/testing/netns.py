"""Hosts for fault-injection tests: Linux network namespaces joined by veth pairs to one bridge.

    with NetLab() as lab:               # needs root and iproute2; see netns_unavailable()
        ctl = lab.add_host("ctl")       # namespace <prefix>ctl, address 10.77.0.1 on its eth0
        s1 = lab.add_host("s1")
        proc = lab.popen("s1", [sys.executable, "-m", "threefs.server", conf])
        lab.cut("s1")                   # the host's link goes down: its peers see timeouts
        lab.restore("s1")
        lab.cap("s1", mbit=100)         # tbf on both directions of the host's link
    # exit: processes started here are killed, every namespace created here is deleted

The bridge lives in a namespace of its own, so nothing is added to the root namespace; all addresses are in
SUBNET, inside namespaces this lab created. Names carry a prefix unique to the lab (pid + counter), so
concurrent runs do not collide, and cleanup deletes exactly the names it created, even after a failure.
`tc netem` does not exist on this kernel: links are cut (down) or rate-limited (tbf), not delayed.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from threefs.common.config import ServiceConfig, TargetConfig
from threefs.common.ids import target_id
from threefs.common.status import StatusCode, ThreeFSError

SUBNET = "10.77.0"  # /24; hosts get .1, .2, ...
HOSTS_MAX = 200
IFNAME_MAX = 15  # Linux interface names
STOP_TIMEOUT_S = 10.0
_counter = itertools.count()


def netns_unavailable() -> str | None:
    """None when this process can create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise ThreeFSError(StatusCode.INTERNAL, f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


@dataclass
class Host:
    name: str
    netns: str
    address: str
    peer_if: str  # the veth end on the bridge (in the switch namespace)


class NetLab:
    """A bridge and hosts on it; a context manager that always cleans up what it made."""

    def __init__(self) -> None:
        reason = netns_unavailable()
        if reason is not None:
            raise ThreeFSError(StatusCode.NOT_SUPPORTED, reason)
        self.prefix = f"t3{os.getpid() % 100000:x}{next(_counter)}"
        self.switch = f"{self.prefix}sw"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        try:
            self._make_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def add_host(self, name: str) -> Host:
        """A new namespace with eth0 on the bridge and the next address of SUBNET."""
        index = len(self.hosts) + 1
        if name in self.hosts or index > HOSTS_MAX:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"host {name!r} exists or the lab is full")
        netns = f"{self.prefix}{name}"
        local, peer = f"{self.prefix}h{index}", f"{self.prefix}p{index}"
        if len(peer) > IFNAME_MAX:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"interface name {peer} is over {IFNAME_MAX} chars")
        self._make_namespace(netns)
        _ip("link", "add", local, "type", "veth", "peer", "name", peer)
        _ip("link", "set", local, "netns", netns)
        _ip("link", "set", peer, "netns", self.switch)
        _ip("-n", netns, "link", "set", local, "name", "eth0")
        address = f"{SUBNET}.{index}"
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        for dev in ("lo", "eth0"):
            _ip("-n", netns, "link", "set", dev, "up")
        _ip("-n", self.switch, "link", "set", peer, "master", "br0")
        _ip("-n", self.switch, "link", "set", peer, "up")
        host = self.hosts[name] = Host(name, netns, address, peer)
        return host

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside `host`'s namespace; it is killed at cleanup if still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host].netns, *argv],
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run `argv` inside `host` to completion, capturing its output."""
        return subprocess.run(["ip", "netns", "exec", self.hosts[host].netns, *argv], capture_output=True,
                              text=True, timeout=timeout)

    def cut(self, host: str) -> None:
        """Take the host's link down at the bridge: packets in both directions are dropped."""
        _ip("-n", self.switch, "link", "set", self.hosts[host].peer_if, "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[host].peer_if, "up")

    def cap(self, host: str, mbit: int) -> None:
        """Limit the host's link to `mbit` Mbit/s each way (tbf on both veth ends)."""
        spec = ["root", "tbf", "rate", f"{mbit}mbit", "burst", "256kbit", "latency", "50ms"]
        h = self.hosts[host]
        for netns, dev in ((h.netns, "eth0"), (self.switch, h.peer_if)):
            result = subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, *spec],
                                    capture_output=True, text=True, timeout=30)
            if result.returncode != 0:
                raise ThreeFSError(StatusCode.INTERNAL, f"tc on {dev}: {result.stderr.strip()}")

    def close(self) -> None:
        """Kill our processes (their whole session) and every process left in our namespaces, then delete
        every namespace we created."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass
        self._procs.clear()
        for netns in self._namespaces:  # what those started (daemons of `threefs up`) lives on in our namespaces
            pids = _ip("netns", "pids", netns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for netns in reversed(self._namespaces):
            _ip("netns", "del", netns, check=False)
        self._namespaces.clear()

    def _make_namespace(self, netns: str) -> None:
        _ip("netns", "add", netns)
        self._namespaces.append(netns)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


MGMTD_PORT, META_PORT, STORAGE_PORT = 7100, 7200, 7300  # service ports on netns hosts (each host its own IP)


def cluster_configs(lab: NetLab, work, token: str, storage_hosts: list[str], *, mgmtd: int = 1, meta: int = 1,
                    heartbeat_timeout_s: float = 3.0, **storage_extra) -> list[tuple[str, ServiceConfig]]:
    """(host, ServiceConfig) for a cluster on the lab's hosts: mgmtd and meta on host "ctl" (ports
    MGMTD_PORT + i, META_PORT + i), one storage service with 2 targets on each of `storage_hosts` (its
    own failure domain), the SQLite KV and the token file (written here) under `work`."""
    work = Path(work)
    token_file = work / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    ctl = lab.hosts["ctl"].address
    common = dict(mgmtd=[f"{ctl}:{MGMTD_PORT + i}" for i in range(mgmtd)], token_file=str(token_file),
                  heartbeat_timeout_s=heartbeat_timeout_s)
    kv = f"sqlite://{work / 'kv' / 'meta.db'}"
    out = [("ctl", ServiceConfig(type="mgmtd", name=f"mgmtd-{i + 1}", node_id=i + 1, listen_host=ctl,
                                 port=MGMTD_PORT + i, kv=kv, **common)) for i in range(mgmtd)]
    out += [("ctl", ServiceConfig(type="meta", name=f"meta-{i + 1}", node_id=51 + i, listen_host=ctl,
                                  port=META_PORT + i, kv=kv, **common)) for i in range(meta)]
    for i, host in enumerate(storage_hosts, 1):
        node = 100 + i
        targets = [TargetConfig(target_id(node, slot), str(work / "data" / f"s{i}" / f"t{slot}"))
                   for slot in (1, 2)]
        out.append((host, ServiceConfig(type="storage", name=f"storage-{i}", node_id=node,
                                        listen_host=lab.hosts[host].address, port=STORAGE_PORT, targets=targets,
                                        failure_domain=host, **storage_extra, **common)))
    return out
