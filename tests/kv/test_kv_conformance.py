"""One conformance suite for every KV engine (see conftest.ENGINES): FoundationDB's semantics."""

from __future__ import annotations

import asyncio

import pytest

from threefs.common.status import KVConflictError, StatusCode, ThreeFSError
from threefs.kv import KEY_BYTES_MAX, TXN_BYTES_MAX, VALUE_BYTES_MAX, KVEngine, Transaction

KEYS = [b"k%d" % i for i in range(10)]


async def fill(engine: KVEngine, pairs: dict[bytes, bytes]) -> int:
    tr = engine.transaction()
    for key, value in pairs.items():
        tr.set(key, value)
    return await tr.commit()


async def read_all(engine: KVEngine) -> dict[bytes, bytes]:
    return dict(await engine.transaction().get_range(b"", b"\xff"))


def test_get_set_clear(kv):
    async def body(engine):
        assert await engine.transaction().get(b"a") is None
        await fill(engine, {b"a": b"1", b"b": b"", b"c": b"3"})
        tr = engine.transaction()
        assert (await tr.get(b"a"), await tr.get(b"b"), await tr.get(b"zz")) == (b"1", b"", None)
        tr.clear(b"a")
        tr.set(b"c", b"33")
        await tr.commit()
        assert await read_all(engine) == {b"b": b"", b"c": b"33"}

    kv.run(body)


def test_range_order_limit_reverse(kv):
    async def body(engine):
        await fill(engine, {k: k.upper() for k in reversed(KEYS)})
        tr = engine.transaction()
        assert [k for k, _ in await tr.get_range(b"", b"\xff")] == KEYS
        assert await tr.get_range(b"k2", b"k5") == [(b"k2", b"K2"), (b"k3", b"K3"), (b"k4", b"K4")]
        assert [k for k, _ in await tr.get_range(b"k2", b"k5", reverse=True)] == [b"k4", b"k3", b"k2"]
        assert [k for k, _ in await tr.get_range(b"", b"\xff", limit=3)] == KEYS[:3]
        assert [k for k, _ in await tr.get_range(b"", b"\xff", limit=3, reverse=True)] == KEYS[:-4:-1]
        assert len(await tr.get_range(b"", b"\xff", limit=50)) == 10
        assert await tr.get_range(b"k5", b"k5") == [] and await tr.get_range(b"k6", b"k5") == []
        assert await tr.get_range(b"k9\x00", b"\xff") == []
        with pytest.raises(ThreeFSError) as info:
            await tr.get_range(b"a", b"b", limit=-1)
        assert info.value.code == StatusCode.INVALID_ARGUMENT

    kv.run(body)


def test_read_your_writes_in_ranges(kv):
    async def body(engine):
        await fill(engine, {k: b"old" for k in KEYS})
        tr = engine.transaction()
        tr.set(b"k1", b"new")
        tr.clear(b"k2")
        tr.clear_range(b"k4", b"k8")  # k4..k7 gone ...
        tr.set(b"k5", b"back")  # ... but k5 written again after the clear
        tr.set(b"k3a", b"ins")
        tr.set(b"k0", b"x")
        tr.clear_range(b"k0", b"k1")  # a clear after a set wins
        expect = [(b"k1", b"new"), (b"k3", b"old"), (b"k3a", b"ins"), (b"k5", b"back"), (b"k8", b"old"),
                  (b"k9", b"old")]
        assert await tr.get_range(b"", b"\xff") == expect
        assert await tr.get_range(b"", b"\xff", reverse=True) == expect[::-1]
        for limit in range(1, 7):
            assert await tr.get_range(b"", b"\xff", limit=limit) == expect[:limit]
            assert await tr.get_range(b"", b"\xff", limit=limit, reverse=True) == expect[::-1][:limit]
        assert await tr.get(b"k0") is None and await tr.get(b"k6") is None and await tr.get(b"k5") == b"back"
        assert await tr.get_range(b"k4", b"k5") == []
        await tr.commit()
        assert list((await read_all(engine)).items()) == expect

    kv.run(body)


