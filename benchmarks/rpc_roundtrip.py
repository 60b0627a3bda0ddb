"""Small-request round trips: threefs's RpcServer (uvloop, the services' dispatch) beside plain Python.

    .venv/bin/python benchmarks/rpc_roundtrip.py [--requests 20000] [--clients 1,8]

Each client is its own process with one blocking connection (`rpc/blocking.py`, what synchronous metadata
calls use) sending a small request and waiting for its answer, `--requests` times. Servers, one process each:
  threefs    RpcServer with a trivial handler (`async def echo(ctx, req): return Rsp(...)`), as every service
             runs it: hello/token check, frame parsing, dispatch, deadline, metrics hook, the reply
  plain      the same wire (16-byte prefix + msgpack header and body) served by a thread per connection with
             blocking sockets: read a frame, decode the header and body, encode the answer, sendall
Both servers listen on TCP and on the same-host Unix socket (threefs/common/local_socket.py): the client
reaches both the same way (Unix by default; THREEFS_RPC_LOCAL=0: TCP).
Printed: round trips per second, client CPU µs per call, server CPU µs per call (user + system, from /proc),
and threefs / plain. The machine is shared: compare within one run (docs/meta.md, "The request path").
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import msgspec  # noqa: E402

TOKEN = "roundtrip-token"


class Req(msgspec.Struct):
    path: str = ""
    request_id: int = 0


class Rsp(msgspec.Struct):
    x: int = 0
    name: str = ""


def _threefs_server(q) -> None:
    import uvloop

    from threefs.common.metrics import ServiceMetrics
    from threefs.rpc.server import RpcServer, rpc, token_authenticator

    class Echo:
        @rpc(Req)
        async def echo(self, ctx, req: Req) -> Rsp:
            return Rsp(1, req.path)

    async def main():
        server = RpcServer("bench", token_authenticator(TOKEN))
        server.add_service("b", Echo())
        server.metrics_hook = ServiceMetrics("bench").observe_rpc  # as threefs/server.py sets it
        q.put(await server.start("127.0.0.1", 0))
        await asyncio.Event().wait()

    uvloop.run(main())


def _plain_server(q) -> None:
    from threefs.rpc.frame import KIND_HELLO, KIND_RESPONSE, PREFIX, PREFIX_BYTES, Header, encode_frame_head
    from threefs.rpc.schemas.common import HelloRsp

    decode_header = msgspec.msgpack.Decoder(Header).decode
    decode_req = msgspec.msgpack.Decoder(Req).decode
    encode = msgspec.msgpack.Encoder().encode

    def serve(conn: socket.socket) -> None:
        if conn.family != socket.AF_UNIX:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(1 << 16)
        view = memoryview(buf)
        start = end = 0
        while True:
            while (end - start < PREFIX_BYTES
                   or end - start < PREFIX_BYTES + PREFIX.unpack_from(buf, start)[2]):
                if end == len(buf):
                    buf[:end - start] = buf[start:end]
                    start, end = 0, end - start
                n = conn.recv_into(view[end:])
                if not n:
                    return
                end += n
            hlen = PREFIX.unpack_from(buf, start)[2]
            header = decode_header(view[start + PREFIX_BYTES:start + PREFIX_BYTES + hlen])
            start += PREFIX_BYTES + hlen
            if header.kind == KIND_HELLO:
                body = encode(HelloRsp(service="plain"))
            else:
                req = decode_req(header.body)
                body = encode(Rsp(1, req.path))
            kind = KIND_HELLO if header.kind == KIND_HELLO else KIND_RESPONSE
            conn.sendall(encode_frame_head(Header(kind, header.rid, body=msgspec.Raw(body)), 0))
            if start == end:
                start = end = 0

    def accept(listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    # The same-host Unix socket threefs's servers also have (threefs/common/local_socket.py): the client
    # picks the same transport for both servers (THREEFS_RPC_LOCAL=0: TCP for both).
    from threefs.common import local_socket

    unix = local_socket.listen(f"127.0.0.1:{port}")
    unix.setblocking(True)
    threading.Thread(target=accept, args=(unix,), daemon=True).start()
    q.put(port)
    accept(listener)


def _client(port: int, requests: int, go, out) -> None:
    from threefs.rpc.blocking import BlockingConnection
    from threefs.rpc.frame import KIND_REQUEST, body_encoder

    conn = BlockingConnection(f"127.0.0.1:{port}", TOKEN, f"bench-{os.getpid()}", 10.0)
    body = body_encoder.encode(Req("/bench/f1", 1))
    for _ in range(200):  # warm up
        conn.exchange(KIND_REQUEST, "b.echo", body, 10.0)
    out.put("ready")
    go.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(requests):
        header = conn.exchange(KIND_REQUEST, "b.echo", body, 10.0)
        if header.status:
            raise SystemExit(f"call failed: {header.status} {header.message}")
    out.put((t0, time.perf_counter(), time.process_time() - c0))
    conn.close()


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(kind: str, clients: int, requests: int) -> tuple[float, float, float]:
    """(round trips/s, client CPU µs per call, server CPU µs per call)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    target = _threefs_server if kind == "threefs" else _plain_server
    server = ctx.Process(target=target, args=(q,), daemon=True)
    server.start()
    try:
        port = q.get(timeout=60)
        go, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_client, args=(port, requests, go, out)) for _ in range(clients)]
        for p in procs:
            p.start()
        for _ in procs:
            assert out.get(timeout=120) == "ready"
        s0 = _cpu_s(server.pid)
        go.set()
        rows = [out.get(timeout=600) for _ in procs]
        s1 = _cpu_s(server.pid)
        for p in procs:
            p.join(60)
    finally:
        server.kill()
        server.join(10)
    total = clients * requests
    span = max(r[1] for r in rows) - min(r[0] for r in rows)
    return total / span, sum(r[2] for r in rows) / total * 1e6, (s1 - s0) / total * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000, help="round trips per client")
    parser.add_argument("--clients", default="1,8", help="client process counts, comma-separated")
    args = parser.parse_args()
    load_before = open("/proc/loadavg").read().split()[:3]
    print(f"{'clients':>7} {'system':>8} {'calls/s':>9} {'client us':>9} {'server us':>9}   threefs/plain")
    for n in [int(c) for c in args.clients.split(",")]:
        plain = run("plain", n, args.requests)
        ours = run("threefs", n, args.requests)
        for name, r in (("plain", plain), ("threefs", ours)):
            print(f"{n:>7} {name:>8} {r[0]:>9,.0f} {r[1]:>9.1f} {r[2]:>9.1f}"
                  + (f"   {ours[0] / plain[0]:.2f}x" if name == "threefs" else ""))
    print(f"(clients are processes on blocking connections; load average before {' '.join(load_before)}, "
          f"after {' '.join(open('/proc/loadavg').read().split()[:3])})")


if __name__ == "__main__":
    main()
