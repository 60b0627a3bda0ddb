"""A storage service cut off from mgmtd (and only from mgmtd) fences itself: a real cut, not a test hook.

storage-3 is restarted with its mgmtd addresses pointing at userspace TCP proxies in this test process
(and told not to follow redirects, which name mgmtd's real addresses).
`cut()` turns the proxies into a black hole (bytes are swallowed, nothing answers, like a dropped route):
clients and the other storage services still reach storage-3 directly. It must refuse reads and writes
with TARGET_OFFLINE within heartbeat_timeout/2 — before mgmtd fails it and gives its chains new heads —
so two heads never accept writes for one chain. `heal()` lets heartbeats through again: its targets
resync and serve. Timings are printed (-s).
"""

from __future__ import annotations

import select
import socket
import threading
import time

import crc32c

from threefs.client.client import Client
from threefs.common.ids import chunk_id
from threefs.common.status import StatusCode, ThreeFSError
from threefs.rpc.client import RpcClient
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.rpc.schemas.common import Empty
from threefs.testing import checks

DEADLINE_S = 30.0
PUMP_BYTES = 1 << 16


class BlackholeProxy:
    """host:port -> upstream, one thread per connection; `cut()` swallows everything, `heal()` ends that."""

    def __init__(self, upstream: str):
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.cut_now = False
        self.closed = False
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        upstream = None if self.cut_now else socket.create_connection(self.upstream)
        with self.lock:
            self.conns += [s for s in (client, upstream) if s is not None]
        peers = {client: upstream, upstream: client} if upstream else {client: None}
        try:
            while not self.closed:
                ready, _, _ = select.select(list(peers), [], [], 0.2)
                for sock in ready:
                    data = sock.recv(PUMP_BYTES)
                    if not data:
                        return
                    if not self.cut_now and peers[sock] is not None:
                        peers[sock].sendall(data)  # else: swallowed, like a dropped packet
        except OSError:
            return
        finally:
            for s in peers:
                if s is not None:
                    s.close()

    def cut(self) -> None:
        self.cut_now = True

    def heal(self) -> None:
        """Connections that lost bytes are broken mid-frame: close them (as their timeouts would)."""
        self.cut_now = False
        with self.lock:
            conns, self.conns = self.conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        self.heal()


def wait_for(predicate, what: str, timeout: float = DEADLINE_S, interval: float = 0.05):
    return checks.wait_for(predicate, what, timeout, interval)


def routing(fs: Client) -> ms.RoutingInfo:
    return fs.run(fs.aio.mgmtd.call("status", Empty(), ms.MgmtdStatusRsp)).routing


def direct_read(fs: Client, rpc: RpcClient, addr: str, chain: int, target: int) -> ThreeFSError | None:
    """A read sent straight to one storage service (no client retries): None if served."""
    req = ss.BatchReadReq([ss.ReadIO(chain, target, chunk_id(1 << 40, 0), 0, 4096)])
    try:
        rsp, _ = fs.run(rpc.call(addr, "storage.batch_read", req, ss.BatchReadRsp, timeout=2.0))
    except ThreeFSError as e:
        return e
    res = rsp.results[0]
    return ThreeFSError(res.status, res.message) if res.status else None


def direct_write(fs: Client, rpc: RpcClient, addr: str, chain: ms.ChainInfo) -> ThreeFSError | None:
    data = b"head?" * 100
    req = ss.UpdateReq(chain.chain_id, chain.version, chunk_id(1 << 41, 0), ss.WRITE, 0, len(data), 1 << 20,
                       crc32c.crc32c(data))
    try:
        fs.run(rpc.call(addr, "storage.update", req, ss.UpdateRsp, payload=data, timeout=5.0))
    except ThreeFSError as e:
        return e
    return None


def is_fenced(err: ThreeFSError | None) -> bool:
    return err is not None and err.code == StatusCode.TARGET_OFFLINE and "stopped serving" in err.message


