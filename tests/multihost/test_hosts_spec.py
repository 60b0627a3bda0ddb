"""`threefs up --spec hosts.toml --host NAME` on hosts that are network namespaces: every host starts its own
share from the same file, the cluster serves file IO, and a host added to the file joins."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from threefs.cli.multihost import load_spec, service_configs
from threefs.common.status import StatusCode, ThreeFSError
from threefs.testing.netns import NetLab, netns_unavailable

HELPER = str(Path(__file__).with_name("netns_client.py"))


def _spec_text(lab_addrs: dict[str, str], work: Path, storage_hosts: list[str]) -> str:
    lines = [f'token_file = "{work / "token"}"', f'data_dir = "{work}/{{host}}"', "replicas = 3",
             "targets_per_storage = 2", "heartbeat_timeout_s = 3.0",
             "[[hosts]]", 'name = "ctl"', f'address = "{lab_addrs["ctl"]}"', 'services = ["mgmtd", "meta"]']
    for name in storage_hosts:
        lines += ["[[hosts]]", f'name = "{name}"', f'address = "{lab_addrs[name]}"', 'services = ["storage"]']
    return "\n".join(lines) + "\n"


def test_spec_checks(tmp_path):
    path = tmp_path / "hosts.toml"
    path.write_text('token_file = "/t"\n[[hosts]]\nname = "a"\naddress = "10.0.0.1"\nservices = ["mgmtd", '
                    '"meta", "storage"]\n[[hosts]]\nname = "b"\naddress = "10.0.0.2"\nservices = ["meta", "disk"]\n')
    with pytest.raises(ThreeFSError) as info:
        load_spec(path)
    assert info.value.code == StatusCode.INVALID_ARGUMENT
    assert "disk" in str(info.value) and "shared KV" in str(info.value) and "replicas 3" in str(info.value)
    path.write_text('token_file = "/t"\nreplicas = 1\nkv = "etcd://10.0.0.9:2379"\n[[hosts]]\nname = "a"\n'
                    'address = "10.0.0.1"\nservices = ["mgmtd", "meta", "storage"]\n[[hosts]]\nname = "b"\n'
                    'address = "10.0.0.2"\nservices = ["meta", "storage"]\n')
    configs = {c.name: (h, c) for h, c in service_configs(load_spec(path))}
    assert sorted(configs) == ["meta-1", "meta-2", "mgmtd-1", "storage-1", "storage-2"]
    host, meta2 = configs["meta-2"]
    assert (host, meta2.node_id, meta2.addr, meta2.kv) == ("b", 52, "10.0.0.2:8100", "etcd://10.0.0.9:2379")
    assert configs["storage-2"][1].mgmtd == ["10.0.0.1:8000"]


@pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))
def test_cluster_over_namespace_hosts(tmp_path):
    work = tmp_path
    (work / "token").write_text("spec-test-token-" + "1" * 32 + "\n")
    (work / "token").chmod(0o600)
    with NetLab() as lab:
        addrs = {name: lab.add_host(name).address for name in ("ctl", "s1", "s2", "s3", "s4", "cli")}
        spec = work / "hosts.toml"
        spec.write_text(_spec_text(addrs, work, ["s1", "s2", "s3"]))
        up = [sys.executable, "-m", "threefs.cli.main", "up", "--spec", str(spec)]
        for host in ("ctl", "s1", "s2", "s3"):  # --host left out: each finds itself by its address
            result = lab.run(host, up + (["--wait"] if host == "s3" else []), timeout=120)
            assert result.returncode == 0, result.stderr[-3000:]
            assert f"host {host}: started" in result.stdout
        conf = str(work / "s3" / "client.toml")
        result = lab.run("cli", [sys.executable, HELPER, "roundtrip", conf])
        assert result.stdout.strip() == "OK", result.stderr[-3000:]

        spec.write_text(_spec_text(addrs, work, ["s1", "s2", "s3", "s4"]))  # adding a host: one more entry
        assert lab.run("s4", up).returncode == 0
        for _ in range(100):  # it registers within a few heartbeats
            if lab.run("cli", [sys.executable, HELPER, "storage-nodes", conf]).stdout.strip() == "4":
                break
        else:
            pytest.fail("the added storage host never registered")
        result = lab.run("s4", [sys.executable, "-m", "threefs.cli.main", "down", "--spec", str(spec)])
        assert result.returncode == 0 and "storage-4" in result.stdout
