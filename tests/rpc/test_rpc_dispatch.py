"""The server's dispatch: a request runs in the reader's callback up to its first wait, and becomes a Task
only if it waits. These pin what must not change with that: deadlines for handlers that wait (also when
the handler entered its own asyncio.timeout / TaskGroup before waiting), a slow handler never holds up
others, cancellation when the connection closes, the in-flight limit, pipelined answers, contextvars.
Real TCP on loopback, real servers, under uvloop (what services run) and asyncio's own loop."""

from __future__ import annotations

import asyncio
import contextvars
import time

import msgspec
import pytest
import uvloop

from threefs.common.status import StatusCode
from threefs.rpc.blocking import BlockingConnection
from threefs.rpc.client import RpcClient
from threefs.rpc.frame import KIND_REQUEST, Header, body_encoder, encode_frame_head
from threefs.rpc.server import CallContext, RpcServer, rpc, token_authenticator
from threefs.testing.checks import wait_for

TOKEN = "dispatch-token"
VAR = contextvars.ContextVar("VAR", default="unset")


class Req(msgspec.Struct):
    text: str = ""
    wait_s: float = 0.0
    inner_s: float = 0.0  # the handler's own asyncio.timeout, entered before its first wait


class Rsp(msgspec.Struct):
    text: str
    had_task: bool = False
    var: str = ""


