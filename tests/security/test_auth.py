"""Authentication through real processes: no RPC is served before a valid token, and nothing changes.

Already covered elsewhere (not repeated): a wrong token refused by RpcClient (tests/rpc), a user token may
not administer and a revoked token stops working for meta and new storage connections
(tests/e2e/test_mgmtd_admin.py). Here: raw sockets that skip or abuse the handshake, against every
service type, with a check that no state changed; and that an open connection of a revoked token is closed.
"""

from __future__ import annotations

import pytest
from sec_helpers import RawConn, hello_frame, request_frame, wait_for

from threefs.common.status import PermissionError_, StatusCode
from threefs.rpc.frame import KIND_HELLO, KIND_RESPONSE
from threefs.rpc.schemas import meta as m
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.rpc.schemas.common import Empty


def _mutations(sec) -> dict[str, tuple[str, object]]:
    """One state-changing request per service type, and the check that it did not happen."""
    return {
        ms.MGMTD: ("mgmtd.user_add", ms.UserReq("mallory", 666, 666)),
        ms.META: ("meta.mkdir", m.MkdirReq("/unauth-made-this", 0o777)),
        ms.STORAGE: ("storage.status", Empty()),
    }


def _nothing_changed(sec) -> None:
    users = sec.mgmtd_call("user_list", Empty(), ms.UserListRsp).users
    assert "mallory" not in [u.name for u in users]
    assert not sec.root.exists("/unauth-made-this")


def _refused(conn: RawConn) -> str:
    """The server answers AUTH_FAILED (and nothing else) and closes; returns its message."""
    got = conn.recv_frame()
    assert got is not None, "the server closed without saying why"
    header, _ = got
    assert header.status == StatusCode.AUTH_FAILED, header
    assert header.kind in (KIND_HELLO, KIND_RESPONSE) and bytes(header.body) == b"\xc0"  # no response body
    assert "authentication" in header.message or "token" in header.message
    assert conn.recv_frame() is None  # and closed the connection
    return header.message


@pytest.mark.parametrize("node_type", [ms.MGMTD, ms.META, ms.STORAGE])
def test_request_without_hello_is_refused_and_not_served(sec, node_type):
    method, body = _mutations(sec)[node_type]
    for addr in sec.addrs(node_type):
        conn = RawConn(addr)
        conn.send(request_frame(1, method, body))
        message = _refused(conn)
        assert "missing or invalid token" in message
        conn.close()
    _nothing_changed(sec)


@pytest.mark.parametrize("node_type", [ms.MGMTD, ms.META, ms.STORAGE])
def test_wrong_token_with_pipelined_requests_serves_nothing(sec, node_type):
    """A client that sends its requests right behind a bad hello (not waiting for the answer)."""
    method, body = _mutations(sec)[node_type]
    wrong = "f" * 64  # right shape, not a token anybody was given
    for addr in sec.addrs(node_type):
        conn = RawConn(addr)
        conn.send(hello_frame(wrong) + b"".join(request_frame(rid, method, body) for rid in range(2, 50)))
        _refused(conn)
        conn.close()
    _nothing_changed(sec)


def test_payload_before_hello_is_refused_without_allocating(sec):
    """A frame announcing 64 MiB of payload before any hello: refused at once, the bytes never buffered."""
    for addr in sec.addrs(ms.STORAGE):
        conn = RawConn(addr)
        conn.send(request_frame(1, "storage.update", Empty(), payload=b"x" * 4096)[:-4096])
        got = conn.recv_frame()
        assert got is not None and got[0].status == StatusCode.AUTH_FAILED
        assert "before authentication" in got[0].message
        assert conn.closed_by_peer()
        conn.close()


def test_empty_and_huge_tokens_are_refused(sec):
    addr = sec.addrs(ms.META)[0]
    for token in ["", "x" * 100_000, sec.tokens["alice"][:-1], sec.tokens["alice"].upper()]:
        conn = RawConn(addr)
        conn.send(hello_frame(token))
        _refused(conn)
        conn.close()


def test_revoked_token_open_connections_are_closed(sec):
    """Connections that authenticated before the revocation are closed by every service within one
    routing refresh, and a retry of a mutation on a new connection is refused and changes nothing."""
    sec.root.mkdir("/revoke", 0o777, exist_ok=True)
    token = sec.add_user("carol", 3000)
    carol = sec.client_as("carol")
    carol.mkdir("/revoke/by-carol")
    conns = []
    for node_type in (ms.META, ms.STORAGE):
        for addr in sec.addrs(node_type):
            conn = RawConn(addr)
            assert conn.authenticate(token, client_id=f"carol-raw-{len(conns)}").status == 0
            conns.append(conn)
    sec.mgmtd_call("user_revoke", ms.UserReq("carol"), ms.OkRsp)
    for conn in conns:
        assert conn.closed_by_peer()  # within the socket timeout (30 s): one routing refresh is ~1 s
        conn.close()

    def carol_refused() -> bool:
        try:
            carol.mkdir("/revoke/after-revoke")
            return False
        except PermissionError_:
            return True

    wait_for(carol_refused, "carol's client to be refused")
    assert sec.root.listdir("/revoke") == ["by-carol"]
    for addr in sec.addrs(ms.META) + sec.addrs(ms.STORAGE):
        conn = RawConn(addr)
        conn.send(hello_frame(token))
        _refused(conn)
        conn.close()


def test_storage_refuses_chunk_io_without_a_valid_token(sec):
    """Chunk IO straight to storage (bypassing meta) needs a valid token too."""
    req = ss.BatchReadReq(ios=[])
    for addr in sec.addrs(ms.STORAGE):
        conn = RawConn(addr)
        conn.send(hello_frame("nope") + request_frame(2, "storage.batch_read", req))
        _refused(conn)
        conn.close()


def test_requests_pipelined_behind_a_valid_hello_are_refused(sec):
    """A client must wait for the hello's answer: frames sent before it are not queued unauthenticated
    (that would let anyone make the server buffer work before proving who it is)."""
    addr = sec.addrs(ms.META)[0]
    conn = RawConn(addr)
    conn.send(hello_frame(sec.config.token) + request_frame(2, "meta.mkdir", m.MkdirReq("/pipelined")))
    statuses = []
    while (got := conn.recv_frame()) is not None:
        statuses.append((got[0].rid, got[0].status, got[0].message))
    conn.close()
    assert (0, StatusCode.AUTH_FAILED, "request sent before authentication finished") in statuses
    assert not sec.root.exists("/pipelined")
