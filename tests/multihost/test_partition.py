"""Hosts as network namespaces: a storage host is cut off mid-load (R=3) and comes back.

ctl runs mgmtd + meta, s1..s3 one storage service each, cli the client (tests/multihost/netns_client.py).
Proof: no acknowledged write is lost, every acknowledged file reads back correct, and the host that came back
resyncs until every target is SERVING again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from threefs.common.config import ClientConfig, ServiceConfig, save_toml
from threefs.common.ids import target_id
from threefs.testing.netns import MGMTD_PORT, NetLab, cluster_configs, netns_unavailable

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

HELPER = str(Path(__file__).with_name("netns_client.py"))
DEADLINE_S = 90.0
TOKEN = "netns-test-token-" + "0" * 32


def _configs(lab: NetLab, work: Path) -> list[tuple[str, ServiceConfig]]:
    return cluster_configs(lab, work, TOKEN, ["s1", "s2", "s3"])


class Acks:
    """Collects the load's "ACK i crc" lines in a thread."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.failures: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            if line.startswith("ACK "):
                self.lines.append(line.strip())
            elif line.startswith("FAIL "):
                self.failures.append(line.strip())

    def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while len(self.lines) < count:
            assert time.monotonic() < deadline, f"only {len(self.lines)} of {count} writes acknowledged"
            time.sleep(0.1)

    def join(self) -> None:
        self._thread.join(timeout=DEADLINE_S)


def _helper(lab: NetLab, *args: str, timeout: float = DEADLINE_S) -> str:
    result = lab.run("cli", [sys.executable, HELPER, *args], timeout=timeout)
    assert result.returncode == 0, f"helper {args[0]} failed: {result.stdout}\n{result.stderr[-3000:]}"
    return result.stdout


def _wait_states(lab: NetLab, conf: str, predicate, what: str) -> dict[str, str]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        states = json.loads(_helper(lab, "states", conf).splitlines()[-1])
        if predicate(states):
            return states
        assert time.monotonic() < deadline, f"targets never {what}: {states}"
        time.sleep(0.5)


def test_partitioned_storage_host_loses_no_acknowledged_write(tmp_path: Path):
    work = tmp_path
    (work / "kv").mkdir()
    with NetLab() as lab:
        for name in ("ctl", "s1", "s2", "s3", "cli"):
            lab.add_host(name)
        logs = work / "log"
        logs.mkdir()
        for host, config in _configs(lab, work):
            conf = work / f"{config.name}.toml"
            save_toml(conf, config)
            with open(logs / f"{config.name}.log", "ab") as log:
                lab.popen(host, [sys.executable, "-m", "threefs.server", str(conf)], stdout=log,
                          stderr=log, stdin=None)
        client_conf = str(work / "client.toml")
        save_toml(client_conf, ClientConfig(mgmtd=[f"{lab.hosts['ctl'].address}:{MGMTD_PORT}"], token=TOKEN,
                                            timeout_s=10.0), mode=0o600)
        _helper(lab, "ready", client_conf, "3", "3")

        stop = work / "stop"
        load = lab.popen("cli", [sys.executable, HELPER, "load", client_conf, str(stop), "20261201"],
                         stdout=subprocess.PIPE, text=True)
        acks = Acks(load.stdout)
        acks.wait_for(5)
        s3_targets = {str(target_id(103, slot)) for slot in (1, 2)}

        lab.cut("s3")
        _wait_states(lab, client_conf, lambda st: all(st[t] != "SERVING" for t in s3_targets),
                     "took s3 out of service")
        after_cut = len(acks.lines)
        acks.wait_for(after_cut + 5)  # writes go on with two replicas

        lab.restore("s3")
        _wait_states(lab, client_conf, lambda st: set(st.values()) == {"SERVING"}, "all SERVING again")
        acks.wait_for(len(acks.lines) + 3)

        stop.write_text("stop")
        assert load.wait(timeout=DEADLINE_S) == 0
        acks.join()
        ack_file = work / "acks"
        ack_file.write_text("\n".join(acks.lines) + "\n")
        out = _helper(lab, "verify", client_conf, str(ack_file))
        assert out.strip().splitlines()[-1] == f"OK {len(acks.lines)}"
        print(f"{len(acks.lines)} writes acknowledged and verified; {len(acks.failures)} failed (not "
              f"acknowledged): {acks.failures[:3]}")
