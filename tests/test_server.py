"""The service process's supervision of its background loops (threefs/server.py)."""

from __future__ import annotations

import asyncio

from threefs.server import _supervise


def test_a_loop_that_dies_ends_the_service_and_says_why():
    async def main():
        cancelled = []

        async def heartbeat_loop():
            try:
                await asyncio.sleep(3600)
            finally:
                cancelled.append("heartbeat")

        async def resync_loop():
            await asyncio.sleep(0.01)
            raise RuntimeError("disk on fire")

        why = await asyncio.wait_for(_supervise("storage-1", [heartbeat_loop(), resync_loop()],
                                                asyncio.Event()), 10)
        assert why is not None and "resync_loop" in why and "disk on fire" in why
        assert cancelled == ["heartbeat"]  # the other loops are stopped, not left running

    asyncio.run(main())


def test_a_loop_that_returns_is_a_death_too():
    async def main():
        async def gc_loop():
            return None

        why = await asyncio.wait_for(_supervise("meta-1", [gc_loop()], asyncio.Event()), 10)
        assert why is not None and "gc_loop" in why and "ended" in why

    asyncio.run(main())


def test_a_clean_stop_cancels_every_loop():
    async def main():
        stop, cancelled = asyncio.Event(), []

        async def loop(name):
            try:
                await asyncio.sleep(3600)
            finally:
                cancelled.append(name)

        asyncio.get_running_loop().call_later(0.05, stop.set)
        assert await asyncio.wait_for(_supervise("mgmtd-1", [loop("a"), loop("b")], stop), 10) is None
        assert sorted(cancelled) == ["a", "b"]

    asyncio.run(main())


def test_mgmtd_opens_etcd_without_the_replica_unless_asked():
    from threefs.kv.etcd import parse_etcd_options, parse_etcd_url
    from threefs.server import mgmtd_kv_url

    for url, replica in [("etcd://h:1,h:2/p", False), ("etcd://h:1/p?replica=on", True),
                         ("etcd://h:1/p?replica=off", False), ("etcd://h:1", False)]:
        got = mgmtd_kv_url(url)
        parse_etcd_url(got)  # still a valid URL
        assert parse_etcd_options(got).get("replica", True) is replica, (url, got)
    assert mgmtd_kv_url("sqlite:///x/kv.db") == "sqlite:///x/kv.db"
