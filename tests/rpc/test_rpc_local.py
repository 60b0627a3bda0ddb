"""Same-host connections over Unix sockets (common/local_socket.py): which transport a client gets, and that the
server's Unix socket behaves as its TCP port does (same hello, same refusals, gone with the server)."""

import asyncio
import errno
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from threefs.common import local_socket as local
from threefs.common.net import free_port
from threefs.common.status import StatusCode, ThreeFSError, UnavailableError
from threefs.rpc.blocking import BlockingConnection, Broken
from threefs.rpc.client import RpcClient
from threefs.rpc.server import RpcServer, token_authenticator
from tests.rpc.test_rpc import TOKEN, Echo, EchoReq, EchoRsp

ROOT = str(Path(__file__).resolve().parents[2])


async def _server(host="127.0.0.1", port=0, **kw):
    server = RpcServer("echo", token_authenticator(TOKEN))
    server.add_service("echo", Echo())
    port = await server.start(host, port, **kw)
    return server, port


def _family(client: RpcClient, addr: str) -> int:
    return client._conns[addr].transport.get_extra_info("socket").family


def test_client_uses_unix_socket_of_same_host_server_and_tcp_when_told(transport):
    async def main():
        server, port = await _server()
        addr = f"127.0.0.1:{port}"
        assert server.local_addrs == [addr, f"localhost:{port}"]
        client = RpcClient(TOKEN)
        try:
            rsp, out = await client.call(addr, "echo.echo", EchoReq("hi"), EchoRsp, payload=b"x" * 300_000)
            assert rsp.text == "hi" and bytes(out) == b"x" * 300_000
            want = socket.AF_UNIX if transport == "unix" else socket.AF_INET
            assert _family(client, addr) == want
            # logs name the other side: the server's socket name / the client's process, or host:port
            peers = [c.peer for c in server.connections]
            if transport == "unix":
                assert client._conns[addr].peer == f"@threefs-rpc/{addr}"
                assert peers == [f"local pid {os.getpid()} (uid {os.getuid()})"]
            else:
                assert client._conns[addr].peer == addr and peers[0].startswith("127.0.0.1:")
            # "localhost" is one of the names the server holds: same transport, same server
            rsp, _ = await client.call(f"localhost:{port}", "echo.echo", EchoReq("lo"), EchoRsp)
            assert rsp.text == "lo" and _family(client, f"localhost:{port}") == want
        finally:
            await client.close()
            await server.stop()
    asyncio.run(main())


def test_server_without_local_socket_is_reached_over_tcp():
    async def main():
        server, port = await _server(local=False)
        addr = f"127.0.0.1:{port}"
        assert server.local_addrs == []
        assert local.connect_nonblocking(addr) is None  # nothing listens on the name: TCP
        client = RpcClient(TOKEN)
        try:
            rsp, _ = await client.call(addr, "echo.echo", EchoReq("tcp"), EchoRsp)
            assert rsp.text == "tcp" and _family(client, addr) == socket.AF_INET
        finally:
            await client.close()
            await server.stop()
    asyncio.run(main())


def test_wildcard_server_holds_loopback_and_local_advertised_names(monkeypatch):
    async def main():
        server, port = await _server("0.0.0.0", advertise_host="127.0.0.3")
        try:
            assert server.local_addrs == [f"0.0.0.0:{port}", f"127.0.0.1:{port}", f"localhost:{port}",
                                          f"127.0.0.3:{port}"]
            client = RpcClient(TOKEN)
            try:
                rsp, _ = await client.call(f"127.0.0.3:{port}", "echo.echo", EchoReq("adv"), EchoRsp)
                assert rsp.text == "adv" and _family(client, f"127.0.0.3:{port}") == socket.AF_UNIX
            finally:
                await client.close()
        finally:
            await server.stop()
        # an advertised address that is not this namespace's (NAT, a proxy elsewhere) gets no name
        server, port = await _server("0.0.0.0", advertise_host="192.0.2.7")
        try:
            assert f"192.0.2.7:{port}" not in server.local_addrs
        finally:
            await server.stop()
    monkeypatch.setenv(local.ENV, "1")
    asyncio.run(main())


def test_advertised_address_in_front_of_the_server_gets_no_name():
    """storage behind a proxy on 127.0.0.2 (tests/e2e/test_read_integrity.py): clients dialing the
    advertised address must go through the proxy, so the server holds no name for it."""
    async def main():
        server, port = await _server("127.0.0.1", advertise_host="127.0.0.2")
        try:
            assert server.local_addrs == [f"127.0.0.1:{port}", f"localhost:{port}"]
            assert local.connect_nonblocking(f"127.0.0.2:{port}") is None
        finally:
            await server.stop()
    asyncio.run(main())


def test_names_go_with_the_server():
    async def main():
        # a port below the ephemeral range: no outgoing connection takes it between the two servers
        server, port = await _server(port=free_port())
        addr = f"127.0.0.1:{port}"
        await server.stop()
        assert local.connect_nonblocking(addr) is None
        # a new server on the same port takes the names over at once (abstract names leave no file)
        again = RpcServer("echo", token_authenticator(TOKEN))
        again.add_service("echo", Echo())
        assert await again.start("127.0.0.1", port) == port
        try:
            conn = await asyncio.to_thread(BlockingConnection, addr, TOKEN, "c", 5.0)
            try:
                assert conn.sock.family == (socket.AF_UNIX if local.enabled() else socket.AF_INET)
            finally:
                conn.close()
        finally:
            await again.stop()
    asyncio.run(main())


