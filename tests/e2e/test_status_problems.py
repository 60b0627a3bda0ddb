"""`threefs status` says what is wrong that heartbeats alone do not show: a KV that cannot be written
(a real full disk: the cluster's KV on a small tmpfs, filled up) and a node that keeps flapping (a real
frozen process: SIGSTOP past the heartbeat timeout, then SIGCONT, three times)."""

from __future__ import annotations

import os
import signal
import subprocess
import pytest

from threefs.cli.main import main
from threefs.cli.status import gather, problems
from threefs.client.client import Client
from threefs.testing.checks import all_serving, wait_for


def status_text(cluster, capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main(["--config", str(cluster.client_config_path), "status"])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture
def small_kv_disk(tmp_path):
    """A 16 MiB tmpfs where the cluster keeps its SQLite KV (root only: CI and dev machines are)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    kv = tmp_path / "c0" / "kv"
    kv.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(kv)], check=True)
    yield kv
    subprocess.run(["umount", "-l", str(kv)], check=False)


def test_a_kv_that_cannot_be_written_is_named(private_cluster, small_kv_disk, capsys):
    """The KV's disk fills up. (A full disk alone does not stop SQLite: its WAL reuses its own space.
    New metadata makes the database grow, and once a checkpoint cannot write the database the WAL
    cannot wrap, and every write, the mgmtd lease renewals included, fails.)"""
    cluster = private_cluster(storage=3, replicas=3)
    fs = Client.connect(str(cluster.client_config_path))
    try:
        fs.mkdir("/before")
        filler = small_kv_disk / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
            except OSError:
                pass
        failed = None
        for i in range(20_000):  # bounded: the database grows until the disk refuses
            try:
                fs.mkdir(f"/grow-{i:05d}-" + "x" * 200)
            except OSError as e:
                failed = e
                break
        assert failed is not None, "20,000 directories fitted on a full disk"
        last = []
        try:
            wait_for(lambda: last.append(status_text(cluster, capsys)) or
                     (last[-1][0] != 0 and "cannot write its KV" in last[-1][1] and "full" in last[-1][1]),
                     "status to name the full KV", timeout=60)
        except AssertionError:
            raise AssertionError(f"status never named the KV; it said: {last[-1][1] if last else ''}") from None
        filler.unlink()
        wait_for(lambda: status_text(cluster, capsys)[0] == 0, "status to work again", timeout=60)
        wait_for(lambda: all_serving(fs), "the cluster to serve again", timeout=60)
        fs.mkdir("/after")  # and the namespace takes writes again
        assert {"before", "after"} <= set(fs.listdir("/"))
    finally:
        fs.close()


def test_a_flapping_node_is_named(private_cluster):
    cluster = private_cluster(storage=3, replicas=3)
    fs = Client.connect(str(cluster.client_config_path))
    try:
        pid = cluster.pid_of("storage-3")
        node = cluster.config_of("storage-3").node_id
        for _ in range(3):  # freeze it past the heartbeat timeout (3 s), then let it go on
            os.kill(pid, signal.SIGSTOP)
            try:
                wait_for(lambda: not fs.run(gather(fs.aio))[0].routing.nodes[node].alive,
                         "mgmtd to mark the frozen node failed", timeout=30)
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: fs.run(gather(fs.aio))[0].routing.nodes[node].alive, "the node back", timeout=30)
        st, mgmtds, bad = fs.run(gather(fs.aio))
        assert st.failures.get(node) == 3
        assert any(f"node {node}" in p and "keeps flapping" in p and "3 times" in p
                   for p in problems(st, bad, mgmtds)), problems(st, bad, mgmtds)
    finally:
        fs.close()
