"""`threefs admin` against real clusters: users and tokens, target overrides, LASTSRV rotation, scale-out."""

from __future__ import annotations

import re
import time

from threefs.cli.main import main
from threefs.client.client import Client
from threefs.common.config import ClientConfig, load_toml, save_toml
from threefs.common.status import StatusCode, ThreeFSError
from threefs.rpc.client import RpcClient
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas.common import Empty
from threefs.testing import checks

DEADLINE_S = 30.0


def wait_for(predicate, what: str, timeout: float = DEADLINE_S, interval: float = 0.05):
    return checks.wait_for(predicate, what, timeout, interval)


def routing(fs: Client) -> ms.RoutingInfo:
    return fs.run(fs.aio.mgmtd.call("status", Empty(), ms.MgmtdStatusRsp)).routing


def admin(capsys, config: str, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["--config", config, "admin", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def user_config(tmp_path, cluster_config: str, token: str, name: str) -> str:
    base = load_toml(cluster_config, ClientConfig)
    path = tmp_path / f"{name}.toml"
    save_toml(path, ClientConfig(mgmtd=base.mgmtd, token=token, cluster_dir=base.cluster_dir), mode=0o600)
    return str(path)


def token_of(out: str) -> str:
    return re.search(r"token:\n([0-9a-f]{64})\n", out).group(1)


def test_user_tokens_issue_use_revoke(private_cluster, tmp_path, capsys):
    cluster = private_cluster()
    config = str(cluster.client_config_path)
    with Client.connect(config) as fs:
        fs.mkdir("/pub")
        fs.write_bytes("/pub/hello", b"hello users" * 1000)
        code, out, _ = admin(capsys, config, "user-add", "alice", "--uid", "1000")
        assert code == 0
        alice_config = user_config(tmp_path, config, token_of(out), "alice")
        alice = Client.connect(alice_config)  # mgmtd, meta and storage accept her token
        assert alice.read_bytes("/pub/hello") == b"hello users" * 1000
        # a user token cannot administer
        code, _, err = admin(capsys, alice_config, "user-add", "mallory", "--uid", "6")
        assert code == 1 and "PERMISSION_DENIED" in err and "cluster token" in err
        code, _, err = admin(capsys, config, "user-add", "Bad Name!", "--uid", "7")
        assert code == 2 and "bad user name" in err
        code, _, err = admin(capsys, config, "user-add", "alice", "--uid", "1000")
        assert code == 1 and "exists" in err

        revoked_at = time.monotonic()
        assert admin(capsys, config, "user-revoke", "alice")[0] == 0

        def refused():
            try:
                alice.read_bytes("/pub/hello")
                return False
            except PermissionError:
                return True

        wait_for(refused, "the revoked token to stop working", interval=0.1)
        revoke_s = time.monotonic() - revoked_at
        alice.close()
        # every storage service refuses a new connection with the revoked token at the handshake
        storages = [n.addr for n in routing(fs).nodes.values() if n.type == ms.STORAGE]

        def storage_refuses(addr: str) -> bool:
            rpc = RpcClient(token_of(out))
            try:
                fs.run(rpc.call(addr, "storage.status", Empty(), object, timeout=3))
                return False
            except ThreeFSError as e:
                return e.code == StatusCode.AUTH_FAILED
            finally:
                fs.run(rpc.close())

        wait_for(lambda: all(storage_refuses(a) for a in storages), "storage to refuse the revoked token")
        storage_revoke_s = time.monotonic() - revoked_at
        code, listing, _ = admin(capsys, config, "user-list")
        assert re.search(r"alice\s+1000\s+1000\s+revoked", listing)
        # a fresh token works again
        code, out, _ = admin(capsys, config, "user-token", "alice")
        with Client.connect(user_config(tmp_path, config, token_of(out), "alice2")) as again:
            assert again.read_bytes("/pub/hello") == b"hello users" * 1000
        with Client.connect(config) as still:  # the cluster token keeps working throughout
            assert still.read_bytes("/pub/hello") == b"hello users" * 1000
    print(f"\nMEASURED token revocation: client refused {revoke_s:.2f} s after `user-revoke`, every storage "
          f"service refuses new connections after {storage_revoke_s:.2f} s")


def test_offline_online_target_and_scale_out(private_cluster, capsys, rng):
    cluster = private_cluster()
    config = str(cluster.client_config_path)
    with Client.connect(config) as fs:
        data = rng.randbytes(3 << 20)
        fs.write_bytes("/x", data)
        r = routing(fs)
        chain = r.chains[min(r.chains)]
        a, b, c = (t.target_id for t in chain.targets)
        assert admin(capsys, config, "offline-target", str(a))[0] == 0
        for _ in range(10):  # a refuses reads from when its routing shows the override: readers go on
            assert fs.read_bytes("/x") == data
        assert admin(capsys, config, "offline-target", str(b))[0] == 0
        wait_for(lambda: [t.public_state for t in routing(fs).chains[chain.chain_id].targets]
                 == [ms.SERVING, ms.OFFLINE, ms.OFFLINE], "two targets to go OFFLINE")
        code, _, err = admin(capsys, config, "offline-target", str(c))
        assert code == 2 and "only SERVING target" in err and "--force" in err
        capsys.readouterr()
        assert main(["--config", config, "status"]) == 0
        assert f"target {a} was taken offline by an admin" in capsys.readouterr().out
        fs.write_bytes("/y", data[:1000])  # the chain goes on with one target
        version = routing(fs).chains[chain.chain_id].version
        for t in (a, b):
            assert admin(capsys, config, "online-target", str(t))[0] == 0
        wait_for(lambda: all(t.public_state == ms.SERVING for t in routing(fs).chains[chain.chain_id].targets),
                 "the returned targets to resync and serve")
        assert routing(fs).chains[chain.chain_id].version >= version + 4  # each went SYNCING, then SERVING
        assert fs.read_bytes("/x") == data and fs.read_bytes("/y") == data[:1000]
        code, _, err = admin(capsys, config, "offline-target", "999999")
        assert code == 1 and "does not exist" in err

        # scale-out: a new storage service joins, a new chain table uses its targets
        code, out, _ = admin(capsys, config, "add-storage", "--dir", str(cluster.dir), "--targets", "2")
        assert code == 0 and "storage-4" in out
        code, _, err = admin(capsys, config, "create-chain-table", "--table-id", "2", "--replicas", "2")
        assert code == 1 and "NOT_ENOUGH_NODES" in err  # the free targets are all on one node
        code, out, _ = admin(capsys, config, "create-chain-table", "--table-id", "2", "--replicas", "1")
        assert code == 0 and "2 chains x 1 replicas" in out
        r = routing(fs)
        assert {r.targets[r.chains[cid].targets[0].target_id].node_id for cid in r.tables[2].chains} == {104}


def test_rotate_lastsrv_when_the_last_server_is_gone(private_cluster, capsys):
    """3FS#212: a chain waits for its LASTSRV; an admin may give up on it and serve from the next target."""
    cluster = private_cluster(storage=2, replicas=2, targets_per_storage=1)
    config = str(cluster.client_config_path)
    with Client.connect(config) as fs:
        fs.write_bytes("/old", b"both replicas have this" * 100)
        cluster.kill("storage-2")
        wait_for(lambda: all(t.public_state != ms.SERVING for t in routing(fs).targets.values()
                             if t.node_id == 102), "storage-2's target to go OFFLINE")
        fs.write_bytes("/new", b"only storage-1 has this" * 100)
        cluster.kill("storage-1")
        wait_for(lambda: [t.public_state for c in routing(fs).chains.values() for t in c.targets]
                 == [ms.LASTSRV, ms.OFFLINE], "storage-1's target to become LASTSRV")
        cluster.start_service(cluster.config_of("storage-2"))  # only the stale replica returns
        wait_for(lambda: [t.public_state for c in routing(fs).chains.values() for t in c.targets]
                 == [ms.LASTSRV, ms.WAITING], "the stale replica to wait for the LASTSRV")
        capsys.readouterr()
        assert main(["--config", config, "status"]) == 0
        assert "rotate-lastsrv" in capsys.readouterr().out
        code, out, _ = admin(capsys, config, "rotate-lastsrv", "1")
        assert code == 0
        wait_for(lambda: [t.public_state for c in routing(fs).chains.values() for t in c.targets]
                 == [ms.SERVING, ms.OFFLINE], "the rotated chain to serve")
        assert fs.read_bytes("/old") == b"both replicas have this" * 100
        assert fs.read_bytes("/new") != b"only storage-1 has this" * 100  # the documented price
        code, _, err = admin(capsys, config, "rotate-lastsrv", "1")
        assert code == 2 and "no LASTSRV head" in err
        cluster.up()  # the old LASTSRV returns and resyncs from the new head
        wait_for(lambda: all(t.public_state == ms.SERVING for c in routing(fs).chains.values()
                             for t in c.targets), "the old LASTSRV to resync")
        assert fs.read_bytes("/old") == b"both replicas have this" * 100
