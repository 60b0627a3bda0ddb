"""The replica's watchdog on a real 3-member etcd: a watch stream that stays open but delivers nothing (its
member frozen with SIGSTOP, a follower, so no leader change moves the stream) while commits go through the
other members. The engine learns from its read versions and commit replies that revisions exist which its
replica has not reached; within a bound it restarts the stream on another member, and meanwhile its `run()`
transactions keep succeeding (they do not speculate on the stale copy).

Without the watchdog, only a transaction that waited REPLICA_WAIT_S for the replica moved the stream: an
engine whose transactions all speculated (or that only took read versions, as here) kept a copy stuck at an
old revision for as long as the member stayed frozen (seen in tests/multihost/test_etcd_hosts.py: one meta
server's transactions failing validation for the whole run).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from threefs.kv.etcd import EtcdEngine
from threefs.testing.etcd_cluster import EtcdCluster, etcd_available

pytestmark = pytest.mark.skipif(etcd_available() is not None, reason=str(etcd_available()))

RECOVERY_DEADLINE_S = 30.0  # generous: the watchdog acts after REPLICA_STALL_S (2 s) on a loaded machine


@pytest.fixture(scope="module")
def stall_etcd(tmp_path_factory):
    """A 3-member cluster of this module's own (a member is frozen)."""
    with EtcdCluster(tmp_path_factory.mktemp("stall-etcd"), members=3) as cluster:
        yield cluster


async def _increment(engine: EtcdEngine, key: bytes) -> int:
    """run(): read the counter at `key`, write it + 1; the new value."""
    async def body(tr) -> int:
        value = int(await tr.get(key) or b"0") + 1
        tr.set(key, b"%d" % value)
        return value
    return await engine.run(body)


async def _read(engine: EtcdEngine, key: bytes) -> bytes | None:
    async def body(tr):
        return await tr.get(key)
    return await engine.run(body)


async def _until(check, what: str, engine: EtcdEngine) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RECOVERY_DEADLINE_S
    while not check():
        assert loop.time() < deadline, f"{what} within {RECOVERY_DEADLINE_S} s: {engine.stats}"
        await asyncio.sleep(0.05)


def test_a_silent_watch_stream_is_restarted_and_transactions_keep_succeeding(stall_etcd, tmp_path: Path):
    cluster = stall_etcd
    endpoints = cluster.endpoints.split(",")
    prefix = f"stall-{tmp_path.name}"

    async def body():
        probe = EtcdEngine(endpoints, prefix, replica=False)
        leader = await probe.find_leader()
        await probe.close()
        assert leader is not None, "no etcd leader"
        followers = [i for i in range(3) if i != leader]
        # A talks to the two followers only (its watch on the first, which is frozen below; its requests then
        # go to the other): the leader check never finds the leader among A's endpoints, so nothing but the
        # watchdog moves A's stream. B commits through the leader and the other follower.
        a = EtcdEngine([endpoints[i] for i in followers], prefix)
        b = EtcdEngine([endpoints[i] for i in range(3) if i != followers[0]], prefix)
        try:
            assert await a.start_replica(30.0) and await b.start_replica(30.0), "a replica did not load"
            assert await _increment(b, b"n") == 1
            assert await _read(a, b"n") == b"1"
            assert a.watch_index == 0, "A's watch is not on the member to freeze"
            frozen = cluster.members[followers[0]].process
            frozen.send_signal(signal.SIGSTOP)
            try:
                # Phase 1: B commits; A only takes a read version (no transaction waits for A's replica).
                for i in range(2, 6):
                    assert await _increment(b, b"n") == i
                version = await a.read_version()
                assert version >= b.acked_revision
                await _until(lambda: a._replica is not None and a._replica.progress >= version,
                             "A's replica did not reach a read version A had taken", a)
                assert a.stats["watch_restarts"] >= 1, a.stats
                # Phase 2: both engines increment one counter, interleaved; every run() succeeds and the
                # counter counts every increment (no lost update, no stale read).
                total = 5
                for _ in range(10):
                    for engine in (a, b):
                        total += 1
                        assert await _increment(engine, b"n") == total
                assert await _read(a, b"n") == b"%d" % total
                speculative = a.stats["speculative"]
                assert await _increment(a, b"n") == total + 1
                assert a.stats["speculative"] > speculative, a.stats  # the restarted replica serves again
            finally:
                frozen.send_signal(signal.SIGCONT)
        finally:
            await a.close()
            await b.close()

    asyncio.run(body())


def test_a_watch_frozen_while_transactions_run_recovers(stall_etcd, tmp_path: Path):
    """The same freeze while A's and B's run() transactions are in full flow (the meta servers' case): every
    transaction succeeds within run()'s deadline, A's replica catches up with every commit B acknowledged, and
    A speculates again afterwards."""
    cluster = stall_etcd
    endpoints = cluster.endpoints.split(",")
    prefix = f"flow-{tmp_path.name}"

    async def body():
        probe = EtcdEngine(endpoints, prefix, replica=False)
        leader = await probe.find_leader()
        await probe.close()
        assert leader is not None, "no etcd leader"
        followers = [i for i in range(3) if i != leader]
        a = EtcdEngine([endpoints[i] for i in followers], prefix)
        b = EtcdEngine([endpoints[i] for i in range(3) if i != followers[0]], prefix)
        try:
            assert await a.start_replica(30.0) and await b.start_replica(30.0), "a replica did not load"
            counts = {a: 0, b: 0}
            stop = asyncio.Event()

            async def worker(engine: EtcdEngine, key: bytes) -> None:
                while not stop.is_set():
                    await _increment(engine, key)
                    await _increment(engine, b"shared")
                    counts[engine] += 1

            tasks = [asyncio.ensure_future(worker(a, b"a")), asyncio.ensure_future(worker(b, b"b"))]
            frozen = cluster.members[followers[0]].process
            try:
                await _until(lambda: counts[a] >= 3 and counts[b] >= 3, "no progress before the freeze", a)
                assert a.watch_index == 0
                frozen.send_signal(signal.SIGSTOP)
                try:
                    seen = dict(counts)
                    await _until(lambda: a.stats["replica_stalls"] >= 1,
                                 "A's stalled watch was not detected", a)
                    await _until(lambda: counts[a] >= seen[a] + 5 and counts[b] >= seen[b] + 5,
                                 "transactions stopped succeeding during the stall", a)
                finally:
                    frozen.send_signal(signal.SIGCONT)
            finally:
                stop.set()
                await asyncio.gather(*tasks)  # a failed run() fails the test here
            total = counts[a] + counts[b]
            assert await _read(a, b"shared") == b"%d" % total
            assert await _read(b, b"shared") == b"%d" % total
            await _until(lambda: a._replica is not None and a._replica.progress >= b.acked_revision,
                         "A's replica did not catch up with B's commits", a)
            speculative = a.stats["speculative"]
            await _increment(a, b"a")
            assert a.stats["speculative"] > speculative, a.stats
        finally:
            await a.close()
            await b.close()

    asyncio.run(body())