def test_snapshot_isolation(kv):
    async def body(engine):
        await fill(engine, {b"a": b"1", b"b": b"1"})
        reader = engine.transaction()
        assert await reader.get(b"a") == b"1"
        writer = engine.transaction()
        writer.set(b"a", b"2")
        writer.set(b"c", b"2")
        writer.clear(b"b")
        assert await writer.commit() > reader.read_version
        assert await reader.get(b"a") == b"1" and await reader.get(b"b") == b"1"
        assert await reader.get_range(b"", b"\xff") == [(b"a", b"1"), (b"b", b"1")]
        assert await engine.transaction().get_range(b"", b"\xff") == [(b"a", b"2"), (b"c", b"2")]

    kv.run(body)


async def race(engine: KVEngine, read, write) -> None:
    """`read(t1)`, then a transaction doing `write(t2)` commits, then t1 writes and commits."""
    t1 = engine.transaction()
    await read(t1)
    t2 = engine.transaction()
    write(t2)
    await t2.commit()
    t1.set(b"out", b"1")
    await t1.commit()


def conflicts(kv, read, write) -> bool:
    async def body(engine):
        tr = engine.transaction()
        tr.clear_range(b"", b"\xff")  # durable engines keep the previous call's store
        for key in (b"a", b"m", b"n", b"z"):
            tr.set(key, b"1")
        await tr.commit()
        try:
            await race(engine, read, write)
        except KVConflictError as exc:
            assert exc.code == StatusCode.KV_CONFLICT and exc.retryable
            return True
        return False

    return kv.run(body)


def test_conflict_on_key(kv):
    async def get_m(tr):
        await tr.get(b"m")

    assert conflicts(kv, get_m, lambda tr: tr.set(b"m", b"2"))
    assert conflicts(kv, get_m, lambda tr: tr.clear(b"m"))
    assert conflicts(kv, get_m, lambda tr: tr.clear_range(b"l", b"mm"))
    assert not conflicts(kv, get_m, lambda tr: tr.set(b"m\x00", b"2"))


def test_conflict_on_range_including_deletes(kv):
    async def scan(tr):
        await tr.get_range(b"b", b"y")

    assert conflicts(kv, scan, lambda tr: tr.set(b"c", b"new"))  # a phantom insert
    assert conflicts(kv, scan, lambda tr: tr.clear(b"n"))  # a delete inside
    assert conflicts(kv, scan, lambda tr: tr.clear_range(b"x", b"zz"))  # a range delete overlapping the end
    assert conflicts(kv, scan, lambda tr: tr.clear_range(b"c", b"d"))  # even where nothing existed
    assert not conflicts(kv, scan, lambda tr: tr.set(b"y", b"2"))  # end is exclusive
    assert not conflicts(kv, scan, lambda tr: tr.clear_range(b"", b"b"))


def test_limited_range_conflicts_up_to_last_key_returned(kv):
    async def first_two(tr):
        assert [k for k, _ in await tr.get_range(b"a", b"z", limit=2)] == [b"a", b"m"]

    async def last_two(tr):
        assert [k for k, _ in await tr.get_range(b"a", b"zz", limit=2, reverse=True)] == [b"z", b"n"]

    assert conflicts(kv, first_two, lambda tr: tr.set(b"b", b"2"))
    assert not conflicts(kv, first_two, lambda tr: tr.set(b"m\x00", b"2"))
    assert not conflicts(kv, first_two, lambda tr: tr.clear(b"n"))
    assert conflicts(kv, last_two, lambda tr: tr.set(b"p", b"2"))
    assert not conflicts(kv, last_two, lambda tr: tr.set(b"mz", b"2"))


def test_no_conflict_for_snapshot_reads_or_disjoint_ranges(kv):
    async def snapshot_reads(tr):
        await tr.get(b"m", snapshot=True)
        await tr.get_range(b"a", b"z", snapshot=True)

    async def left(tr):
        await tr.get_range(b"a", b"m")

    assert not conflicts(kv, snapshot_reads, lambda tr: tr.set(b"m", b"2"))
    assert not conflicts(kv, left, lambda tr: tr.clear_range(b"m", b"zz"))
    assert not conflicts(kv, left, lambda tr: tr.set(b"out", b"2"))  # blind writes of the same key don't conflict


