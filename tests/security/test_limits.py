"""Limits on hostile input, each enforced with a clear error: names, paths, symlink depth, batch sizes,
frame size, requests in flight per connection, connections per client, the hello deadline, and memory
when a client floods a server without reading the answers."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading

import pytest
from sec_helpers import RawConn, request_frame, rss_bytes, wait_for

from threefs.common import limits
from threefs.common.status import StatusCode, ThreeFSError
from threefs.rpc.client import RpcClient
from threefs.rpc.frame import MAGIC, PREFIX
from threefs.rpc.schemas import meta as m
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas.common import Empty
from threefs.rpc.server import RpcServer, rpc, token_authenticator

TOKEN = "limits-token"


def oserror(fn, *args) -> OSError:
    with pytest.raises(OSError) as ei:
        fn(*args)
    return ei.value


def test_name_and_path_lengths(sec):
    fs = sec.root
    fs.mkdir("/lim", exist_ok=True)
    fs.mkdir("/lim/" + "n" * limits.NAME_BYTES_MAX)
    e = oserror(fs.mkdir, "/lim/" + "n" * (limits.NAME_BYTES_MAX + 1))
    assert e.errno == errno.ENAMETOOLONG and str(limits.NAME_BYTES_MAX) in str(e)
    e = oserror(fs.mkdir, "/lim/" + "é" * 128)  # 256 bytes in UTF-8: the limit counts bytes
    assert e.errno == errno.ENAMETOOLONG
    deep = "/lim" + "/d" * (limits.PATH_BYTES_MAX // 2)
    e = oserror(fs.mkdir, deep, 0o755, True)
    assert e.errno == errno.ENAMETOOLONG and str(limits.PATH_BYTES_MAX) in str(e)
    e = oserror(fs.symlink, "t" * (limits.PATH_BYTES_MAX + 1), "/lim/longlink")
    assert e.errno == errno.ENAMETOOLONG
    assert fs.listdir("/lim") == ["n" * limits.NAME_BYTES_MAX]


def test_odd_names_are_rejected_or_handled_as_posix(sec):
    fs = sec.root
    fs.mkdir("/odd", exist_ok=True)
    assert oserror(fs.mkdir, "/odd/a\x00b").errno == errno.EINVAL  # Linux: the kernel refuses NUL
    assert oserror(fs.mkdir, "/odd/..").errno == errno.EEXIST
    assert oserror(fs.mkdir, "/odd/.").errno == errno.EEXIST
    assert oserror(fs.mkdir, "").errno in (errno.ENOENT, errno.EINVAL)
    fs.mkdir("/odd//x/")  # '//' collapses and a trailing '/' is allowed for a directory
    assert fs.stat("/odd/x/../x/./").type == m.DIRECTORY
    assert oserror(fs.write_bytes, "/odd/x/", b"").errno in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST)
    assert fs.listdir("/odd") == ["x"]


def test_invalid_utf8_in_a_request_is_refused(sec):
    """msgpack str must be UTF-8: a raw body with a bad byte sequence is INVALID_ARGUMENT, not a crash."""
    addr = sec.addrs(ms.META)[0]
    conn = RawConn(addr)
    try:
        assert conn.authenticate(sec.config.token).status == 0
        body = b"\x81\xa4path\xa4/\xff\xfe!"  # {"path": <4 bytes that are not UTF-8>}
        conn.send(request_frame(2, "meta.mkdir", body))
        header, _ = conn.recv_frame()
        assert header.status == StatusCode.INVALID_ARGUMENT and "bad meta.mkdir request" in header.message
    finally:
        conn.close()


def test_symlink_depth(sec):
    fs = sec.root
    fs.mkdir("/links", exist_ok=True)
    fs.write_bytes("/links/target", b"t")
    prev = "/links/target"
    for i in range(limits.SYMLINK_FOLLOW_MAX + 1):
        fs.symlink(prev, f"/links/l{i}")
        prev = f"/links/l{i}"
    assert fs.read_bytes(f"/links/l{limits.SYMLINK_FOLLOW_MAX - 1}") == b"t"
    e = oserror(fs.read_bytes, f"/links/l{limits.SYMLINK_FOLLOW_MAX}")
    assert e.errno == errno.ELOOP and "symbolic links" in str(e)
    fs.symlink("/links/loop-b", "/links/loop-a")
    fs.symlink("/links/loop-a", "/links/loop-b")
    assert oserror(fs.stat, "/links/loop-a").errno == errno.ELOOP


def test_batch_stat_size_is_capped(sec):
    """meta refuses a bigger batch than BATCH_STAT_MAX; the client splits a long list into such batches."""
    n = limits.BATCH_STAT_MAX + 1
    req = m.BatchStatReq([m.PathAt(m.NO_PARENT, "/")] * n, True, None)
    e = oserror(sec.root.run, sec.root.aio.meta_call("batch_stat", req, m.BatchStatRsp))
    assert str(limits.BATCH_STAT_MAX) in str(e)
    attrs = sec.root.batch_stat(["/"] * (2 * n))
    assert len(attrs) == 2 * n and all(a.type == m.DIRECTORY for a in attrs)


def test_storage_batch_read_size_is_capped(sec):
    """A read length is a buffer the server allocates: each IO is at most a chunk, a batch one frame."""
    from threefs.rpc.schemas import storage as ss

    addr = sec.addrs(ms.STORAGE)[0]
    rpc = RpcClient(sec.config.token)
    cases = [[ss.ReadIO(1, 1, bytes(16), 0, 1 << 40)], [ss.ReadIO(1, 1, bytes(16), -1, 10)],
             [ss.ReadIO(1, 1, bytes(16), 0, limits.CHUNK_SIZE_BYTES_MAX)] * 2]
    try:
        for ios in cases:
            with pytest.raises(ThreeFSError) as ei:
                sec.root.run(rpc.call(addr, "storage.batch_read", ss.BatchReadReq(ios), ss.BatchReadRsp))
            assert ei.value.code == StatusCode.INVALID_ARGUMENT
            assert "out of range" in ei.value.message or "split it" in ei.value.message
    finally:
        sec.root.run(rpc.close())
    assert sec.root.stat("/").type == m.DIRECTORY


def test_oversized_frame_closes_only_that_connection(sec):
    for addr in sec.addrs(ms.META) + sec.addrs(ms.STORAGE) + sec.addrs(ms.MGMTD):
        conn = RawConn(addr)
        assert conn.authenticate(sec.config.token).status == 0
        conn.send(PREFIX.pack(MAGIC, 0, limits.FRAME_HEADER_BYTES_MAX + 1, 0))
        header, _ = conn.recv_frame()
        assert header.rid == 0 and header.status == StatusCode.FRAME_TOO_LARGE
        assert str(limits.FRAME_HEADER_BYTES_MAX) in header.message
        assert conn.closed_by_peer()
        conn.close()
    assert sec.root.stat("/").type == m.DIRECTORY


def test_connections_per_client_are_capped(sec):
    addr = sec.addrs(ms.META)[0]
    conns = []
    try:
        for _ in range(limits.CONNECTIONS_PER_CLIENT_MAX):
            conns.append(RawConn(addr))
            assert conns[-1].authenticate(sec.config.token, "greedy").status == 0
        extra = RawConn(addr)
        header = extra.authenticate(sec.config.token, "greedy")
        assert header.status == StatusCode.TOO_MANY_REQUESTS
        assert f"limit {limits.CONNECTIONS_PER_CLIENT_MAX}" in header.message
        assert extra.closed_by_peer()
        extra.close()
        other = RawConn(addr)  # another client is not affected
        assert other.authenticate(sec.config.token, "modest").status == 0
        other.close()
    finally:
        for c in conns:
            c.close()

    def slot_free() -> bool:  # closed connections free their slots (once the server saw the close)
        conn = RawConn(addr)
        try:
            return conn.authenticate(sec.config.token, "greedy").status == 0
        finally:
            conn.close()

    wait_for(slot_free, "a slot for client 'greedy' after it closed its connections")


class Slow:
    @rpc(Empty)
    async def wait(self, ctx, req):
        await asyncio.sleep(1.0)
        return Empty()


async def _slow_server(**kw):
    server = RpcServer("slow", token_authenticator(TOKEN), **kw)
    server.add_service("slow", Slow())
    port = await server.start("127.0.0.1", 0)
    return server, f"127.0.0.1:{port}"


def test_inflight_requests_per_connection_are_capped():
    async def main():
        server, addr = await _slow_server(inflight_max=64)
        client = RpcClient(TOKEN)
        try:
            results = await asyncio.gather(*(client.call(addr, "slow.wait", Empty(), Empty, timeout=20)
                                             for _ in range(100)), return_exceptions=True)
            refused = [r for r in results if isinstance(r, ThreeFSError)]
            assert len(refused) == 36 and all(r.code == StatusCode.TOO_MANY_REQUESTS for r in refused)
            assert "more than 64 requests in flight" in refused[0].message
            assert sum(isinstance(r, tuple) for r in results) == 64
        finally:
            await client.close()
            await server.stop()

    asyncio.run(main())


def test_connection_without_hello_is_closed_after_the_deadline(monkeypatch):
    monkeypatch.setattr(limits, "HELLO_TIMEOUT_S", 0.3)

    async def main():
        server, addr = await _slow_server()
        host, port = addr.split(":")
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
            data = await asyncio.wait_for(reader.read(), 20)  # EOF once the server gives up on us
            assert b"no hello within" in data
            writer.close()
        finally:
            await server.stop()

    asyncio.run(main())


def _flood(sock: socket.socket, frames: bytes, sent: list[int]) -> None:
    """Write until done or the server stops reading (a send blocks for the socket timeout)."""
    view = memoryview(frames)
    try:
        while sent[0] < len(view):
            sent[0] += sock.send(view[sent[0]:sent[0] + (1 << 16)])
    except (socket.timeout, OSError):
        pass


@pytest.mark.parametrize("node_type", [ms.META, ms.STORAGE])
def test_flood_without_reading_keeps_server_memory_bounded(sec, node_type):
    """A client that pipelines 200k requests and never reads: the server stops reading it (TCP
    back-pressure) once 2x the in-flight cap is queued, so its memory stays bounded; others are served."""
    addr = sec.addrs(node_type)[0]
    pid = sec.pid_of_addr(addr)
    method, body = {ms.META: ("meta.stat", m.StatReq("/")),
                    ms.STORAGE: ("storage.status", Empty())}[node_type]
    one = request_frame(0, method, body)
    n = 200_000
    frames = b"".join(request_frame(rid, method, body) for rid in range(2, n + 2))
    before = rss_bytes(pid)
    conn = RawConn(addr)
    assert conn.authenticate(sec.config.token).status == 0
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # we read nothing anyway
    conn.sock.settimeout(3.0)
    sent = [0]
    writer = threading.Thread(target=_flood, args=(conn.sock, frames, sent))
    writer.start()
    writer.join(120)
    peak = rss_bytes(pid)
    grown = peak - before
    print(f"\nMEASURED flood of {node_type}: {sent[0] // len(one)} of {n} requests accepted by TCP, "
          f"RSS {before >> 20} -> {peak >> 20} MiB")
    assert sent[0] < len(frames), "the server read everything: no back-pressure"
    assert grown < 96 << 20, f"server RSS grew by {grown >> 20} MiB under a flood"
    assert sec.root.stat("/").type == m.DIRECTORY  # others keep being served
    conn.close()
