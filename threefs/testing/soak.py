"""A real-process soak under chaos: a cluster on network-namespace hosts, a mixed workload, and faults.

    python -m threefs.testing.soak --minutes 30 [--seed 1] [--dir DIR] [--checkpoint] [--fault-every 20 60]

Hosts (threefs/testing/netns.py): `ctl` runs mgmtd-1, mgmtd-2, meta-1, meta-2; `s1`..`sN` one storage
service each (2 targets, R=3 chains over N failure domains); `cli` runs the workload
(threefs/testing/soak_worker.py). Every U(fault-every) seconds the chaos loop injects one fault:
kill -9 of a random storage, meta or mgmtd process (restarted after a few seconds), a storage host's link
cut and restored, or a flipped byte in a random chunk file on a random storage target. At the end faults
stop, everything is restarted and healed, the chains must all be SERVING again, and the checker replays
the workload's acknowledgements: every acknowledged write must read back exactly, every acknowledged
namespace operation must show. It prints (and writes to DIR/soak.json) ops done, faults by kind, resyncs,
repairs, acknowledged bytes lost (goal 0), corrupt reads returned (goal 0) and the longest client stall.

Needs root (network namespaces). Kills only the processes it started; deletes only namespaces it made.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from threefs.common.config import ClientConfig, ServiceConfig, save_toml
from threefs.testing.chunk_files import random_committed_byte
from threefs.testing.netns import NetLab, cluster_configs, netns_unavailable

TOKEN = "soak-token-" + "0" * 40
READY_TIMEOUT_S = 120.0
HEAL_TIMEOUT_S = 300.0


class Soak:
    def __init__(self, work: Path, storage: int = 4, seed: int = 1, checkpoint: bool = False,
                 fault_every: tuple[float, float] = (20.0, 60.0), heartbeat_timeout_s: float = 3.0):
        self.work, self.storage, self.rng = work, storage, random.Random(seed)
        self.seed, self.checkpoint, self.fault_every = seed, checkpoint, fault_every
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.lab = NetLab()
        self.procs: dict[str, subprocess.Popen] = {}
        self.configs: dict[str, tuple[str, ServiceConfig]] = {}
        self.faults: dict[str, int] = {}
        self.events: list[str] = []
        self.client_conf = str(work / "client.toml")

    # -- cluster --------------------------------------------------------------------------------
    def _configs(self) -> None:
        hosts = [f"s{i}" for i in range(1, self.storage + 1)]
        for host, config in cluster_configs(self.lab, self.work, TOKEN, hosts, mgmtd=2, meta=2,
                                            heartbeat_timeout_s=self.heartbeat_timeout_s, scrub_interval_s=30.0):
            self.configs[config.name] = (host, config)

    def start(self) -> None:
        (self.work / "kv").mkdir(parents=True, exist_ok=True)
        (self.work / "log").mkdir(exist_ok=True)
        for name in ["ctl", *(f"s{i}" for i in range(1, self.storage + 1)), "cli"]:
            self.lab.add_host(name)
        self._configs()
        for name in self.configs:
            self.start_service(name)
        save_toml(self.client_conf, ClientConfig(mgmtd=self.configs["mgmtd-1"][1].mgmtd, token=TOKEN,
                                                 timeout_s=10.0), mode=0o600)
        self.ctl("ready", str(3), str(self.storage), timeout=READY_TIMEOUT_S)

    def start_service(self, name: str) -> None:
        host, config = self.configs[name]
        conf = self.work / f"{name}.toml"
        save_toml(conf, config)
        with open(self.work / "log" / f"{name}.log", "ab") as log:
            self.procs[name] = self.lab.popen(host, [sys.executable, "-m", "threefs.server", str(conf)],
                                              stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def kill(self, name: str) -> None:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)  # only our own child, by its Popen
            proc.wait(timeout=30)

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """A control command in the client namespace (threefs/testing/soak_ctl.py)."""
        result = self.lab.run("cli", [sys.executable, "-m", "threefs.testing.soak_ctl", self.client_conf, *args],
                              timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"soak_ctl {args[0]} failed: {result.stdout[-2000:]}\n{result.stderr[-3000:]}")
        return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""

    # -- faults ---------------------------------------------------------------------------------
    def inject(self) -> None:
        kind = self.rng.choice(["kill_storage", "kill_storage", "kill_meta", "kill_mgmtd", "cut_link",
                                "flip_bits"])
        if kind != "flip_bits":  # a flip counts once it happened (there may be no committed chunk yet)
            self.faults[kind] = self.faults.get(kind, 0) + 1
        if kind.startswith("kill_"):
            what = kind.removeprefix("kill_")
            names = [n for n in self.configs if n.startswith(what)]
            name = self.rng.choice(names)
            self.kill(name)
            self.events.append(f"{time.strftime('%H:%M:%S')} kill -9 {name}")
            time.sleep(self.rng.uniform(1.0, 8.0))
            self.start_service(name)
        elif kind == "cut_link":
            host = f"s{self.rng.randrange(1, self.storage + 1)}"
            self.lab.cut(host)
            self.events.append(f"{time.strftime('%H:%M:%S')} cut {host}")
            time.sleep(self.rng.uniform(2.0, 2.5 * self.heartbeat_timeout_s))
            self.lab.restore(host)
        else:
            self.events.append(f"{time.strftime('%H:%M:%S')} flip {self.flip_bits()}")

    def flip_bits(self) -> str:
        """Flip one byte of a random chunk's committed bytes on one replica's disk (either engine)."""
        for _ in range(8):  # the chunk may be replaced or removed between the lookup and the write
            found = random_committed_byte(self.work / "data", self.rng)
            if found is None:
                return "nothing (no committed chunks yet)"
            path, pos, what = found
            try:
                with open(path, "r+b") as f:
                    f.seek(pos)
                    byte = f.read(1)
                    if len(byte) != 1:
                        continue
                    f.seek(pos)
                    f.write(bytes([byte[0] ^ 0xFF]))
            except FileNotFoundError:
                continue
            self.faults["flip_bits"] = self.faults.get("flip_bits", 0) + 1
            return f"{what} in {path.relative_to(self.work)} at {pos}"
        return "nothing (every chunk found was replaced before the write)"

    def heal(self) -> None:
        for host in list(self.lab.hosts):
            self.lab.restore(host)
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                self.start_service(name)
        self.ctl("heal", timeout=HEAL_TIMEOUT_S)

    # -- the run --------------------------------------------------------------------------------
    def run(self, minutes: float) -> dict:
        out = self.work / "acks"
        stop = self.work / "stop"
        argv = [sys.executable, "-m", "threefs.testing.soak_worker", self.client_conf, str(stop),
                str(self.seed), str(out)] + (["--checkpoint"] if self.checkpoint else [])
        with open(self.work / "log" / "worker.log", "ab") as log:
            worker = self.lab.popen("cli", argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        t0 = time.monotonic()
        end = t0 + minutes * 60
        next_fault = t0 + self.rng.uniform(*self.fault_every)
        while time.monotonic() < end and worker.poll() is None:
            if time.monotonic() >= next_fault:
                self.inject()
                next_fault = time.monotonic() + self.rng.uniform(*self.fault_every)
            time.sleep(0.2)
        stop.write_text("stop")
        worker_rc = worker.wait(timeout=300)
        elapsed = time.monotonic() - t0
        self.heal()
        verdict = json.loads(self.ctl("verify", str(out), timeout=600))
        report_path = out / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
        logs = {n: (self.work / "log" / f"{n}.log").read_text(errors="replace") for n in self.configs}
        result = {
            "minutes": round(elapsed / 60, 1), "seed": self.seed, "worker_exit": worker_rc,
            "ops": report.get("ops", {}), "op_failures": report.get("failures", {}),
            "op_failure_messages": report.get("failure_messages", []),
            "faults": self.faults, "events": self.events,
            "resyncs_done": _count(logs, "resync of target", " done: "),
            "repairs": _count(logs, " repaired"),
            "repairs_failed": _count(logs, "NOT repaired"),
            "corruptions_found": _count(logs, "fails its checksum"),
            "acked_bytes": report.get("bytes_acked", 0),
            "acked_bytes_lost": verdict["acked_bytes_lost"], "lost": verdict["lost"],
            "namespace_wrong": verdict["namespace_wrong"], "checked": verdict["checked"],
            "checkpoint_problems": verdict["checkpoint_problems"],
            "corrupt_reads": report.get("corrupt_reads", []),
            "longest_stall_s": round(report.get("longest_stall_s", 0.0), 2),
        }
        (self.work / "soak.json").write_text(json.dumps(result, indent=1))
        return result

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        self.lab.close()


def _count(logs: dict[str, str], *words: str) -> int:
    return sum(1 for text in logs.values() for line in text.splitlines() if all(w in line for w in words))


def ok(result: dict) -> bool:
    return (result["worker_exit"] == 0 and result["acked_bytes_lost"] == 0 and not result["corrupt_reads"]
            and not result["namespace_wrong"] and not result["checkpoint_problems"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m threefs.testing.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--storage", type=int, default=4)
    p.add_argument("--dir", help="work directory (default: a new temporary one, kept for inspection)")
    p.add_argument("--checkpoint", action="store_true", help="also run a checkpoint save/load loop (torch)")
    p.add_argument("--fault-every", type=float, nargs=2, default=(20.0, 60.0), metavar=("MIN_S", "MAX_S"))
    args = p.parse_args(argv)
    why = netns_unavailable()
    if why:
        raise SystemExit(f"soak: {why}")
    work = Path(args.dir or tempfile.mkdtemp(prefix="threefs-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    soak = Soak(work, args.storage, args.seed, args.checkpoint, tuple(args.fault_every))
    try:
        soak.start()
        result = soak.run(args.minutes)
    finally:
        soak.close()
    print(json.dumps({k: v for k, v in result.items() if k != "events"}, indent=1))
    print(f"soak {'PASSED' if ok(result) else 'FAILED'}; details in {work}/soak.json and {work}/log/")
    return 0 if ok(result) else 1


if __name__ == "__main__":
    sys.exit(main())
