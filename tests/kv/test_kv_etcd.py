"""etcd-specific behaviour of the KV engine (the shared semantics run in the conformance suite via the `kv`
fixture): URLs, refused limits, write-log GC, and serving through the loss of a member."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from threefs.common.status import KVConflictError, StatusCode, ThreeFSError
from threefs.kv import open_engine
from threefs.kv import etcd_wire as wire
from threefs.kv.etcd import EtcdEngine, parse_etcd_url
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


async def _count(engine: EtcdEngine, prefix: bytes) -> int:
    reply = await engine.call("range", wire.range_request(prefix, prefix[:-1] + b"0", count_only=True))
    return reply["count"]


def test_markers_and_logs_expire_with_their_lease(tmp_path: Path):
    """Write markers, the clear_range log and commit tokens vanish with their lease (no GC pass, no leak),
    and conflicts stay exact afterwards."""
    cluster = shared_etcd()

    async def body():
        engine = EtcdEngine(cluster.endpoints.split(","), f"lease-{tmp_path.name}", lease_ttl_s=8)
        try:
            for i in range(20):
                await engine.run(lambda tr, i=i: _set(tr, b"k%d" % (i % 5), b"v%d" % i))
            tr = engine.transaction()
            tr.clear_range(b"k3", b"k4")
            tr.clear(b"k7")  # absent: a clear of nothing still leaves its marker
            tr.add_write_conflict_key(b"k8")
            await tr.commit()
            # Sets leave no marker (their data key's mod_revision serves); the clear and the write conflict do.
            assert await _count(engine, engine.marker_prefix) == 2
            assert await _count(engine, engine.clear_log_prefix) == 1
            assert await _count(engine, engine.token_prefix) == 21
            deadline = time.monotonic() + 30
            while await _count(engine, engine.marker_prefix + b"k") or await _count(engine, engine.token_prefix):
                assert time.monotonic() < deadline, "markers outlived their lease"
                await asyncio.sleep(0.5)
            assert await _count(engine, engine.clear_log_prefix) == 0
            rows = await engine.transaction().get_range(b"", b"\xff")
            assert rows == [(b"k%d" % j, b"v%d" % (15 + j)) for j in (0, 1, 2, 4)]
            reader = engine.transaction()  # a write after the expiry still conflicts: a set, a clear of nothing
            await reader.get(b"k1")
            await engine.run(lambda tr: _set(tr, b"k1", b"new"))
            reader.set(b"out", b"1")
            with pytest.raises(KVConflictError):
                await reader.commit()
            reader = engine.transaction()
            assert await reader.get(b"k7") is None
            tr = engine.transaction()
            tr.clear(b"k7")
            await tr.commit()
            reader.set(b"out", b"2")
            with pytest.raises(KVConflictError):
                await reader.commit()
        finally:
            await engine.close()

    asyncio.run(body())


def test_independent_commits_share_etcd_txns_and_conflicts_stay_exact(tmp_path: Path):
    """64 concurrent increments: 48 of private counters, 16 of one shared counter. The private ones are
    batched into nested Txns; the shared one serialises by conflict and retry; no increment is lost."""
    cluster = shared_etcd()

    async def increment(tr, key: bytes) -> None:
        value = await tr.get(key)
        await asyncio.sleep(0)
        tr.set(key, b"%d" % (int(value or b"0") + 1))

    async def body():
        engine = EtcdEngine(cluster.endpoints.split(","), f"batch-{tmp_path.name}")
        try:
            jobs = [engine.run(lambda tr, i=i: increment(tr, b"own%02d" % i)) for i in range(48)]
            jobs += [engine.run(lambda tr: increment(tr, b"shared")) for _ in range(16)]
            await asyncio.gather(*jobs)
            rows = dict(await engine.transaction().get_range(b"", b"\xff"))
            assert rows == {**{b"own%02d" % i: b"1" for i in range(48)}, b"shared": b"16"}
            assert engine.stats["commit_batches"] < engine.stats["commits"], engine.stats
            assert engine.stats["read_batches"] < engine.stats["reads"], engine.stats
        finally:
            await engine.close()

    asyncio.run(body())


def test_a_resent_commit_applies_once(tmp_path: Path):
    """A commit sent again after its reply was lost (the same etcd Txn twice) is recognised by its token:
    the second send reports the first one's revision and changes nothing."""
    cluster = shared_etcd()

    async def body():
        engine = EtcdEngine(cluster.endpoints.split(","), f"once-{tmp_path.name}", batching=False)
        try:
            await engine.run(lambda tr: _set(tr, b"a", b"1"))
            tr = engine.transaction()
            assert await tr.get(b"a") == b"1"
            tr.set(b"a", b"2")
            sent: list[dict] = []
            call = engine.call

            async def recording_call(path, request):
                if path == "txn" and b"/d/a" in request:  # the commit (reads send other txns)
                    sent.append(request)
                return await call(path, request)

            engine.call = recording_call  # type: ignore[method-assign]
            first = await tr.commit()
            assert len(sent) == 1
            again = await call("txn", sent[0])  # the resend
            assert not again.get("succeeded")
            assert engine._outcome(engine._last_commit, again, 0) == ("ok", first)
            assert await engine.transaction().get(b"a") == b"2"
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

                async def big(tr):
                    for i in range(200):
                        tr.set(b"b%03d" % i, b"v")

                # Submitted together, small and big commits may share an etcd Txn, which etcd refuses as a
                # whole: each is then sent alone, so only the big one fails (either way, only it fails).
                results = await asyncio.gather(engine.run(big, retries_max=0),
                                               *(engine.run(lambda tr, i=i: _set(tr, b"s%d" % i, b"1"))
                                                 for i in range(6)), return_exceptions=True)
                assert isinstance(results[0], ThreeFSError) and results[0].code == StatusCode.KV_TOO_LARGE
                assert results[1:] == [None] * 6
                rows = dict(await engine.transaction().get_range(b"", b"\xff"))
                assert rows == {b"small": b"ok", **{b"s%d" % i: b"1" for i in range(6)}}
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


def test_a_silent_member_is_passed_over(tmp_path: Path):
    """A member that stops answering without closing connections (SIGSTOP: what a cut-off host looks like to
    its clients) does not stall the engine: requests are hedged to the next member, every commit lands once."""
    with EtcdCluster(tmp_path / "etcd", members=3) as cluster:
        async def increment(tr):
            value = await tr.get(b"counter")
            tr.set(b"counter", b"%d" % (int(value or b"0") + 1))

        async def body():
            engine = await open_engine(cluster.kv_url("silent"))
            try:
                for _ in range(5):
                    await engine.run(increment, timeout_s=30)
                current = engine._current  # the endpoint requests go to (the leader, once found)
                stopped = cluster.members[current].process
                stopped.send_signal(signal.SIGSTOP)
                try:
                    for _ in range(10):
                        await engine.run(increment, timeout_s=30)
                    assert engine._current != current
                finally:
                    stopped.send_signal(signal.SIGCONT)
                assert await engine.transaction().get(b"counter") == b"15"
            finally:
                await engine.close()

        asyncio.run(body())
