"""Spinning instead of sleeping while waiting for the peer (common/spin.py): the CPU-pressure gate, the blocking
client's spin (rpc/blocking.py) and the server's (rpc/server.py Spinner) answer exactly as sleeping does, and
each spins only when it should."""

import asyncio
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from threefs.common import spin
from threefs.common.spin import Spinner
from threefs.rpc.blocking import BlockingConnection
from threefs.rpc.frame import KIND_REQUEST, body_encoder
from threefs.rpc.server import RpcServer, token_authenticator
from tests.rpc.test_rpc import TOKEN, Echo, EchoReq, EchoRsp

ROOT = str(Path(__file__).resolve().parents[2])


def _loadavg(path: Path, running: int) -> None:
    path.write_text(f"0.52 0.58 0.59 {running}/1234 5678\n")


def test_calm_while_no_more_tasks_run_than_cpus(tmp_path, monkeypatch):
    f = tmp_path / "loadavg"
    _loadavg(f, 1)
    monkeypatch.setattr(spin, "LOADAVG_PATH", str(f))
    r = spin._Runnable()
    r.cpus = 2
    assert r.sample(1.0) is True  # 1 runnable (the reader) on 2 CPUs
    _loadavg(f, 2)
    assert r.sample(2.0) is True  # two spinners on two CPUs (average 1.5)
    _loadavg(f, 6)  # 8 clients and a server: average 3.75
    assert r.sample(3.0) is False
    _loadavg(f, 2)
    assert r.sample(4.0) is False  # one quiet sample does not undo it at once (2.875)
    assert r.sample(5.0) is True  # (2.44)
    for t in range(6, 20):
        assert r.sample(float(t)) is True  # steady at 2 on 2 CPUs: calm


def test_never_calm_without_a_count_of_runnable_tasks(tmp_path, monkeypatch):
    monkeypatch.setattr(spin, "LOADAVG_PATH", str(tmp_path / "missing"))
    r = spin._Runnable()
    assert not r.sample(1.0) and not r.sample(2.0)
    garbled = tmp_path / "garbled"
    garbled.write_text("no numbers here\n")
    monkeypatch.setattr(spin, "LOADAVG_PATH", str(garbled))
    r = spin._Runnable()
    assert not r.sample(1.0) and not r.sample(2.0)
    assert r.fd == -2  # given up on: not read again


def test_cpu_calm_samples_at_most_every_sample_interval(tmp_path, monkeypatch):
    f = tmp_path / "loadavg"
    _loadavg(f, 1)
    monkeypatch.setattr(spin, "LOADAVG_PATH", str(f))
    monkeypatch.setattr(spin, "_runnable", None)
    assert spin.cpu_calm() is True
    reads = []
    real = spin._Runnable.sample
    monkeypatch.setattr(spin._Runnable, "sample", lambda self, now: reads.append(now) or real(self, now))
    for _ in range(1000):
        spin.cpu_calm()
    assert len(reads) <= 1
    time.sleep(spin.SAMPLE_S * 1.5)
    spin.cpu_calm()
    assert len(reads) >= 1


async def _server(**kw):
    server = RpcServer("echo", token_authenticator(TOKEN), **kw)
    server.add_service("echo", Echo())
    port = await server.start("127.0.0.1", 0)
    return server, port


