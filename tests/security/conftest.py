"""One small real cluster for the security suite (mgmtd, meta, storage processes), with two users."""

from __future__ import annotations

import pytest
from sec_helpers import SecEnv

from threefs.cli.cluster import LocalCluster


@pytest.fixture(scope="package")
def sec(tmp_path_factory):
    """Cluster of 2 storage services (R=2) plus users alice (uid 1000) and bob (uid 2000)."""
    cluster = LocalCluster(tmp_path_factory.mktemp("sec"))
    try:
        cluster.up(2, 2)
        env = SecEnv(cluster)
        env.add_user("alice", 1000)
        env.add_user("bob", 2000)
        yield env
        env.close()
    finally:
        cluster.down()