def test_a_held_name_stops_the_server_from_starting():
    """Whoever holds a name gets the same-host clients of that address: a server whose name is taken does
    not start (as with a taken TCP port), and leaves neither its port nor any name bound."""
    async def main():
        port = free_port()  # below the ephemeral range: no outgoing connection takes it meanwhile
        squatter = socket.socket(socket.AF_UNIX)
        squatter.bind(local.name_of(f"localhost:{port}"))
        squatter.listen()
        try:
            server = RpcServer("echo", token_authenticator(TOKEN))
            with pytest.raises(OSError) as info:
                await server.start("127.0.0.1", port)
            assert info.value.errno == errno.EADDRINUSE and f"localhost:{port}" in str(info.value)
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # the TCP port was let go
            assert local.connect_nonblocking(f"127.0.0.1:{port}") is None  # and the first name too
        finally:
            squatter.close()
    asyncio.run(main())


def test_unix_socket_checks_token_as_tcp_does():
    async def main():
        server, port = await _server()
        addr = f"127.0.0.1:{port}"
        bad = RpcClient("wrong-token")
        try:
            with pytest.raises(ThreeFSError) as info:
                await bad.call(addr, "echo.echo", EchoReq("x"), EchoRsp)
            assert info.value.code == StatusCode.AUTH_FAILED
            with pytest.raises(ThreeFSError) as info:
                await asyncio.to_thread(BlockingConnection, addr, "wrong-token", "c", 5.0)
            assert info.value.code == StatusCode.AUTH_FAILED
        finally:
            await bad.close()
            await server.stop()
    asyncio.run(main())


def test_no_server_at_all_is_unavailable():
    async def main():
        port = free_port()  # below the ephemeral range: no outgoing connection takes it meanwhile
        client = RpcClient(TOKEN, connect_timeout=2.0)
        try:
            with pytest.raises(UnavailableError):
                await client.call(f"127.0.0.1:{port}", "echo.echo", EchoReq("x"), EchoRsp)
        finally:
            await client.close()
        with pytest.raises(Broken):
            BlockingConnection(f"127.0.0.1:{port}", TOKEN, "c", 2.0)
    asyncio.run(main())


def test_other_network_namespace_gets_tcp(tmp_path, monkeypatch):
    """A client in another network namespace (another "host") finds none of this namespace's names: it
    connects over TCP, so a cut or capped link between namespaces cuts or caps it too."""
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        pytest.skip("ip netns not available")
    monkeypatch.setenv(local.ENV, "1")  # both processes try their namespace's names first
    ns = f"t3fs-local-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        script = textwrap.dedent(f"""
            import asyncio, socket, sys
            sys.path.insert(0, {ROOT!r})
            from threefs.common import local_socket as local
            from tests.rpc.test_rpc_local import _server
            async def main():
                server, port = await _server()
                print(port, flush=True)
                sys.stdin.readline()
                await server.stop()
            asyncio.run(main())
        """)
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", script],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            # the server's names live in its namespace: not visible here
            assert local.connect_nonblocking(f"127.0.0.1:{port}") is None
            check = subprocess.run(
                ["ip", "netns", "exec", ns, sys.executable, "-c",
                 f"import sys; sys.path.insert(0, {ROOT!r}); from threefs.common import local_socket as local; "
                 f"print(local.connect_blocking('127.0.0.1:{port}', 2.0) is not None)"],
                capture_output=True, text=True, timeout=60)
            assert check.stdout.strip() == "True", check.stderr
        finally:
            proc.stdin.write("\n")
            proc.stdin.close()
            proc.wait(timeout=30)
    finally:
        subprocess.run(["ip", "netns", "del", ns])


def test_blocking_call_times_out_on_either_transport(transport):
    """The blocking client waits for an answer in poll() (after spinning, if it spins: rpc/blocking.py) on
    either transport: a server that does not answer in time is a Broken connection."""
    import msgspec

    from threefs.rpc.frame import KIND_REQUEST, body_encoder

    async def main():
        server, port = await _server()
        try:
            def call():
                conn = BlockingConnection(f"127.0.0.1:{port}", TOKEN, "slow", 0.3)
                try:
                    assert conn.sock.family == (socket.AF_UNIX if transport == "unix" else socket.AF_INET)
                    header = conn.exchange(KIND_REQUEST, "echo.echo", body_encoder.encode(EchoReq("fast")), 5.0)
                    assert msgspec.msgpack.decode(header.body, type=EchoRsp).text == "fast"
                    with pytest.raises(Broken, match="timed out"):
                        conn.exchange(KIND_REQUEST, "echo.echo", body_encoder.encode(EchoReq("slow", delay_s=2)),
                                      5.0)
                finally:
                    conn.close()
            await asyncio.to_thread(call)
        finally:
            await server.stop()
    asyncio.run(main())
