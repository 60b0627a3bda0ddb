"""Helpers of the security suite: user clients, raw sockets that speak (or abuse) the wire protocol."""

from __future__ import annotations

import socket

import msgspec

from threefs.client.client import Client
from threefs.common.config import ClientConfig, load_toml
from threefs.rpc.frame import (KIND_HELLO, KIND_REQUEST, PREFIX, PREFIX_BYTES, Header, body_encoder,
                               encode_frame_head)
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas.common import Empty, Hello
from threefs.testing import checks

DEADLINE_S = 30.0


def wait_for(predicate, what: str, timeout: float = DEADLINE_S, interval: float = 0.05):
    return checks.wait_for(predicate, what, timeout, interval)


class SecEnv:
    """The cluster, a root (cluster-token) client, and the tokens of the users added to it."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.config = load_toml(cluster.client_config_path, ClientConfig)
        self.root = Client.connect(self.config)
        self.tokens: dict[str, str] = {}
        self._clients: list[Client] = []

    def mgmtd_call(self, method: str, req, rsp_type):
        return self.root.run(self.root.aio.mgmtd.call(method, req, rsp_type))

    def add_user(self, name: str, uid: int) -> str:
        rsp = self.mgmtd_call("user_add", ms.UserReq(name, uid, uid), ms.UserTokenRsp)
        self.tokens[name] = rsp.token
        return rsp.token

    def config_with(self, token: str) -> ClientConfig:
        return ClientConfig(mgmtd=self.config.mgmtd, token=token, cluster_dir=self.config.cluster_dir)

    def client_as(self, name: str) -> Client:
        client = Client.connect(self.config_with(self.tokens[name]))
        self._clients.append(client)
        return client

    def addrs(self, node_type: str) -> list[str]:
        if node_type == ms.MGMTD:  # mgmtd is not in its own routing nodes: both come from the config
            return sorted(self.config.mgmtd)
        routing = self.root.run(self.root.aio.mgmtd.call("status", Empty(), ms.MgmtdStatusRsp)).routing
        return sorted(n.addr for n in routing.nodes.values() if n.type == node_type and n.alive)

    def pid_of_addr(self, addr: str) -> int:
        port = int(addr.rsplit(":", 1)[1])
        for name in self.cluster.running():
            if self.cluster.config_of(name).port == port:
                return self.cluster.pid_of(name)
        raise AssertionError(f"no service of ours listens on {addr}")

    def close(self) -> None:
        for c in self._clients:
            try:
                c.close()
            except Exception:  # a revoked user's client may fail to close cleanly
                pass
        self.root.close()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def frame(kind: int, rid: int, method: str = "", body=None, payload: bytes = b"",
          timeout_ms: int = 0) -> bytes:
    raw = msgspec.Raw(body if isinstance(body, (bytes, bytearray)) else body_encoder.encode(body))
    return encode_frame_head(Header(kind, rid, method=method, timeout_ms=timeout_ms, body=raw),
                             len(payload)) + payload


def hello_frame(token: str, client_id: str = "raw-client") -> bytes:
    return frame(KIND_HELLO, 1, "hello", Hello(token=token, client_id=client_id))


def request_frame(rid: int, method: str, body, timeout_ms: int = 5000, payload: bytes = b"") -> bytes:
    return frame(KIND_REQUEST, rid, method, body, payload, timeout_ms)


class RawConn:
    """A blocking socket that writes raw bytes and reads whole frames back (headers decoded)."""

    def __init__(self, addr: str, timeout: float = DEADLINE_S):
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.buf = bytearray()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self, n: int) -> bool:
        while len(self.buf) < n:
            data = self.sock.recv(1 << 16)
            if not data:
                return False
            self.buf += data
        return True

    def recv_frame(self) -> tuple[Header, bytes] | None:
        """The next frame, or None once the server closed the connection."""
        if not self._fill(PREFIX_BYTES):
            return None
        _magic, _flags, hlen, plen = PREFIX.unpack_from(self.buf)
        if not self._fill(PREFIX_BYTES + hlen + plen):
            return None
        header = msgspec.msgpack.decode(bytes(self.buf[PREFIX_BYTES:PREFIX_BYTES + hlen]), type=Header)
        payload = bytes(self.buf[PREFIX_BYTES + hlen:PREFIX_BYTES + hlen + plen])
        del self.buf[:PREFIX_BYTES + hlen + plen]
        return header, payload

    def closed_by_peer(self) -> bool:
        """Drain until EOF; True when the server closed the connection."""
        try:
            while self.sock.recv(1 << 16):
                pass
            return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    def authenticate(self, token: str, client_id: str = "raw-client") -> Header:
        self.send(hello_frame(token, client_id))
        got = self.recv_frame()
        assert got is not None, "server closed the connection during the hello"
        return got[0]

    def close(self) -> None:
        self.sock.close()