@pytest.mark.parametrize("calm", [True, False])
def test_blocking_client_answers_alike_spinning_or_sleeping(transport, calm, monkeypatch):
    """Quick answers make the client spin (when the CPU is calm); slow ones (a delayed handler) make it sleep
    again; every answer is the one asked for, and a delayed one still arrives."""
    monkeypatch.setattr(spin, "cpu_calm", lambda: calm)
    monkeypatch.setattr(spin, "CLIENT_SPIN_S_MAX", 0.002)  # wide margins: a slow machine still tells them apart
    spun = []
    real_probe = select.poll

    class CountingPoll:  # counts the zero-timeout polls of a spin
        def __init__(self):
            self._p = real_probe()

        def register(self, *a):
            self._p.register(*a)

        def poll(self, timeout=None):
            if timeout == 0:
                spun.append(1)
            return self._p.poll(timeout)
    monkeypatch.setattr(spin.select, "poll", CountingPoll)

    async def main():
        server, port = await _server()
        try:
            def calls():
                conn = BlockingConnection(f"127.0.0.1:{port}", TOKEN, "spin", 5.0)
                try:
                    for i in range(200):
                        header = conn.exchange(KIND_REQUEST, "echo.echo", body_encoder.encode(EchoReq(f"q{i}")), 5.0)
                        assert msgspec.msgpack.decode(header.body, type=EchoRsp).text == f"q{i}"
                    quick_wait, quick_spins = conn._answer.wait_s, len(spun)
                    for i in range(12):  # answers 20 ms away: the moving average climbs past the limit
                        header = conn.exchange(KIND_REQUEST, "echo.echo",
                                               body_encoder.encode(EchoReq(f"s{i}", delay_s=0.02)), 5.0)
                        assert msgspec.msgpack.decode(header.body, type=EchoRsp).text == f"s{i}"
                    slow_wait, slow_spins = conn._answer.wait_s, len(spun)
                    for i in range(5):  # now it sleeps: no zero-timeout polls at all
                        header = conn.exchange(KIND_REQUEST, "echo.echo",
                                               body_encoder.encode(EchoReq(f"t{i}", delay_s=0.02)), 5.0)
                        assert msgspec.msgpack.decode(header.body, type=EchoRsp).text == f"t{i}"
                    return quick_wait, quick_spins, slow_wait, slow_spins, len(spun)
                finally:
                    conn.close()
            return await asyncio.to_thread(calls)
        finally:
            await server.stop()
    quick_wait, quick_spins, slow_wait, slow_spins, last_spins = asyncio.run(main())
    assert quick_wait < 0.002 < slow_wait  # quick answers keep the average low, slow ones raise it
    assert (quick_spins > 0) == calm  # a calm CPU: it spun for the quick answers; else it never spins
    assert last_spins == slow_spins  # past the limit: it sleeps


def test_server_spins_between_close_requests_and_stops_after_the_window(transport, monkeypatch):
    monkeypatch.setattr(spin, "cpu_calm", lambda: True)

    async def main():
        from threefs.rpc.client import RpcClient
        server, port = await _server(spin_us=20_000)
        client = RpcClient(TOKEN)
        addr = f"127.0.0.1:{port}"
        try:
            assert server.spinner is not None and server.spinner.loop is None
            seen_spinning = False
            for i in range(50):
                rsp, _ = await client.call(addr, "echo.echo", EchoReq(f"x{i}"), EchoRsp)
                assert rsp.text == f"x{i}"
                seen_spinning |= server.spinner.loop is not None
            assert seen_spinning  # requests closer together than 20 ms: the loop polled between them
            await asyncio.sleep(0.3)  # 15 windows without a request
            assert server.spinner.loop is None
        finally:
            await client.close()
            await server.stop()
    asyncio.run(main())


def test_server_does_not_spin_when_the_cpu_is_contended_or_spinning_is_off(transport, monkeypatch):
    monkeypatch.setattr(spin, "cpu_calm", lambda: False)

    async def main():
        from threefs.rpc.client import RpcClient
        for kw in ({"spin_us": 2000}, {}):
            server, port = await _server(**kw)
            client = RpcClient(TOKEN)
            try:
                for i in range(30):
                    rsp, _ = await client.call(f"127.0.0.1:{port}", "echo.echo", EchoReq(f"y{i}"), EchoRsp)
                    assert rsp.text == f"y{i}"
                    assert server.spinner is None or server.spinner.loop is None
            finally:
                await client.close()
                await server.stop()
    asyncio.run(main())


def test_spinner_gap_average_decides():
    """Requests far apart (heartbeats) never start a spin; a run of close ones does."""
    s = Spinner(200e-6)

    async def main():
        for _ in range(5):
            s.arrived()
            await asyncio.sleep(0.01)  # 10 ms apart
        far = s.loop
        s.loop = None
        for _ in range(20):
            s.arrived()  # back to back
        return far, s.loop
    real = spin.cpu_calm
    spin.cpu_calm = lambda: True
    try:
        far, close = asyncio.run(main())
    finally:
        spin.cpu_calm = real
    assert far is None and close is not None


