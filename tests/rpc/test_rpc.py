"""RPC layer: real sockets (Unix and loopback TCP: tests/rpc/conftest.py), real framing, real token check."""

import asyncio

import msgspec
import pytest

from threefs.common import limits
from threefs.common.status import NotFoundError, StatusCode, ThreeFSError
from threefs.rpc.client import RpcClient
from threefs.rpc.frame import MAGIC, PREFIX
from threefs.rpc.server import CallContext, RpcServer, rpc, token_authenticator

TOKEN = "s3cret-token"


class EchoReq(msgspec.Struct):
    text: str
    delay_s: float = 0.0
    fail: int = 0


class EchoRsp(msgspec.Struct):
    text: str
    payload_len: int


class Echo:
    @rpc(EchoReq)
    async def echo(self, ctx: CallContext, req: EchoReq):
        if req.delay_s:
            await asyncio.sleep(req.delay_s)
        if req.fail:
            raise NotFoundError(StatusCode.NOT_FOUND, f"no such thing: {req.text}")
        n = len(ctx.payload) if ctx.payload is not None else 0
        out = bytes(ctx.payload) if n else None
        return EchoRsp(req.text, n), out

    @rpc(EchoReq)
    async def crash(self, ctx, req):
        raise ValueError("boom")


async def _server():
    server = RpcServer("echo", token_authenticator(TOKEN))
    server.add_service("echo", Echo())
    port = await server.start("127.0.0.1", 0)
    return server, f"127.0.0.1:{port}"


def run(coro):
    return asyncio.run(coro)


