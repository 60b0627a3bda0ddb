"""A whole cluster (2 mgmtd, 2 meta, 3 storage, R=3) keeping its metadata on a real 3-member etcd cluster:
real file IO, and it keeps serving when an etcd member dies."""

from __future__ import annotations

import pytest

from threefs.cli.main import build_parser
from threefs.client.client import Client
from threefs.testing.etcd_cluster import EtcdCluster, etcd_available

pytestmark = pytest.mark.skipif(etcd_available() is not None, reason=str(etcd_available()))


def test_up_takes_a_kv_url():
    args = build_parser().parse_args(["up", "--kv", "etcd://10.0.0.1:2379,10.0.0.2:2379/prod"])
    assert args.kv == "etcd://10.0.0.1:2379,10.0.0.2:2379/prod"


def test_cluster_on_etcd_survives_losing_a_member(tmp_path, private_cluster, rng):
    with EtcdCluster(tmp_path / "etcd", members=3) as etcd:
        cluster = private_cluster(3, 3, kv=etcd.kv_url("fs"))
        assert all(c.kv == etcd.kv_url("fs") for c in cluster.service_configs(cluster.existing_spec())
                   if c.type in ("mgmtd", "meta"))
        try:
            with Client.connect(str(cluster.client_config_path)) as fs:
                data = rng.randbytes(3 * (1 << 20) + 777)
                fs.mkdir("/d")
                with fs.open("/d/a", "wb") as f:
                    f.write(data)
                assert fs.read_bytes("/d/a") == data

                etcd.stop_member(0)  # quorum stays with the other two
                with fs.open("/d/b", "wb") as f:
                    f.write(data[::-1])
                fs.rename("/d/a", "/d/c")
                assert sorted(fs.listdir("/d")) == ["b", "c"]
                assert fs.read_bytes("/d/c") == data and fs.read_bytes("/d/b") == data[::-1]
                etcd.start_member(0)
        finally:
            cluster.down()  # before etcd goes away, so no service hangs on a dead KV
