"""Two client processes on two network-namespace hosts share one cache: what one puts, the other gets, byte
for byte. The cluster is a plain `threefs up` (LocalCluster) on a third host, listening on that host's
address; the clients find the kvcache service through the file system."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from threefs.testing.netns import NetLab, netns_unavailable

WORKER = str(Path(__file__).with_name("kv_worker.py"))
UP = ("import sys; from threefs.cli.cluster import LocalCluster; "
      "LocalCluster(sys.argv[1]).up(3, 3, host=sys.argv[2], heartbeat_timeout_s=3.0)")
N_KEYS = 200


@pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))
def test_two_hosts_share_a_cache(tmp_path):
    with NetLab() as lab:
        addrs = {name: lab.add_host(name).address for name in ("ctl", "h1", "h2")}
        result = lab.run("ctl", [sys.executable, "-c", UP, str(tmp_path / "c"), addrs["ctl"]], timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        conf = str(tmp_path / "c" / "client.toml")
        put = lab.run("h1", [sys.executable, WORKER, "write", conf, "/kv/shared", "H1", str(N_KEYS)], timeout=120)
        assert put.returncode == 0, put.stderr[-3000:]
        acks = [ln.split()[2] for ln in put.stdout.splitlines() if ln.startswith("ACK")]
        assert "".join(acks) == "1" * N_KEYS
        get = lab.run("h2", [sys.executable, WORKER, "read", conf, "/kv/shared", str(N_KEYS), "H1"], timeout=120)
        assert get.returncode == 0, get.stderr[-3000:]
        lines = get.stdout.splitlines()
        assert lines[-1] == f"DONE {N_KEYS}" and sum(ln.startswith("HIT ") for ln in lines) == N_KEYS
        # and back: h2 writes, h1 reads
        put = lab.run("h2", [sys.executable, WORKER, "write", conf, "/kv/other", "H2", "40"], timeout=120)
        assert put.returncode == 0, put.stderr[-3000:]
        get = lab.run("h1", [sys.executable, WORKER, "read", conf, "/kv/other", "40", "H2"], timeout=120)
        assert get.stdout.splitlines()[-1] == "DONE 40", get.stderr[-3000:]
        lab.run("ctl", [sys.executable, "-c", "import sys; from threefs.cli.cluster import LocalCluster; "
                        "LocalCluster(sys.argv[1]).down()", str(tmp_path / "c")], timeout=60)
