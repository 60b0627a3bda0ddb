"""Metadata on a 3-member etcd spread over network-namespace hosts, with faults mid-workload.

Hosts: e1, e2, e3 (one etcd member each), ctl (mgmtd + 2 meta, their KV the etcd cluster over the bridge),
s1 (storage), cli (the client load of tests/multihost/netns_client.py: files written and closed, each close
that returned is acknowledged). While the load runs, the etcd member on e1 (the first endpoint, the one the
engines talk to) is killed with SIGKILL, then restarted; then host e2 is cut off (its link down: an etcd
member, maybe the leader, unreachable, requests to it time out), then restored.
Proof: the load keeps getting acknowledgements after each fault (meta keeps serving), and every acknowledged
file reads back with its checksum at the end (nothing acknowledged is lost).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from threefs.common.config import ClientConfig, save_toml
from threefs.testing.etcd_cluster import EtcdCluster, EtcdMember, die_with_parent, etcd_available
from threefs.testing.netns import MGMTD_PORT, NetLab, cluster_configs, netns_unavailable

from test_partition import DEADLINE_S, HELPER, Acks, _helper  # tests/multihost is on sys.path (rootdir)

pytestmark = [
    pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable())),
    pytest.mark.skipif(etcd_available() is not None, reason=str(etcd_available())),
]

TOKEN = "netns-etcd-token-" + "1" * 32
ETCD_HOSTS = ["e1", "e2", "e3"]
HEALTH_SCRIPT = ("import sys, urllib.request\n"
                 "print(urllib.request.urlopen(sys.argv[1] + '/health', timeout=2).read().decode())\n")


class NetnsEtcd(EtcdCluster):
    """An etcd cluster whose member i runs on lab host ETCD_HOSTS[i], at that host's address."""

    def __init__(self, lab: NetLab, workdir: Path):
        self.lab = lab
        super().__init__(workdir, members=3, hosts=[lab.hosts[h].address for h in ETCD_HOSTS])

    def spawn(self, index: int, argv: list[str], log) -> subprocess.Popen:
        # `ip netns exec` execs etcd in place, so the pid is etcd's and stop_member's SIGKILL reaches it.
        argv, extra = die_with_parent(argv)
        return self.lab.popen(ETCD_HOSTS[index], argv, stdout=log, stderr=subprocess.STDOUT, **extra)

    def health(self, member: EtcdMember) -> str:
        host = ETCD_HOSTS[self.members.index(member)]
        result = self.lab.run(host, [sys.executable, "-c", HEALTH_SCRIPT, member.client_url], timeout=10)
        if result.returncode != 0:
            raise OSError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no answer")
        return result.stdout


def test_metadata_on_etcd_hosts_survives_a_killed_member_and_a_cut_host(tmp_path: Path):
    work = tmp_path
    with NetLab() as lab:
        for name in (*ETCD_HOSTS, "ctl", "s1", "cli"):
            lab.add_host(name)
        with NetnsEtcd(lab, work / "etcd") as etcd:
            kv = etcd.kv_url("fs")
            logs = work / "log"
            logs.mkdir()
            for host, config in cluster_configs(lab, work, TOKEN, ["s1"], meta=2):
                if config.type in ("mgmtd", "meta"):
                    config = msgspec.structs.replace(config, kv=kv)
                conf = work / f"{config.name}.toml"
                save_toml(conf, config)
                with open(logs / f"{config.name}.log", "ab") as log:
                    lab.popen(host, [sys.executable, "-m", "threefs.server", str(conf)], stdout=log, stderr=log,
                              stdin=None)
            client_conf = str(work / "client.toml")
            save_toml(client_conf, ClientConfig(mgmtd=[f"{lab.hosts['ctl'].address}:{MGMTD_PORT}"], token=TOKEN,
                                                timeout_s=10.0), mode=0o600)
            _helper(lab, "ready", client_conf, "1", "1")

            stop = work / "stop"
            load = lab.popen("cli", [sys.executable, HELPER, "load", client_conf, str(stop), "20261218"],
                             stdout=subprocess.PIPE, text=True)
            acks = Acks(load.stdout)
            try:
                acks.wait_for(5)
                etcd.stop_member(0)  # SIGKILL: the endpoint every engine starts with
                acks.wait_for(len(acks.lines) + 5)  # meta keeps serving on the other two members
                etcd.start_member(0)  # rejoins with its data directory
                acks.wait_for(len(acks.lines) + 3)
                lab.cut("e2")  # a member's host cut off: its requests time out, maybe a leader election
                acks.wait_for(len(acks.lines) + 5)
                lab.restore("e2")
                acks.wait_for(len(acks.lines) + 3)
            finally:
                stop.write_text("stop")
                assert load.wait(timeout=DEADLINE_S) == 0
                acks.join()
            ack_file = work / "acks"
            ack_file.write_text("\n".join(acks.lines) + "\n")
            # The cluster may still be settling (mgmtd re-judging nodes after the faults): retry a few times.
            deadline = time.monotonic() + DEADLINE_S
            while True:
                result = lab.run("cli", [sys.executable, HELPER, "verify", client_conf, str(ack_file)],
                                 timeout=DEADLINE_S)
                if result.returncode == 0 or time.monotonic() > deadline or "UNAVAILABLE" not in result.stderr:
                    break
                time.sleep(1.0)
            assert result.returncode == 0, f"verify failed: {result.stdout}\n{result.stderr[-3000:]}"
            assert result.stdout.strip().splitlines()[-1] == f"OK {len(acks.lines)}"
            print(f"{len(acks.lines)} files acknowledged and verified; {len(acks.failures)} failed (not "
                  f"acknowledged): {acks.failures[:3]}")
