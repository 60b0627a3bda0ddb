"""The queue across network-namespace hosts: two producers and three consumers of one group, each on a host
of its own; mid-run a consumer and a storage service are killed with SIGKILL.

ctl runs mgmtd + meta, s1..s3 one storage service each (chains of R=3), pa/pb a producer each, c1..c3 a
consumer each (tests/queue/queue_proc.py). Proof: every record a producer got an offset for is delivered
at least once, with the value that offset was given for; and each consumer reads each partition in order —
between two changes of its assignment, consecutive offsets with no gap — also after the dead consumer's
partitions were reassigned and while the chains run on two replicas.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from threefs.common.config import ClientConfig, ServiceConfig, save_toml
from threefs.testing.netns import MGMTD_PORT, NetLab, cluster_configs, netns_unavailable

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

HELPER = str(Path(__file__).with_name("queue_proc.py"))
CLUSTER_HELPER = str(Path(__file__).parents[1] / "multihost" / "netns_client.py")
DEADLINE_S = 120.0
TOKEN = "netns-queue-token-" + "0" * 32
ROOT, TOPIC, GROUP, PARTITIONS = "/q", "orders", "g", 3


def _configs(lab: NetLab, work: Path) -> list[tuple[str, ServiceConfig]]:
    return cluster_configs(lab, work, TOKEN, ["s1", "s2", "s3"])


class Lines:
    """Collects a process's stdout lines in a thread."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def count(self, prefix: str) -> int:
        return sum(1 for line in list(self.lines) if line.startswith(prefix))

    def join(self) -> None:
        self._thread.join(timeout=DEADLINE_S)


def _wait(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.2)


def _acks(producers: list[Lines]) -> dict[tuple[int, int], str]:
    acks = {}
    for p in producers:
        for line in list(p.lines):
            if line.startswith("ACK "):
                _, part, offset, value = line.split()
                acks[(int(part), int(offset))] = value.split("-x")[0]
    return acks


def _deliveries(consumers: list[Lines]) -> dict[tuple[int, int], set[str]]:
    got = defaultdict(set)
    for c in consumers:
        for line in list(c.lines):
            if line.startswith("GOT "):
                _, part, offset, value = line.split()
                got[(int(part), int(offset))].add(value)
    return got


def _assigned(c: Lines) -> set[int]:
    """The partitions of the consumer's last ASSIGNED line."""
    lines = [line for line in list(c.lines) if line.startswith("ASSIGNED")]
    return {int(p) for p in lines[-1].split()[1].split(",")} if lines and lines[-1].split()[1:] else set()


def _check_order(c: Lines) -> None:
    """Between assignment changes, each partition's offsets are consecutive (a reassignment may restart a
    partition at its committed offset: duplicates, never a gap inside a run)."""
    last: dict[int, int] = {}
    for line in c.lines:
        if line.startswith("ASSIGNED"):
            last = {}
        elif line.startswith("GOT "):
            _, part, offset, _ = line.split()
            part, offset = int(part), int(offset)
            if part in last:
                assert offset == last[part] + 1, f"partition {part}: offset {offset} after {last[part]}"
            last[part] = offset


def test_queue_survives_a_killed_consumer_and_a_killed_storage_service(tmp_path: Path):
    work = tmp_path
    (work / "kv").mkdir()
    with NetLab() as lab:
        for name in ("ctl", "s1", "s2", "s3", "pa", "pb", "c1", "c2", "c3"):
            lab.add_host(name)
        logs = work / "log"
        logs.mkdir()
        services = {}
        for host, config in _configs(lab, work):
            conf = work / f"{config.name}.toml"
            save_toml(conf, config)
            with open(logs / f"{config.name}.log", "ab") as log:
                services[config.name] = lab.popen(host, [sys.executable, "-m", "threefs.server", str(conf)],
                                                  stdout=log, stderr=log, stdin=None)
        conf = str(work / "client.toml")
        save_toml(conf, ClientConfig(mgmtd=[f"{lab.hosts['ctl'].address}:{MGMTD_PORT}"], token=TOKEN,
                                     timeout_s=10.0), mode=0o600)
        r = lab.run("pa", [sys.executable, CLUSTER_HELPER, "ready", conf, "3", "3"], timeout=DEADLINE_S)
        assert r.returncode == 0, r.stderr[-3000:]
        r = lab.run("pa", [sys.executable, HELPER, "create", conf, ROOT, TOPIC, str(PARTITIONS)],
                    timeout=DEADLINE_S)
        assert r.returncode == 0 and "CREATED" in r.stdout, r.stderr[-3000:]

        stop_p, stop_c = work / "stop-producers", work / "stop-consumers"

        def start(host: str, *args: str) -> Lines:
            with open(logs / f"{host}.err", "ab") as err:
                return Lines(lab.popen(host, [sys.executable, HELPER, *args], stdout=subprocess.PIPE,
                                       stderr=err, text=True))

        consumers = [start(f"c{i}", "consume", conf, ROOT, TOPIC, GROUP, f"m{i}", str(stop_c)) for i in (1, 2, 3)]
        _wait(lambda: all(c.count("JOINED") for c in consumers), "every consumer joined")
        producers = [start(h, "produce-until", conf, ROOT, TOPIC, h, str(stop_p)) for h in ("pa", "pb")]
        _wait(lambda: all(p.count("ACK") >= 200 for p in producers), "both producers stored records")
        _wait(lambda: all(c.count("GOT") > 0 for c in consumers), "every consumer received records")

        _wait(lambda: all(_assigned(c) for c in consumers), "every consumer owns a partition")
        consumers[1].proc.kill()  # SIGKILL: no commit, no leave; its lease runs out
        consumers[1].proc.wait(timeout=DEADLINE_S)
        orphaned = _assigned(consumers[1])
        _wait(lambda: _assigned(consumers[0]) | _assigned(consumers[2]) == set(range(PARTITIONS)),
              f"the dead consumer's partitions {orphaned} were reassigned")
        acked = sum(p.count("ACK") for p in producers)
        services["storage-3"].kill()  # SIGKILL a storage service: chains go on with two replicas
        _wait(lambda: sum(p.count("ACK") for p in producers) >= acked + 400, "writes went on without storage-3")

        stop_p.write_text("stop")
        for p in producers:
            assert p.proc.wait(timeout=DEADLINE_S) == 0
            p.join()
            assert p.lines[-1] == "DONE"
        acks = _acks(producers)
        assert len(acks) == sum(p.count("ACK") for p in producers)  # no offset was given twice
        live = [consumers[0], consumers[2]]
        _wait(lambda: set(acks) <= set(_deliveries(consumers)), "every acknowledged record was delivered")
        stop_c.write_text("stop")
        for c in live:
            assert c.proc.wait(timeout=DEADLINE_S) == 0
            c.join()
        got = _deliveries(consumers)
        for key, value in acks.items():
            assert got[key] == {value}, f"partition {key[0]} offset {key[1]}: sent {value}, got {got[key]}"
        for c in consumers:
            _check_order(c)
        fails = [line for p in producers for line in p.lines if line.startswith("FAIL")]
        dups = sum(1 for c in consumers for line in c.lines if line.startswith("GOT ")) - len(got)
        print(f"{len(acks)} records acknowledged, all delivered ({dups} duplicate deliveries); "
              f"{len(fails)} sends failed (not acknowledged)")
