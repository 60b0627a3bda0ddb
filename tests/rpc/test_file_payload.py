"""File-backed response payloads (rpc/frame.py FilePayload: os.sendfile from a file to the socket), over both
transports (tests/rpc/conftest.py): the bytes arrive whole and in order whether the send went out inline (bytes
the sender knows are in the page cache), in a thread, or began inline and was finished by the thread; and a
same-host server's Unix socket has the send buffer that lets a 1 MiB chunk go out in one inline sendfile."""

from __future__ import annotations

import asyncio
import os
import random
import socket

import msgspec
import pytest

from threefs.common import limits
from threefs.rpc import frame
from threefs.rpc.client import RpcClient
from threefs.rpc.frame import FilePayload
from threefs.rpc.server import UNIX_SEND_BUFFER_BYTES, CallContext, RpcServer, rpc, token_authenticator
from tests.rpc.test_rpc import TOKEN

MiB = limits.MiB


class FileReq(msgspec.Struct):
    offset: int
    count: int
    cached: bool


class FileRsp(msgspec.Struct):
    count: int


class PartsReq(msgspec.Struct):
    parts: list  # [offset, count] of the file, or [-1, n]: n bytes of 0xEE
    cached: bool


class Files:
    def __init__(self, fd: int):
        self.fd = fd

    @rpc(FileReq)
    async def read(self, ctx: CallContext, req: FileReq):
        return FileRsp(req.count), FilePayload(self.fd, req.offset, req.count, 30.0, cached=req.cached)

    @rpc(PartsReq)
    async def parts(self, ctx: CallContext, req: PartsReq):
        parts = [(self.fd, o, n) if o >= 0 else b"\xee" * n for o, n in req.parts]
        payload = FilePayload.of_parts(parts, 30.0, cached=req.cached)
        return FileRsp(len(payload)), payload


def _want(data: bytes, parts: list) -> bytes:
    return b"".join(data[o:o + n] if o >= 0 else b"\xee" * n for o, n in parts)


def _wmem_max() -> int:
    with open("/proc/sys/net/core/wmem_max") as f:
        return int(f.read())


@pytest.fixture
def data_file(tmp_path):
    data = random.Random(15).randbytes(12 * MiB + 4321)
    path = tmp_path / "data"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    os.pread(fd, len(data), 0)  # in the page cache, as the storage service's check would find it
    yield fd, data
    os.close(fd)


def test_file_payloads_arrive_whole_and_in_order(data_file, monkeypatch, transport):
    fd, data = data_file
    threaded = []
    real = frame._send_blocking

    def counting(sock_fd, parts, deadline_s):  # what the thread sends: file bytes, buffer bytes
        threaded.append(sum(p[2] if type(p) is tuple else len(p) for p in parts))
        return real(sock_fd, parts, deadline_s)

    monkeypatch.setattr(frame, "_send_blocking", counting)

    async def main():
        server = RpcServer("files", token_authenticator(TOKEN))
        server.add_service("files", Files(fd))
        port = await server.start("127.0.0.1", 0)
        client = RpcClient(TOKEN)
        addr = f"127.0.0.1:{port}"
        try:
            # cached 1 MiB: inline where the send buffer holds it (a Unix socket here, see below)
            del threaded[:]
            rsp, out = await client.call(addr, "files.read", FileReq(MiB, MiB, True), FileRsp)
            assert rsp.count == MiB and bytes(out) == data[MiB:2 * MiB]
            sock = next(iter(server.connections)).transport.get_extra_info("socket")
            if sock.family == socket.AF_UNIX:
                # Linux doubles the value asked for and caps it at twice net.core.wmem_max
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 2 * min(UNIX_SEND_BUFFER_BYTES,
                                                                                       _wmem_max())
                if _wmem_max() >= 2 * MiB:
                    assert threaded == [], "a cached 1 MiB chunk went to the send thread"
            # more than any send buffer holds: begun inline, finished by the thread (the rest of the range)
            del threaded[:]
            rsp, out = await client.call(addr, "files.read", FileReq(7, len(data) - 7, True), FileRsp)
            assert bytes(out) == data[7:]
            assert threaded and 0 < threaded[0] < len(data) - 7
            # not known to be cached: all of it from the thread
            del threaded[:]
            rsp, out = await client.call(addr, "files.read", FileReq(3, 5 * MiB, False), FileRsp)
            assert bytes(out) == data[3:3 + 5 * MiB] and len(threaded) == 1 and threaded[0] > 5 * MiB  # (+ head)
            # many at once on one connection: each response whole, each to its own call
            spots = [(random.Random(k).randrange(0, len(data) - 2 * MiB), (k % 4) * MiB // 2 + 1000 * k)
                     for k in range(12)]
            outs = await asyncio.gather(*(client.call(addr, "files.read", FileReq(o, n, k % 2 == 0), FileRsp)
                                          for k, (o, n) in enumerate(spots)))
            for (o, n), (rsp, out) in zip(spots, outs):
                assert rsp.count == n and bytes(out if out is not None else b"") == data[o:o + n]
            # several parts in a row, file regions and buffers: small (all inline), and more than the socket
            # holds (the rest in the thread, from wherever the inline send stopped: a region or a buffer)
            rng = random.Random(16)
            for cached in (True, False, True):
                for top in (64 * 1024, 3 * MiB):
                    parts = [[rng.randrange(0, len(data) - top), rng.randrange(1, top)] if k % 3 else
                             [-1, rng.randrange(1, top)] for k in range(9)]
                    rsp, out = await client.call(addr, "files.parts", PartsReq(parts, cached), FileRsp)
                    assert bytes(out) == _want(data, parts) and rsp.count == len(out)
            del threaded[:]
            parts = [[0, MiB], [-1, 4096], [MiB, MiB]]
            rsp, out = await client.call(addr, "files.parts", PartsReq(parts, True), FileRsp)
            assert bytes(out) == _want(data, parts)
            if sock.family == socket.AF_UNIX and _wmem_max() >= 4 * MiB:
                assert threaded == [], "2 MiB of cached parts went to the send thread"
        finally:
            await client.close()
            await server.stop()

    asyncio.run(main())