def test_storage_cut_off_from_mgmtd_fences_itself(private_cluster, rng):
    cluster = private_cluster()
    fs = Client.connect(str(cluster.client_config_path))
    proxies = [BlackholeProxy(a) for a in fs.aio.config.mgmtd]
    rpc = RpcClient(fs.aio.config.token)
    try:
        cluster.kill("storage-3")
        config = cluster.config_of("storage-3")
        config.mgmtd = [p.addr for p in proxies]
        config.mgmtd_follow_redirects = False  # a redirect names mgmtd's real address: not via the proxy
        cluster.start_service(config)  # same identity, heartbeats now go through the proxies
        node, addr = config.node_id, config.addr
        wait_for(lambda: all(t.public_state == ms.SERVING for t in routing(fs).targets.values()),
                 "storage-3 back through the proxies")
        r = routing(fs)
        mine = sorted(t.target_id for t in r.targets.values() if t.node_id == node)
        chain_of = {t: r.targets[t].chain_id for t in mine}
        wait_for(lambda: direct_read(fs, rpc, addr, chain_of[mine[0]], mine[0]) is None,
                 "the restarted storage-3 to serve")
        fs.mkdir("/fence")
        before = {f"/fence/a{i}": rng.randbytes(100_000) for i in range(4)}
        for path, data in before.items():
            fs.write_bytes(path, data)

        assert any(p.conns for p in proxies)  # storage-3 reaches mgmtd through them (and only them)
        cut_at = time.monotonic()
        for p in proxies:
            p.cut()
        wait_for(lambda: is_fenced(direct_read(fs, rpc, addr, chain_of[mine[0]], mine[0])),
                 "storage-3 to fence itself", interval=0.02)
        fenced_s = time.monotonic() - cut_at
        # still fenced while mgmtd has not noticed yet? record whether mgmtd had already failed it
        offline_when_fenced = any(routing(fs).targets[t].public_state != ms.SERVING for t in mine)
        wait_for(lambda: all(routing(fs).targets[t].public_state == ms.OFFLINE for t in mine),
                 "mgmtd to fail storage-3 and take its targets offline")
        offline_s = time.monotonic() - cut_at
        # the chains storage-3 headed have new heads; storage-3 itself refuses to act as one
        r = routing(fs)
        for t in mine:
            chain = r.chains[chain_of[t]]
            assert chain.targets[0].target_id != t and chain.targets[0].public_state == ms.SERVING
            assert is_fenced(direct_write(fs, rpc, addr, chain))
            assert is_fenced(direct_read(fs, rpc, addr, chain.chain_id, t))
        during = {f"/fence/b{i}": rng.randbytes(100_000) for i in range(4)}
        for path, data in during.items():  # the cluster goes on without storage-3
            fs.write_bytes(path, data)
        for path, data in {**before, **during}.items():
            assert fs.read_bytes(path) == data

        healed_at = time.monotonic()
        for p in proxies:
            p.heal()
        wait_for(lambda: direct_read(fs, rpc, addr, chain_of[mine[0]], mine[0]) is None
                 or not is_fenced(direct_read(fs, rpc, addr, chain_of[mine[0]], mine[0])),
                 "storage-3 to unfence once heartbeats pass again")
        unfenced_s = time.monotonic() - healed_at
        wait_for(lambda: all(routing(fs).targets[t].public_state == ms.SERVING for t in mine),
                 "storage-3's targets to resync and serve again")
        serving_s = time.monotonic() - healed_at
        for t in mine:  # its copies were resynced: it serves reads itself
            assert direct_read(fs, rpc, addr, chain_of[t], t) is None
        for path, data in {**before, **during}.items():
            assert fs.read_bytes(path) == data
    finally:
        fs.run(rpc.close())
        fs.close()
        for p in proxies:
            p.close()
    assert not offline_when_fenced or fenced_s < offline_s
    print(f"\nMEASURED fencing (heartbeat timeout 3 s): fenced {fenced_s:.2f} s after the cut, mgmtd failed "
          f"the node after {offline_s:.2f} s; after healing: serving reads {unfenced_s:.2f} s, targets "
          f"SERVING again {serving_s:.2f} s")
