"""Start and stop a real etcd cluster of local processes, for tests, benchmarks and `threefs up`.

    cluster = EtcdCluster(workdir, members=3)
    cluster.start()              # waits until every member answers /health
    url = cluster.kv_url("test") # "etcd://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/test"
    cluster.stop_member(0)       # kill one member (the other two keep quorum)
    cluster.start_member(0)      # it rejoins with its data directory
    cluster.stop()

The server flags are the ones the etcd KV engine (threefs.kv.etcd) needs: history kept longer than the MVCC
window (periodic compaction every COMPACTION_RETENTION), and the request and txn-op limits raised to fit a
FoundationDB-sized transaction (TXN_BYTES_MAX); see docs/operations.md.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from threefs.common.net import free_port
from threefs.common.status import StatusCode, ThreeFSError

ETCD_BINARY = "etcd"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
START_TIMEOUT_S = 30.0  # a 3-member cluster elects a leader in about a second; generous for a loaded machine
STOP_TIMEOUT_S = 10.0
COMPACTION_RETENTION = "5m"  # etcd history kept: far more than the KV's 5 s MVCC window
MAX_REQUEST_BYTES = 16 * 1024 * 1024  # above TXN_BYTES_MAX (10 MB) plus encoding overhead
MAX_TXN_OPS = 100_000  # etcd's default is 128; a KV commit is one etcd Txn with one op per written key


def _die_with_parent() -> None:
    """In the child: SIGKILL when the process that started it dies, so a killed test run leaks no etcd.
    Only where setpriv is missing (see die_with_parent): Python code between fork and exec can crash the child
    of a process whose gRPC threads are busy (seen: SIGSEGV before exec while an engine's watch streamed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_parent(argv: list[str]) -> tuple[list[str], dict]:
    """(argv, Popen keyword arguments) that start `argv` so that it gets SIGKILL when its parent dies:
    through util-linux's setpriv (no Python code runs in the forked child), else with a preexec_fn."""
    if shutil.which("setpriv"):
        return ["setpriv", "--pdeathsig", "KILL", *argv], {}
    return list(argv), {"preexec_fn": _die_with_parent}


def etcd_available() -> str | None:
    """None when the etcd binary can be run, else the reason it cannot."""
    if shutil.which(ETCD_BINARY) is None:
        return "etcd is not installed (run scripts/setup-etcd.sh as root: apt-get install etcd-server)"
    return None


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    host: str = "127.0.0.1"
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


class EtcdCluster:
    """`members` etcd processes on loopback, each with its own data directory under `workdir`."""

    def __init__(self, workdir: str | os.PathLike, members: int = 3, host: str = "127.0.0.1",
                 max_txn_ops: int = MAX_TXN_OPS, extra_args: list[str] | None = None,
                 hosts: list[str] | None = None):
        if members < 1:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"an etcd cluster needs >= 1 member, not {members}")
        self.workdir = Path(workdir)
        self.max_txn_ops = max_txn_ops
        self.extra_args = list(extra_args or [])  # more etcd flags, e.g. ["--unsafe-no-fsync"] for benchmarks
        self.token = f"threefs-{os.getpid()}-{time.monotonic_ns()}"
        hosts = hosts or [host] * members  # one address per member (e.g. network-namespace hosts)
        if len(hosts) != members:
            raise ThreeFSError(StatusCode.INVALID_ARGUMENT, f"{len(hosts)} hosts for {members} etcd members")
        self.members = [
            EtcdMember(f"m{i}", free_port(), free_port(), self.workdir / f"m{i}", hosts[i]) for i in range(members)
        ]

    @property
    def endpoints(self) -> str:
        """"host:port,host:port,..." of the client URLs."""
        return ",".join(f"{m.host}:{m.client_port}" for m in self.members)

    def kv_url(self, prefix: str = "") -> str:
        """The threefs KV URL of this cluster; keys live under `prefix` (isolates users of one cluster)."""
        return f"etcd://{self.endpoints}" + (f"/{prefix}" if prefix else "")

    def start(self) -> None:
        reason = etcd_available()
        if reason is not None:
            raise ThreeFSError(StatusCode.UNAVAILABLE, reason)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(len(self.members)):
                self.start_member(i, wait=False)
            for member in self.members:
                self._wait_healthy(member)
        except BaseException:
            self.stop()
            raise

    def start_member(self, index: int, *, wait: bool = True) -> None:
        member = self.members[index]
        if member.process is not None and member.process.poll() is None:
            return
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        state = "existing" if (member.data_dir / "member").exists() else "new"
        argv = [
            ETCD_BINARY, "--name", member.name, "--data-dir", str(member.data_dir),
            "--listen-client-urls", member.client_url, "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", initial, "--initial-cluster-token", self.token,
            "--initial-cluster-state", state,
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", COMPACTION_RETENTION,
            "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-txn-ops", str(self.max_txn_ops),
            "--heartbeat-interval", "100", "--election-timeout", "1000", *self.extra_args,
        ]
        log = open(self.workdir / f"{member.name}.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            member.process = self.spawn(index, argv, log)
        finally:
            log.close()
        if wait:
            self._wait_healthy(member)

    def spawn(self, index: int, argv: list[str], log) -> subprocess.Popen:
        """Start member `index`'s process (a subclass may start it elsewhere, e.g. in a network namespace)."""
        argv, extra = die_with_parent(argv)
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **extra)

    def health(self, member: EtcdMember) -> str:
        """The body of the member's /health (raises OSError when it does not answer)."""
        with urllib.request.urlopen(f"{member.client_url}/health", timeout=2) as resp:
            return resp.read().decode()

    def stop_member(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Stop one member (SIGKILL by default: a crash, not a goodbye)."""
        member = self.members[index]
        proc = member.process
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)
        member.process = None

    def stop(self) -> None:
        """Stop every member (by the pid we started); data directories stay for inspection."""
        for i in range(len(self.members)):
            self.stop_member(i, signal.SIGTERM)

    def _wait_healthy(self, member: EtcdMember) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:  # bounded by the deadline
            if member.process is not None and member.process.poll() is not None:
                raise ThreeFSError(StatusCode.UNAVAILABLE, f"etcd member {member.name} exited with "
                                   f"{member.process.returncode}; see {self.workdir}/{member.name}.log")
            try:
                body = self.health(member)
                if '"true"' in body:
                    return
                last = body
            except OSError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise ThreeFSError(StatusCode.TIMEOUT, f"etcd member {member.name} not healthy within {START_TIMEOUT_S} s "
                           f"({last}); see {self.workdir}/{member.name}.log")

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_shared: EtcdCluster | None = None


def shared_etcd() -> EtcdCluster:
    """One 3-member cluster per process (a test session), in a temporary directory; stop_shared_etcd() ends it.
    Raises ThreeFSError (UNAVAILABLE) when etcd is not installed or does not start."""
    global _shared
    if _shared is None:
        reason = etcd_available()
        if reason is not None:
            raise ThreeFSError(StatusCode.UNAVAILABLE, reason)
        cluster = EtcdCluster(tempfile.mkdtemp(prefix="threefs-etcd-"), members=3)
        cluster.start()
        _shared = cluster
    return _shared


def stop_shared_etcd() -> None:
    global _shared
    if _shared is not None:
        _shared.stop()
        shutil.rmtree(_shared.workdir, ignore_errors=True)
        _shared = None
