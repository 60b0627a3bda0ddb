"""etcd-specific behaviour of the KV engine (the shared semantics run in the conformance suite via the `kv`
fixture): URLs, refused limits, write-log GC, and serving through the loss of a member."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import pytest

from threefs.common.status import StatusCode, ThreeFSError
from threefs.kv import open_engine
from threefs.kv.etcd import LOG_KEEP_S, EtcdEngine, parse_etcd_url
from threefs.common.net import free_port
from threefs.testing.etcd_cluster import EtcdCluster, etcd_available, shared_etcd

pytestmark = pytest.mark.skipif(etcd_available() is not None, reason=str(etcd_available()))


@pytest.mark.parametrize("url", ["etcd://", "etcd://host", "etcd://h:0", "etcd://h:1?x=1", "etcd://h:port/p"])
def test_bad_urls_are_refused(url):
    with pytest.raises(ThreeFSError) as info:
        asyncio.run(open_engine(url))
    assert info.value.code == StatusCode.INVALID_ARGUMENT and url in str(info.value)


def test_url_form():
    assert parse_etcd_url("etcd://a:1,b:2/x/y") == (["a:1", "b:2"], "x/y")
    assert parse_etcd_url("etcd://a:1") == (["a:1"], "threefs")


def test_unreachable_cluster_is_unavailable():
    async def body():
        engine = EtcdEngine([f"127.0.0.1:{free_port()}"], "nobody", request_deadline_s=0.5)
        try:
            with pytest.raises(ThreeFSError) as info:
                await engine.transaction().get(b"k")
            assert info.value.code == StatusCode.UNAVAILABLE and "no member answered" in str(info.value)
        finally:
            await engine.close()

    asyncio.run(body())


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_write_log_is_collected_after_the_window(tmp_path: Path, clock):
    cluster = shared_etcd()

    async def entries(engine):
        reply = await engine.call("range", {"key": _b64(engine.log_prefix),
                                            "range_end": _b64(engine.log_prefix + b"\xff"), "count_only": True})
        return int(reply.get("count", 0))

    async def body():
        engine = EtcdEngine(cluster.endpoints.split(","), f"gc-{tmp_path.name}", clock=clock)
        try:
            for i in range(20):
                await engine.run(lambda tr, i=i: _set(tr, b"k%d" % (i % 5), b"v%d" % i))
            assert await entries(engine) == 20
            clock.advance(LOG_KEEP_S + 1)
            await engine.run(lambda tr: _set(tr, b"z", b"1"))  # this commit collects the 20 old entries
            assert await entries(engine) == 1
            rows = await engine.transaction().get_range(b"", b"\xff")
            assert rows == [(b"k%d" % j, b"v%d" % (15 + j)) for j in range(5)] + [(b"z", b"1")]
        finally:
            await engine.close()

    asyncio.run(body())


async def _set(tr, key: bytes, value: bytes) -> None:
    await tr.get(key)
    tr.set(key, value)


def test_too_many_ops_is_kv_too_large(tmp_path: Path):
    """etcd's default --max-txn-ops (128) refuses a bigger commit: KV_TOO_LARGE, nothing applied."""
    with EtcdCluster(tmp_path / "etcd", members=1, max_txn_ops=128) as cluster:
        async def body():
            engine = await open_engine(cluster.kv_url("big"))
            try:
                tr = engine.transaction()
                for i in range(200):
                    tr.set(b"k%03d" % i, b"v")
                with pytest.raises(ThreeFSError) as info:
                    await tr.commit()
                assert info.value.code == StatusCode.KV_TOO_LARGE and "max-txn-ops" in str(info.value)
                assert await engine.transaction().get_range(b"", b"\xff") == []
                await engine.run(lambda tr: _set(tr, b"small", b"ok"))  # a smaller one still commits
            finally:
                await engine.close()

        asyncio.run(body())


def test_serves_through_the_loss_of_any_member(tmp_path: Path):
    """Kill each member in turn (SIGKILL) while transactions run: every acknowledged commit is there, the
    counter never loses an increment, and the member rejoins."""
    with EtcdCluster(tmp_path / "etcd", members=3) as cluster:
        async def increment(tr):
            value = await tr.get(b"counter")
            tr.set(b"counter", b"%d" % (int(value or b"0") + 1))

        async def body():
            engine = await open_engine(cluster.kv_url("failover"))
            acked = 0
            try:
                for victim in range(3):
                    for _ in range(10):
                        await engine.run(increment, timeout_s=30)
                        acked += 1
                    cluster.stop_member(victim)  # the engine's current endpoint is among them
                    for _ in range(10):
                        await engine.run(increment, timeout_s=30)
                        acked += 1
                    cluster.start_member(victim)
                tr = engine.transaction()
                assert int(await tr.get(b"counter")) == acked
            finally:
                await engine.close()

        asyncio.run(body())