def test_round_trip_concurrent_and_payloads():
    async def main():
        server, addr = await _server()
        client = RpcClient(TOKEN)
        try:
            sizes = [0, 1, 1000, 300_000, 4 * 1024 * 1024]
            bufs = [bytearray(s) for s in sizes]
            async def one(i, s):
                data = bytes((i + j) % 251 for j in range(min(s, 1000))) * (s // 1000 + 1)
                data = data[:s]
                rsp, out = await client.call(addr, "echo.echo", EchoReq(f"m{i}"), EchoRsp,
                                             payload=data if s else None, recv_into=bufs[i])
                assert rsp.text == f"m{i}" and rsp.payload_len == s
                if s:
                    assert bytes(out) == data
                    assert bytes(bufs[i]) == data  # landed in the caller's buffer
            await asyncio.gather(*(one(i, s) for i, s in enumerate(sizes)))
            # many concurrent calls on one connection
            rs = await asyncio.gather(*(client.call(addr, "echo.echo", EchoReq(str(i)), EchoRsp)
                                        for i in range(500)))
            assert [r.text for r, _ in rs] == [str(i) for i in range(500)]
        finally:
            await client.close()
            await server.stop()
    run(main())


def test_errors_are_typed_and_server_keeps_serving():
    async def main():
        server, addr = await _server()
        client = RpcClient(TOKEN)
        try:
            with pytest.raises(FileNotFoundError) as ei:
                await client.call(addr, "echo.echo", EchoReq("x", fail=1), EchoRsp)
            assert "no such thing: x" in str(ei.value)
            with pytest.raises(ThreeFSError) as ei:
                await client.call(addr, "echo.crash", EchoReq("x"), EchoRsp)
            assert ei.value.code == StatusCode.INTERNAL and "boom" in str(ei.value)
            with pytest.raises(ThreeFSError) as ei:
                await client.call(addr, "echo.nope", EchoReq("x"), EchoRsp)
            assert ei.value.code == StatusCode.UNKNOWN_METHOD
            with pytest.raises(ThreeFSError) as ei:
                await client.call(addr, "echo.echo", EmptyBad(3), EchoRsp)
            assert ei.value.code == StatusCode.INVALID_ARGUMENT
            with pytest.raises(ThreeFSError) as ei:
                await client.call(addr, "echo.echo", EchoReq("slow", delay_s=2), EchoRsp, timeout=0.2)
            assert ei.value.code == StatusCode.TIMEOUT
            rsp, _ = await client.call(addr, "echo.echo", EchoReq("still here"), EchoRsp)
            assert rsp.text == "still here"
        finally:
            await client.close()
            await server.stop()
    run(main())


class EmptyBad(msgspec.Struct):
    text: int


def test_wrong_token_refused_and_oversized_frame_rejected():
    async def main():
        server, addr = await _server()
        try:
            bad = RpcClient("wrong")
            with pytest.raises(ThreeFSError) as ei:
                await bad.call(addr, "echo.echo", EchoReq("x"), EchoRsp)
            assert ei.value.code == StatusCode.AUTH_FAILED
            await bad.close()
            # A raw client that authenticates, then sends a frame claiming a huge payload.
            good = RpcClient(TOKEN)
            conn = await good.connection(addr)
            conn.transport.write(PREFIX.pack(MAGIC, 0, 10, limits.FRAME_PAYLOAD_BYTES_MAX + 1))
            with pytest.raises(ThreeFSError) as ei:
                await good.call(addr, "echo.echo", EchoReq("x", delay_s=5), EchoRsp, timeout=3)
            assert ei.value.code in (StatusCode.FRAME_TOO_LARGE, StatusCode.UNAVAILABLE)
            await good.close()
            # client-side check before sending
            other = RpcClient(TOKEN)
            with pytest.raises(ThreeFSError) as ei:
                await other.call(addr, "echo.echo", EchoReq("x"), EchoRsp,
                                 payload=bytearray(limits.FRAME_PAYLOAD_BYTES_MAX + 1))
            assert ei.value.code == StatusCode.FRAME_TOO_LARGE
            rsp, _ = await other.call(addr, "echo.echo", EchoReq("alive"), EchoRsp)
            assert rsp.text == "alive"
            await other.close()
        finally:
            await server.stop()
    run(main())


def test_garbage_bytes_close_only_that_connection():
    async def main():
        server, addr = await _server()
        host, port = addr.split(":")
        try:
            r, w = await asyncio.open_connection(host, int(port))
            w.write(b"GET / HTTP/1.1\r\n\r\n" * 4)
            await w.drain()
            data = await asyncio.wait_for(r.read(), 5)  # server closes after telling us why
            assert len(data) >= PREFIX.size
            w.close()
            client = RpcClient(TOKEN)
            rsp, _ = await client.call(addr, "echo.echo", EchoReq("ok"), EchoRsp)
            assert rsp.text == "ok"
            await client.close()
        finally:
            await server.stop()
    run(main())


def test_concurrent_payloads_on_one_connection_under_uvloop():
    """Regression: a header's msgspec.Raw body once pointed into the reused scratch buffer."""
    import random

    import uvloop

    rng = random.Random(7)
    datas = [rng.randbytes(rng.choice([1 << 20, 805696, 70000, 10])) for _ in range(24)]

    async def main():
        server, addr = await _server()
        client = RpcClient(TOKEN)
        try:
            async def one(i):
                buf = bytearray(len(datas[i]))
                rsp, out = await client.call(addr, "echo.echo", EchoReq("x" * rng.randrange(0, 2000)),
                                             EchoRsp, payload=memoryview(datas[i]), recv_into=buf)
                return bytes(out) == datas[i] and rsp.payload_len == len(datas[i])
            for _ in range(4):
                assert all(await asyncio.gather(*(one(i) for i in range(len(datas)))))
        finally:
            await client.close()
            await server.stop()

    uvloop.run(main())


def test_frame_reader_handles_any_fragmentation():
    import random

    from threefs.rpc.frame import FrameReader, Header, body_encoder, encode_frame_head

    rng = random.Random(1)
    frames, stream = [], bytearray()
    for i in range(200):
        plen = rng.choice([0, 1, 100, 70000, 300000, 1 << 20])
        payload = rng.randbytes(plen)
        body = msgspec.Raw(body_encoder.encode({"pad": "y" * rng.randrange(0, 3000)}))
        stream += encode_frame_head(Header(0, i, method="m", body=body), plen) + payload
        frames.append((i, payload))
    got = []
    reader = FrameReader(lambda h, p: got.append((h.rid, bytes(p) if p is not None else b"")),
                         lambda h, n: memoryview(bytearray(n)))
    pos = 0
    while pos < len(stream):
        buf = reader.get_buffer(-1)
        n = min(len(buf), rng.choice([1, 7, 100, 4096, 65536, 1 << 22]), len(stream) - pos)
        buf[:n] = stream[pos:pos + n]
        pos += n
        reader.buffer_updated(n)
    assert got == frames


class Big:
    """A handler that asks for a transmission token before sending its payload (request-to-send)."""

    def __init__(self):
        self.sending = 0
        self.sending_max = 0

    @rpc(EchoReq)
    async def fetch(self, ctx: CallContext, req: EchoReq):
        await ctx.request_to_send(ctx.rid, 5.0)
        self.sending += 1
        self.sending_max = max(self.sending_max, self.sending)
        await asyncio.sleep(0.01)  # the "transmission"
        self.sending -= 1
        return EchoRsp(req.text, 0), b"x" * 100_000


def test_request_to_send_caps_concurrent_senders():
    async def main():
        big = Big()
        server = RpcServer("big", token_authenticator(TOKEN))
        server.add_service("big", big)
        addr = f"127.0.0.1:{await server.start('127.0.0.1', 0)}"
        client = RpcClient(TOKEN, senders_max=2)
        try:
            outs = await asyncio.gather(*(client.call(addr, "big.fetch", EchoReq(str(i)), EchoRsp)
                                          for i in range(20)))
            assert all(bytes(p) == b"x" * 100_000 for _, p in outs)
            assert big.sending_max <= 2
            assert client.senders._value == 2  # every token came back
        finally:
            await client.close()
            await server.stop()

    asyncio.run(main())


def test_a_peer_of_another_protocol_version_gets_a_clear_error(monkeypatch):
    """PROTOCOL_VERSION is checked at hello, both ways: the server refuses a client of another version,
    and a client refuses a server of another version, each naming both versions."""
    import threefs.rpc.client as rpc_client
    from threefs.rpc.schemas.common import PROTOCOL_VERSION, Hello, HelloRsp

    class FutureHello(Hello):  # what a newer client would send
        pass

    async def main():
        server, addr = await _server()
        try:
            monkeypatch.setattr(rpc_client, "Hello",
                                lambda **kw: FutureHello(**kw, protocol=PROTOCOL_VERSION + 1))
            client = RpcClient(TOKEN)
            with pytest.raises(ThreeFSError) as e:
                await client.call(addr, "echo.echo", EchoReq("x"), EchoRsp)
            assert e.value.code == StatusCode.PROTOCOL_ERROR
            assert f"protocol {PROTOCOL_VERSION}, this peer {PROTOCOL_VERSION + 1}" in e.value.message
            await client.close()
            monkeypatch.undo()
            import threefs.rpc.server as rpc_server  # an older server answering hello
            monkeypatch.setattr(rpc_server, "HelloRsp",
                                lambda service: HelloRsp(service=service, protocol=PROTOCOL_VERSION - 1))
            client = RpcClient(TOKEN)
            with pytest.raises(ThreeFSError) as e:
                await client.call(addr, "echo.echo", EchoReq("x"), EchoRsp)
            assert e.value.code == StatusCode.PROTOCOL_ERROR and "run the same threefs version" in e.value.message
            await client.close()
        finally:
            await server.stop()

    run(main())


def test_frame_reader_scatters_a_payload_over_its_parts_and_digests_each():
    """A Scatter destination: the payload lands in its parts in order whatever the fragmentation (bytes
    already buffered with the header included), each part digested as it fills; a trimmed payload (head)
    fills a prefix; a diverted receive (the caller gave up) writes nothing more into the parts."""
    import random
    import zlib

    from threefs.rpc.frame import FrameReader, Header, Scatter, encode_frame_head

    rng = random.Random(2)
    diverted_midway = 0
    for trial in range(90):
        sizes = [rng.choice([1, 63, 4096, 65536, 70001]) for _ in range(rng.randrange(1, 8))]
        parts = [memoryview(bytearray(b"\xab" * n)) for n in sizes]
        scatter = Scatter(parts, zlib.crc32)
        plen = rng.choice([len(scatter), len(scatter), max(1, len(scatter) - rng.randrange(0, 70000))])
        payload = rng.randbytes(plen)
        stream = encode_frame_head(Header(1, 7, method="m"), plen) + payload
        head = len(stream) - plen
        got = []
        reader = FrameReader(lambda h, p: got.append(p), lambda h, n: scatter.head(n))
        divert_at = rng.randrange(head, len(stream)) if trial % 3 == 0 else None
        landed = None  # payload bytes in the parts when the caller gave up midway
        pos = 0
        while pos < len(stream):
            if divert_at is not None and pos == divert_at:
                if reader._direct is not None:  # the payload is being received
                    landed = pos - head
                reader.divert(7)
                divert_at = None
            buf = reader.get_buffer(-1)
            n = min(len(buf), rng.choice([1, 7, 100, 4096, 65536, 1 << 20]), len(stream) - pos)
            if divert_at is not None and pos < divert_at:
                n = min(n, divert_at - pos)
            buf[:n] = stream[pos:pos + n]
            pos += n
            reader.buffer_updated(n)
        assert len(got) == 1
        flat = b"".join(bytes(p) for p in parts)
        if landed is not None:
            diverted_midway += 1
            assert type(got[0]) is not Scatter
            assert flat[:landed] == payload[:landed] and flat[landed:] == b"\xab" * (len(flat) - landed)
            continue
        assert type(got[0]) is Scatter and len(got[0]) == plen
        assert flat[:plen] == payload and flat[plen:] == b"\xab" * (len(scatter) - plen)
        full, at = [], 0
        for n in sizes:
            if at < plen:  # (the last part of a trimmed payload: as much of it as was received)
                full.append(zlib.crc32(payload[at:min(at + n, plen)]))
            at += n
        assert got[0].digests == full
    assert diverted_midway >= 10