class Service:
    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.started: list[str] = []
        self.release = asyncio.Event()

    @rpc(Req)
    async def now(self, ctx: CallContext, req: Req) -> Rsp:
        return Rsp(req.text, asyncio.current_task() is not None)

    @rpc(Req)
    async def sleep(self, ctx: CallContext, req: Req) -> Rsp:
        before = asyncio.current_task() is not None
        await asyncio.sleep(req.wait_s)
        return Rsp(req.text, before and asyncio.current_task() is not None)

    @rpc(Req)
    async def inner_timeout(self, ctx: CallContext, req: Req) -> Rsp:
        """Its own timeout, entered in the first step (before any Task exists), fires while it waits."""
        try:
            async with asyncio.timeout(req.inner_s):
                await asyncio.sleep(req.wait_s)
        except TimeoutError:
            return Rsp("inner timeout")
        return Rsp("slept")

    @rpc(Req)
    async def group(self, ctx: CallContext, req: Req) -> Rsp:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(asyncio.sleep(req.wait_s, result=i)) for i in range(3)]
        return Rsp(",".join(str(t.result()) for t in tasks))

    @rpc(Req)
    async def hold(self, ctx: CallContext, req: Req) -> Rsp:
        self.started.append(req.text)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(req.text)
            raise
        return Rsp(req.text)

    @rpc(Req)
    async def setvar(self, ctx: CallContext, req: Req) -> Rsp:
        seen = VAR.get()
        VAR.set(req.text)
        if req.wait_s:
            await asyncio.sleep(req.wait_s)
        return Rsp(req.text, var=seen)

    @rpc(Req)
    async def blob(self, ctx: CallContext, req: Req):
        """An answer with a payload of int(req.text) bytes."""
        return Rsp(req.text), bytes(range(256)) * (int(req.text) // 256)

    @rpc(Req)
    async def echo_payload(self, ctx: CallContext, req: Req):
        return Rsp(req.text), bytes(ctx.payload) if ctx.payload is not None else None


async def _start(inflight_max: int | None = None):
    kw = {} if inflight_max is None else {"inflight_max": inflight_max}
    server = RpcServer("disp", token_authenticator(TOKEN), **kw)
    service = Service()
    server.add_service("d", service)
    port = await server.start("127.0.0.1", 0)
    return server, service, f"127.0.0.1:{port}"


async def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


LOOPS = [pytest.param(uvloop.run, id="uvloop"), pytest.param(asyncio.run, id="asyncio")]


@pytest.mark.parametrize("runner", LOOPS)
def test_handlers_that_finish_at_once_and_handlers_that_wait(runner):
    async def main():
        server, _, addr = await _start()
        client = RpcClient(TOKEN)
        try:
            rsp, _ = await client.call(addr, "d.now", Req("a"), Rsp)
            assert rsp == Rsp("a", True)  # a current task exists in the first step too
            rsp, _ = await client.call(addr, "d.sleep", Req("b", wait_s=0.01), Rsp)
            assert rsp == Rsp("b", True)
            rsp, _ = await client.call(addr, "d.sleep", Req("c", wait_s=0), Rsp)  # a bare yield
            assert rsp.text == "c"
            rsp, _ = await client.call(addr, "d.group", Req(wait_s=0.01), Rsp)
            assert rsp.text == "0,1,2"
            rsp, _ = await client.call(addr, "d.inner_timeout", Req(inner_s=0.05, wait_s=5), Rsp, timeout=5)
            assert rsp.text == "inner timeout"
            rsp, _ = await client.call(addr, "d.inner_timeout", Req(inner_s=5, wait_s=0.01), Rsp)
            assert rsp.text == "slept"
        finally:
            await client.close()
            await server.stop()

    runner(main())


@pytest.mark.parametrize("runner", LOOPS)
def test_the_deadline_holds_for_a_handler_that_waits(runner):
    """The server answers TIMEOUT at the request's deadline, even when the handler's own (longer) timeout
    was entered before it waited; the handler sees the cancellation."""

    async def main():
        server, service, addr = await _start()
        try:
            def call():
                conn = BlockingConnection(addr, TOKEN, "c1", 10.0)
                try:
                    t0 = time.monotonic()
                    body = body_encoder.encode(Req("late", wait_s=30, inner_s=20))
                    header = conn.exchange(KIND_REQUEST, "d.inner_timeout", body, 0.3)
                    return header, time.monotonic() - t0
                finally:
                    conn.close()

            header, took = await asyncio.get_running_loop().run_in_executor(None, call)
            assert header.status == StatusCode.TIMEOUT and "d.inner_timeout" in header.message
            assert took < 10  # the server's answer, not the socket's timeout
            # and the server keeps serving on new and old connections
            client = RpcClient(TOKEN)
            rsp, _ = await client.call(addr, "d.now", Req("after"), Rsp)
            assert rsp.text == "after"
            await client.close()
        finally:
            await server.stop()

    runner(main())


@pytest.mark.parametrize("runner", LOOPS)
def test_a_slow_handler_does_not_hold_up_others_on_its_connection(runner):
    async def main():
        server, service, addr = await _start()
        client = RpcClient(TOKEN)
        try:
            held = asyncio.ensure_future(client.call(addr, "d.hold", Req("slow"), Rsp))
            await _until(lambda: service.started == ["slow"])
            fast = await asyncio.gather(*(client.call(addr, "d.now", Req(str(i)), Rsp) for i in range(200)),
                                        *(client.call(addr, "d.sleep", Req(f"s{i}", wait_s=0.001), Rsp)
                                          for i in range(50)))
            assert [r.text for r, _ in fast] == [str(i) for i in range(200)] + [f"s{i}" for i in range(50)]
            assert not held.done()
            service.release.set()
            rsp, _ = await held
            assert rsp.text == "slow"
        finally:
            await client.close()
            await server.stop()

    runner(main())


@pytest.mark.parametrize("runner", LOOPS)
def test_closing_the_connection_cancels_its_waiting_handlers(runner):
    async def main():
        server, service, addr = await _start()
        try:
            def send_two():  # blocking calls: off the server's loop
                conn = BlockingConnection(addr, TOKEN, "closer", 5.0)
                for name in ("h1", "h2"):
                    conn.send(KIND_REQUEST, "d.hold", body_encoder.encode(Req(name)), 30)
                return conn

            conn = await asyncio.get_running_loop().run_in_executor(None, send_two)
            await _until(lambda: sorted(service.started) == ["h1", "h2"])
            conn.close()
            await _until(lambda: sorted(service.cancelled) == ["h1", "h2"])
        finally:
            await server.stop()

    runner(main())


@pytest.mark.parametrize("runner", LOOPS)
def test_in_flight_limit_counts_requests_that_wait(runner):
    async def main():
        server, service, addr = await _start(inflight_max=4)
        client = RpcClient(TOKEN)
        try:
            # 200 that finish at once never count as in flight
            rs = await asyncio.gather(*(client.call(addr, "d.now", Req(str(i)), Rsp) for i in range(200)))
            assert len(rs) == 200
            held = [asyncio.ensure_future(client.call(addr, "d.hold", Req(f"h{i}"), Rsp)) for i in range(6)]
            await _until(lambda: len(service.started) == 4 and sum(h.done() for h in held) == 2)
            refused = [h for h in held if h.done()]
            for h in refused:
                assert h.exception().code == StatusCode.TOO_MANY_REQUESTS
            service.release.set()
            for h in held:
                if h not in refused:
                    assert (await h)[0].text.startswith("h")
        finally:
            await client.close()
            await server.stop()

    runner(main())


def _raw_frames(frames) -> bytes:
    out = bytearray()
    for rid, method, req, payload in frames:
        header = Header(KIND_REQUEST, rid, method=method, timeout_ms=5000,
                        body=msgspec.Raw(body_encoder.encode(req)))
        out += encode_frame_head(header, len(payload) if payload else 0)
        if payload:
            out += payload
    return bytes(out)


@pytest.mark.parametrize("runner", LOOPS)
def test_pipelined_requests_in_one_write_all_get_their_answers(runner):
    """Many requests in one TCP write, answers of handlers that finish at once batched into one write, mixed
    with payload answers and handlers that wait: every answer arrives once, with its own bytes."""

    async def main():
        server, _, addr = await _start()
        try:
            def run_client():
                conn = BlockingConnection(addr, TOKEN, "pipe", 10.0)
                try:
                    frames, expect = [], {}
                    for rid in range(1000, 1400):
                        kind = rid % 4
                        if kind == 0:
                            frames.append((rid, "d.now", Req(f"n{rid}"), None))
                        elif kind == 1:
                            frames.append((rid, "d.echo_payload", Req(f"p{rid}"), bytes([rid % 251]) * rid))
                        elif kind == 2:
                            frames.append((rid, "d.sleep", Req(f"s{rid}", wait_s=0.001), None))
                        else:
                            frames.append((rid, "d.nope", Req(), None))
                        expect[rid] = None
                    conn.sock.sendall(_raw_frames(frames))
                    got = {}
                    while expect:
                        header, payload = conn.receive(expect)
                        del expect[header.rid]
                        rsp = None if header.status else msgspec.msgpack.decode(header.body, type=Rsp)
                        # (decoded at once: the header's body points into the connection's buffer)
                        got[header.rid] = (header.status, rsp, None if payload is None else bytes(payload))
                    return got
                finally:
                    conn.close()

            got = await asyncio.get_running_loop().run_in_executor(None, run_client)
            assert sorted(got) == list(range(1000, 1400))
            for rid, (status, rsp, payload) in got.items():
                kind = rid % 4
                if kind == 3:
                    assert status == StatusCode.UNKNOWN_METHOD
                    continue
                assert status == 0
                assert rsp.text == "nps"[kind] + str(rid)
                assert payload == (bytes([rid % 251]) * rid if kind == 1 else None)
        finally:
            await server.stop()

    runner(main())


@pytest.mark.parametrize("runner", LOOPS)
def test_each_request_has_its_own_context(runner):
    async def main():
        server, _, addr = await _start()
        client = RpcClient(TOKEN)
        try:
            seen = [(await client.call(addr, "d.setvar", Req(str(i), wait_s=0.001 * (i % 2)), Rsp))[0].var
                    for i in range(6)]
            assert seen == ["unset"] * 6
        finally:
            await client.close()
            await server.stop()

    runner(main())


def test_a_blocking_connection_times_out_by_the_kernels_timer():
    """rpc/blocking.py keeps its timeout in the socket (SO_RCVTIMEO): a server that does not answer in time
    makes the call fail as Broken, saying so, after about that time, and the connection is not reused."""
    from threefs.rpc.blocking import Broken

    async def main():
        server, service, addr = await _start()
        try:
            def call():
                conn = BlockingConnection(addr, TOKEN, "slow-reader", 0.5)
                try:
                    t0 = time.monotonic()
                    with pytest.raises(Broken) as e:
                        conn.exchange(KIND_REQUEST, "d.hold", body_encoder.encode(Req("never")), 30)
                    return str(e.value), time.monotonic() - t0
                finally:
                    conn.close()

            why, took = await asyncio.get_running_loop().run_in_executor(None, call)
            assert "timed out after 0.5 s" in why
            assert took < 20  # the socket's 0.5 s, not the request's 30 s deadline
        finally:
            service.release.set()
            await server.stop()

    uvloop.run(main())


def test_exchange_reads_every_kind_of_answer_and_the_connection_stays_in_step():
    """BlockingConnection.exchange's one-recv path (a header-only answer) and the general one (an answer with
    a payload, which exchange drops; an error answer) alternate on one connection without losing a frame."""

    async def main():
        server, service, addr = await _start()
        try:
            def calls():
                conn = BlockingConnection(addr, TOKEN, "mixed", 10.0)
                try:
                    texts = []
                    for i in range(60):
                        if i % 3 == 0:
                            header = conn.exchange(KIND_REQUEST, "d.now", body_encoder.encode(Req(f"t{i}")), 10)
                            texts.append(msgspec.msgpack.decode(header.body, type=Rsp).text)
                        elif i % 3 == 1:  # 0.25 MB of payload: many recvs, dropped by exchange
                            header = conn.exchange(KIND_REQUEST, "d.blob", body_encoder.encode(Req("262144")), 10)
                            texts.append(msgspec.msgpack.decode(header.body, type=Rsp).text)
                        else:
                            header = conn.exchange(KIND_REQUEST, "d.nosuch", body_encoder.encode(Req()), 10)
                            texts.append(StatusCode(header.status).name)
                    return texts
                finally:
                    conn.close()

            texts = await asyncio.get_running_loop().run_in_executor(None, calls)
            assert texts == [f"t{i}" if i % 3 == 0 else "262144" if i % 3 == 1 else "UNKNOWN_METHOD"
                             for i in range(60)]
        finally:
            await server.stop()

    uvloop.run(main())


def test_a_pool_with_recent_s_reuses_without_polling_and_a_dead_connection_fails_as_broken():
    """A connection given back less than recent_s ago is handed out without the liveness poll: if the server
    closed it meanwhile, the call on it fails as Broken (meta_sync then runs it again on a fresh one, see
    tests/meta/test_meta_fastpath.py). Without recent_s the poll notices the close and a new connection
    is opened to the restarted server."""
    from threefs.rpc.blocking import BlockingPool, Broken

    async def main():
        loop = asyncio.get_running_loop()
        server, service, addr = await _start()
        port = int(addr.rpartition(":")[2])
        trusting = BlockingPool(lambda: TOKEN, lambda: "trusting", 5.0, 4, recent_s=3600)
        polling = BlockingPool(lambda: TOKEN, lambda: "polling", 5.0, 4)

        def call(pool):
            conn = pool.take(addr)
            assert conn is not None and not isinstance(conn, Broken), conn
            header = conn.exchange(KIND_REQUEST, "d.now", body_encoder.encode(Req("hi")), 10)
            pool.give_back(addr, conn)
            return conn, msgspec.msgpack.decode(header.body, type=Rsp).text

        try:
            first_t, text = await loop.run_in_executor(None, call, trusting)
            assert text == "hi"
            first_p, _ = await loop.run_in_executor(None, call, polling)
            await server.stop()
            old = server
            await _until(lambda: not old.connections)  # both connections closed on the server's side
            server = RpcServer("disp", token_authenticator(TOKEN))
            server.add_service("d", service)
            await server.start("127.0.0.1", port)

            def on_dead_connection():
                conn = trusting.take(addr)
                assert conn is first_t  # no poll: the pooled one, though its server is gone
                try:
                    with pytest.raises(Broken):
                        conn.exchange(KIND_REQUEST, "d.now", body_encoder.encode(Req("again")), 10)
                finally:
                    trusting.discard(addr, conn)

            await loop.run_in_executor(None, on_dead_connection)
            again_t, text = await loop.run_in_executor(None, call, trusting)  # a fresh one now
            assert again_t is not first_t and text == "hi"
            again_p, text = await loop.run_in_executor(None, call, polling)  # the poll saw the close
            assert again_p is not first_p and text == "hi"
        finally:
            trusting.close()
            polling.close()
            await server.stop()

    uvloop.run(main())


@pytest.mark.parametrize("runner", LOOPS)
def test_the_answer_to_a_reads_last_request_goes_out_before_the_requests_bookkeeping(runner):
    """The answer of a handler that finishes inside the read is written as soon as it is the read's last
    frame, not after the request's bookkeeping (the metrics hook, here one that blocks the loop for 1 s):
    the caller has its answer while the server still finishes up. Answers to earlier frames of the same
    read wait for it and go out in the same write (pipelined answers stay in one system call)."""

    async def main():
        server, _, addr = await _start()
        observed = []

        def slow_hook(method, seconds, code, bytes_in, bytes_out):
            observed.append(method)
            time.sleep(1.0)  # blocks the server's loop, as slow bookkeeping would

        try:
            def call():
                conn = BlockingConnection(addr, TOKEN, "eager", 10.0)
                try:
                    server.metrics_hook = slow_hook
                    t0 = time.monotonic()
                    header = conn.exchange(KIND_REQUEST, "d.now", body_encoder.encode(Req("x")), 10)
                    took = time.monotonic() - t0
                    text = msgspec.msgpack.decode(header.body, type=Rsp).text  # valid until the next call
                    # the hook runs after the answer went out: wait for it before taking it away, else a
                    # fast client removes it before the server's loop gets to its bookkeeping
                    wait_for(lambda: observed, "the server's metrics hook to run", 10, interval=0.01)
                    server.metrics_hook = None
                    # two requests in one write: both answers arrive, the first one batched with the second
                    conn.sock.sendall(_raw_frames([(900, "d.now", Req("a"), None), (901, "d.now", Req("b"), None)]))
                    expect = {900: None, 901: None}
                    texts = {}
                    while expect:
                        h, _ = conn.receive(expect)
                        del expect[h.rid]
                        texts[h.rid] = msgspec.msgpack.decode(h.body, type=Rsp).text
                    return text, took, texts
                finally:
                    conn.close()

            text, took, texts = await asyncio.get_running_loop().run_in_executor(None, call)
            assert text == "x" and observed == ["d.now"]
            assert took < 0.5, f"the answer waited {took:.2f} s for the metrics hook"
            assert texts == {900: "a", 901: "b"}
        finally:
            await server.stop()

    runner(main())
