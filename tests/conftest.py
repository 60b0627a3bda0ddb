"""Shared fixtures: real local clusters (real processes, real sockets: Unix between the processes of one host,
TCP with THREEFS_RPC_LOCAL=0 and across network namespaces; SQLite KV, disks under tmp)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from threefs.cli.cluster import LocalCluster


def start_cluster(directory, storage: int = 3, replicas: int = 3, **extra) -> LocalCluster:
    cluster = LocalCluster(directory)
    try:
        cluster.up(storage, replicas, **extra)
    except BaseException:
        cluster.down()  # a cluster that never became ready must not outlive the test
        raise
    return cluster


@pytest.fixture(scope="session", autouse=True)
def no_leaked_services(tmp_path_factory):
    """At the end of the session, kill any service process still running from this session's temp
    directories (a test that died between starting a cluster and registering its teardown, or a
    teardown that failed). They are ours by construction: their config lives under our basetemp."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"threefs.server" in args and any(a.decode(errors="replace").startswith(base) for a in args):
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One cluster shared by the tests that do not break things (3 storage, R=3)."""
    c = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.down()


@pytest.fixture(scope="session")
def fs(cluster):
    from threefs.client.client import Client

    client = Client.connect(str(cluster.client_config_path))
    yield client
    client.close()


@pytest.fixture
def d(fs, request):
    """A directory of this test's own on the shared cluster (named after its module and test),
    removed afterwards."""
    name = request.node.name.replace("[", "_").replace("]", "").replace("/", "_")
    path = f"/{request.module.__name__.rsplit('.', 1)[-1]}-{name}"
    fs.mkdir(path)
    yield path
    try:
        fs.remove_tree(path)
    except OSError:  # a test that broke the cluster must not also fail here
        pass


@pytest.fixture
def private_cluster(tmp_path):
    """A cluster of its own for tests that kill or restart processes (short heartbeat timeout)."""
    clusters = []

    def make(storage=3, replicas=3, **extra):
        extra.setdefault("heartbeat_timeout_s", 3.0)
        c = start_cluster(tmp_path / f"c{len(clusters)}", storage, replicas, **extra)
        clusters.append(c)
        return c

    yield make
    for c in clusters:
        c.down()


@pytest.fixture
def rng():
    import random

    return random.Random(int(os.environ.get("THREEFS_TEST_SEED", "20261201")))