def test_explicit_conflict_keys_and_ranges(kv):
    async def get_a(tr):
        await tr.get(b"a")

    async def declare_key(tr):
        tr.add_read_conflict_key(b"q")

    async def declare_range(tr):
        tr.add_read_conflict_range(b"p", b"r")

    assert conflicts(kv, get_a, lambda tr: tr.add_write_conflict_key(b"a"))
    assert not conflicts(kv, get_a, lambda tr: tr.add_write_conflict_key(b"b"))
    assert conflicts(kv, declare_key, lambda tr: tr.set(b"q", b"1"))
    assert conflicts(kv, declare_range, lambda tr: tr.clear(b"q5"))
    assert not conflicts(kv, declare_range, lambda tr: tr.clear(b"r"))

    async def body(engine):  # a write-conflict key writes nothing
        tr = engine.transaction()
        tr.add_write_conflict_key(b"ghost")
        await tr.commit()
        assert await engine.transaction().get(b"ghost") is None

    kv.run(body)


def test_run_retries_under_contention(kv):
    async def body(engine):
        attempts = 0

        async def increment(tr: Transaction) -> int:
            nonlocal attempts
            attempts += 1
            value = int(await tr.get(b"counter") or b"0")
            await asyncio.sleep(0)  # let the others read the same value: real conflicts
            tr.set(b"counter", b"%d" % (value + 1))
            return value + 1

        results = await asyncio.gather(*(engine.run(increment) for _ in range(20)))
        assert sorted(results) == list(range(1, 21))
        assert await engine.transaction().get(b"counter") == b"20"
        assert attempts > 20  # contention happened and was retried

    kv.run(body)


def test_run_gives_up_and_reraises(kv):
    async def body(engine):
        calls = 0

        async def always_conflicts(tr):
            nonlocal calls
            calls += 1
            raise KVConflictError(StatusCode.KV_CONFLICT, "synthetic")

        with pytest.raises(KVConflictError):
            await engine.run(always_conflicts, retries_max=3)
        assert calls == 4

        async def broken(tr):
            nonlocal calls
            calls += 1
            raise ValueError("not retryable")

        calls = 0
        with pytest.raises(ValueError):
            await engine.run(broken)
        assert calls == 1

        async def slow(tr):
            await asyncio.sleep(10)

        with pytest.raises(ThreeFSError) as info:
            await engine.run(slow, timeout_s=0.05)
        assert info.value.code == StatusCode.TIMEOUT and isinstance(info.value, TimeoutError)

    kv.run(body)