def test_spinner_polls_for_twice_the_average_gap_at_most_the_window(monkeypatch):
    """A steady stream of requests g apart is polled for 2 g after each (at least SPIN_MIN_S, at most the
    window): ones further apart than the old 200 us window (a create every 400 us) long enough to catch
    the next; none beyond the window's average gap."""
    clock = [100.0]
    monkeypatch.setattr(spin, "cpu_calm", lambda: True)

    async def stream(gap_s: float) -> tuple[bool, float]:
        s = Spinner(1e-3)
        s.clock = lambda: clock[0]
        for _ in range(40):
            clock[0] += gap_s
            s.arrived()
        return s.loop is not None, s.until_s - clock[0]

    for gap_s, polled_s in ((40e-6, spin.SPIN_MIN_S), (150e-6, 300e-6), (400e-6, 800e-6), (700e-6, 1e-3)):
        spinning, ahead = asyncio.run(stream(gap_s))
        assert spinning and ahead == pytest.approx(polled_s, rel=0.01), gap_s
    spinning, _ = asyncio.run(stream(3e-3))  # further apart than the window: sleeps
    assert not spinning


def test_bad_spin_setting_is_a_clear_error():
    env = dict(os.environ, THREEFS_RPC_SPIN_US="fast", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", "import threefs.rpc.blocking"], env=env, capture_output=True,
                       text=True)
    assert r.returncode != 0 and "THREEFS_RPC_SPIN_US='fast': expected microseconds" in r.stderr
    env["THREEFS_RPC_SPIN_US"] = "-1"
    r = subprocess.run([sys.executable, "-c", "import threefs.rpc.blocking"], env=env, capture_output=True,
                       text=True)
    assert r.returncode != 0 and "expected 0 to 100000 microseconds" in r.stderr
    env["THREEFS_RPC_SPIN_US"] = "0"
    r = subprocess.run([sys.executable, "-c", "import threefs.common.spin as s; print(s.CLIENT_SPIN_S_MAX)"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "0.0"


@pytest.mark.parametrize("calm", [True, False])
def test_async_client_loop_spin_answers_alike_and_spins_only_for_quick_answers(transport, calm, monkeypatch):
    """RpcClient.spin (the FUSE daemon's): the loop polls while a quick answer is due (when the CPU is calm),
    sleeps for slow ones, and every call gets its own answer either way."""
    from threefs.rpc.client import LoopSpin, RpcClient
    monkeypatch.setattr(spin, "cpu_calm", lambda: calm)

    async def main():
        server, port = await _server()
        client = RpcClient(TOKEN)
        client.spin = LoopSpin(spin_s_max=0.002)
        addr = f"127.0.0.1:{port}"
        try:
            seen = False
            for i in range(100):
                rsp, _ = await client.call(addr, "echo.echo", EchoReq(f"a{i}"), EchoRsp)
                assert rsp.text == f"a{i}"
                seen |= client.spin.loop is not None
            conn = client._conns[addr]
            quick = conn.answer_s
            rsps = await asyncio.gather(*(client.call(addr, "echo.echo", EchoReq(f"c{i}"), EchoRsp)
                                          for i in range(20)))  # many in flight at once
            assert [r.text for r, _ in rsps] == [f"c{i}" for i in range(20)]
            for i in range(12):
                rsp, _ = await client.call(addr, "echo.echo", EchoReq(f"s{i}", delay_s=0.02), EchoRsp)
                assert rsp.text == f"s{i}"
            slow = conn.answer_s
            await asyncio.sleep(0.01)  # any spin of the quick calls is long over
            assert client.spin.loop is None
            rsp, _ = await client.call(addr, "echo.echo", EchoReq("late", delay_s=0.02), EchoRsp)
            assert rsp.text == "late"
            return seen, quick, slow, client.spin.loop
        finally:
            await client.close()
            await server.stop()
    seen, quick, slow, after_slow = asyncio.run(main())
    assert seen == calm
    assert quick < 0.002 < slow
    assert after_slow is None  # past the limit: a call does not start a spin
