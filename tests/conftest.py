"""Shared fixtures: real local clusters (real processes, real TCP, SQLite KV, disks under tmp)."""

from __future__ import annotations

import os

import pytest

from threefs.cli.cluster import LocalCluster


def start_cluster(directory, storage: int = 3, replicas: int = 3, **extra) -> LocalCluster:
    cluster = LocalCluster(directory)
    cluster.up(storage, replicas, **extra)
    return cluster


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