def test_limits_raise_too_large(kv):
    async def body(engine):
        tr = engine.transaction()
        too_long = b"k" * (KEY_BYTES_MAX + 1)
        for call in (lambda: tr.set(too_long, b"v"), lambda: tr.clear(too_long),
                     lambda: tr.add_write_conflict_key(too_long)):
            with pytest.raises(ThreeFSError) as info:
                call()
            assert info.value.code == StatusCode.KV_TOO_LARGE and str(KEY_BYTES_MAX) in str(info.value)
        with pytest.raises(ThreeFSError) as info:
            tr.set(b"k", b"v" * (VALUE_BYTES_MAX + 1))
        assert info.value.code == StatusCode.KV_TOO_LARGE and str(VALUE_BYTES_MAX + 1) in str(info.value)
        tr.set(b"k" * KEY_BYTES_MAX, b"v" * VALUE_BYTES_MAX)  # the limits themselves are allowed
        value = b"v" * VALUE_BYTES_MAX
        with pytest.raises(ThreeFSError) as info:
            for i in range(TXN_BYTES_MAX // VALUE_BYTES_MAX + 1):
                tr.set(b"%d" % i, value)
        assert info.value.code == StatusCode.KV_TOO_LARGE and str(TXN_BYTES_MAX) in str(info.value)
        with pytest.raises(ThreeFSError) as info:
            tr.set("text key", b"v")  # type: ignore[arg-type]
        assert info.value.code == StatusCode.INVALID_ARGUMENT
        with pytest.raises(ThreeFSError) as info:
            await engine.transaction().get(too_long)
        assert info.value.code == StatusCode.KV_TOO_LARGE
        reader = engine.transaction()  # read-conflict ranges count toward TXN_BYTES_MAX too
        keys = [b"%05d" % i + b"k" * (KEY_BYTES_MAX - 5) for i in range(TXN_BYTES_MAX // (2 * KEY_BYTES_MAX) + 1)]
        errors = []
        for start in range(0, len(keys), 50):  # 50 reads at a time: one by one, 500 etcd round trips
            results = await asyncio.gather(*(reader.get(k) for k in keys[start:start + 50]),  # outlast the
                                           return_exceptions=True)  # MVCC window on a loaded machine
            errors += [r for r in results if isinstance(r, BaseException)]
            if errors:
                break
        assert errors and all(isinstance(e, ThreeFSError) and e.code == StatusCode.KV_TOO_LARGE for e in errors), errors
        assert len(await reader.get_range(b"", b"\xff", snapshot=True)) == 0  # snapshot reads add no ranges

    kv.run(body)


def test_versions_and_lifecycle(kv):
    async def body(engine):
        versions = [await fill(engine, {b"a": b"%d" % i}) for i in range(5)]
        assert versions == sorted(set(versions))
        tr = engine.transaction()
        assert await tr.get(b"a") == b"4"
        assert tr.read_version == versions[-1]
        assert await tr.commit() == versions[-1]  # read-only: trivial, at the read version
        with pytest.raises(ThreeFSError) as info:
            await tr.get(b"a")
        assert info.value.code == StatusCode.KV_ERROR and "committed" in str(info.value)
        tr = engine.transaction()
        tr.set(b"a", b"dropped")
        tr.cancel()
        with pytest.raises(ThreeFSError) as info:
            await tr.commit()
        assert info.value.code == StatusCode.CANCELLED
        failed = engine.transaction()
        await failed.get(b"a")
        await fill(engine, {b"a": b"5"})
        failed.set(b"b", b"1")
        with pytest.raises(KVConflictError):
            await failed.commit()
        with pytest.raises(ThreeFSError):
            failed.set(b"b", b"2")  # a failed transaction is not reused; run() makes a new one
        assert await read_all(engine) == {b"a": b"5"}

    kv.run(body)


def test_too_old_and_gc_keep_reads_correct(kv, clock):
    async def body():
        engine = await kv.open(clock=clock)
        try:
            await fill(engine, {k: b"v1" for k in KEYS})
            await fill(engine, {b"k1": b"v2"})
            tr = engine.transaction()
            tr.clear_range(b"k5", b"k8")
            tr.clear(b"k2")
            await tr.commit()
            old = engine.transaction()
            assert await old.get(b"k1") == b"v2"
            clock.advance(6.0)
            with pytest.raises(ThreeFSError) as info:
                await old.get(b"k3")
            assert info.value.code == StatusCode.KV_TOO_OLD and info.value.retryable
            await fill(engine, {b"k9": b"v3"})  # its commit garbage-collects the versions above
            clock.advance(6.0)
            await fill(engine, {b"k0": b"v3"})  # ... and this one the previous commit's
            expect = {k: b"v1" for k in KEYS if k not in (b"k2", b"k5", b"k6", b"k7")}
            expect.update({b"k1": b"v2", b"k9": b"v3", b"k0": b"v3"})
            assert await read_all(engine) == expect
            assert [k for k, _ in await engine.transaction().get_range(b"", b"\xff", reverse=True)] == sorted(
                expect, reverse=True)
            # a writer whose read is too old cannot commit: its conflicts can no longer be checked
            stale = engine.transaction()
            await stale.get(b"k0")
            clock.advance(6.0)
            stale.set(b"k0", b"lost")
            with pytest.raises(ThreeFSError) as info:
                await stale.commit()
            assert info.value.code == StatusCode.KV_TOO_OLD
        finally:
            await engine.close()

    asyncio.run(body())


def test_durable_across_reopen(kv):
    if not kv.spec.durable:
        pytest.skip(f"engine {kv.name} is not durable")
    kv.run(lambda engine: fill(engine, {b"a": b"1", b"b": b"2"}))
    assert kv.run(read_all) == {b"a": b"1", b"b": b"2"}
