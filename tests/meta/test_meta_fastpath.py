"""The fast metadata path (docs/meta.md "Where a call's time goes"): calls from the caller's thread on
blocking connections, the batched end of untouched write sessions, and the SQLite engine's exact read cache.
Each test checks that a shortcut answers exactly what the long way answers."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest
from meta_helpers import run

from threefs.client.client import DEFERRED_CLOSES_MAX, Client
from threefs.client.meta_sync import RECENT_S
from threefs.common.status import StatusCode, ThreeFSError
from threefs.kv import open_engine
from threefs.meta import schema
from threefs.meta.store import Caller, MetaStore
from threefs.rpc.schemas.mgmtd import META
from threefs.testing.checks import stat_answers

WRITE_NEW = os.O_CREAT | os.O_EXCL | os.O_WRONLY


def _wait(pred, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout} s")
        time.sleep(0.02)


# -- the SQLite read cache: two engines on one file are two processes sharing a KV ----------------------------


def test_sqlite_read_cache_sees_every_commit_of_another_engine(tmp_path):
    url = f"sqlite:///{tmp_path}/kv.db"

    async def main():
        a, b = await open_engine(url), await open_engine(url)
        try:
            async def put(eng, key, value):
                async def fn(tr):
                    tr.set(key, value)
                await eng.run(fn)

            async def get(eng, key):
                return await eng.run(lambda tr: tr.get(key, snapshot=True))

            await put(a, b"k", b"1")
            assert await get(a, b"k") == b"1"  # cached by a at its newest version
            assert await get(a, b"k") == b"1"
            await put(b, b"k", b"2")  # another "process" commits
            assert await get(a, b"k") == b"2"
            await put(a, b"k", b"3")  # a's own commit moves its cache forward
            assert await get(a, b"k") == b"3"
            assert await get(b, b"k") == b"3"

            async def clear(tr):
                tr.clear_range(b"j", b"l")
            await a.run(clear)
            assert await get(a, b"k") is None and await get(b, b"k") is None
            assert await get(a, b"absent") is None  # a cached absence
            await put(b, b"absent", b"here")
            assert await get(a, b"absent") == b"here"

            # an older snapshot keeps reading its own version, never the cache of a newer one
            old = a.transaction()
            assert await old.get(b"k2") is None
            await put(a, b"k2", b"new")
            assert await get(a, b"k2") == b"new"
            assert await old.get(b"k2", snapshot=True) is None
            old.cancel()
        finally:
            await a.close()
            await b.close()

    run(main())


def test_sqlite_read_cache_keeps_conflicts(tmp_path):
    """A read answered from the cache is still conflict-tracked: a commit in between makes the writer retry."""
    url = f"sqlite:///{tmp_path}/kv.db"

    async def main():
        a, b = await open_engine(url), await open_engine(url)
        try:
            async def init(tr):
                tr.set(b"n", b"0")
            await a.run(init)
            await a.run(lambda tr: tr.get(b"n"))  # now in a's cache
            tr = a.transaction()
            assert await tr.get(b"n") == b"0"  # from the cache, at the current version

            async def bump(t):
                t.set(b"n", b"1")
            await b.run(bump)
            tr.set(b"n", b"from-a")
            with pytest.raises(ThreeFSError) as err:
                await tr.commit()
            assert err.value.code == StatusCode.KV_CONFLICT
        finally:
            await a.close()
            await b.close()

    run(main())


def test_sqlite_read_cache_matches_a_model_under_two_writers(tmp_path, rng):
    """Seeded: two engines on one file set, clear and clear ranges of a few keys in random order and read
    them back; every read equals a plain dict's answer, and a key nobody wrote since stays cached."""
    url = f"sqlite:///{tmp_path}/kv.db"
    keys = [b"k%02d" % i for i in range(12)]

    async def main():
        engines = [await open_engine(url), await open_engine(url)]
        model: dict[bytes, bytes] = {}
        try:
            for step in range(400):
                eng = engines[rng.randrange(2)]
                op = rng.random()
                if op < 0.35:
                    key, value = rng.choice(keys), b"v%d" % step

                    async def put(tr, key=key, value=value):
                        tr.set(key, value)
                    await eng.run(put)
                    model[key] = value
                elif op < 0.45:
                    key = rng.choice(keys)

                    async def drop(tr, key=key):
                        tr.clear(key)
                    await eng.run(drop)
                    model.pop(key, None)
                elif op < 0.5:
                    a, b = sorted(rng.sample(keys, 2))

                    async def drop_range(tr, a=a, b=b):
                        tr.clear_range(a, b)
                    await eng.run(drop_range)
                    for k in [k for k in model if a <= k < b]:
                        del model[k]
                else:
                    key = rng.choice(keys)
                    got = await eng.run(lambda tr, key=key: tr.get(key, snapshot=rng.random() < 0.5))
                    assert got == model.get(key), (step, key)
            statements = [0]
            a, b = engines
            await a.run(lambda tr: tr.get(keys[0]))  # cached by a

            async def other(tr):
                tr.set(keys[1], b"x")
            await b.run(other)
            a._conn.set_trace_callback(lambda q: statements.__setitem__(0, statements[0] + 1))
            assert await a.run(lambda tr: tr.get(keys[0])) == model.get(keys[0])
            assert statements[0] == 1  # the read version only: b's commit did not touch keys[0]
            assert await a.run(lambda tr: tr.get(keys[1])) == b"x"
        finally:
            for e in engines:
                await e.close()

    run(main())


# -- ending untouched sessions in a batch (MetaStore) ---------------------------------------------------------


def test_end_sessions_ends_only_the_sessions(tmp_path):
    async def main():
        kv = await open_engine(f"sqlite:///{tmp_path}/m.db")
        store = MetaStore(kv, table_info=lambda t: (t, 1, 4))
        try:
            await store.init()
            await store.mkdir("/d")
            mine = await store.open("/d/a", WRITE_NEW, caller=Caller(client_id="me", request_id=1))
            theirs = await store.open("/d/b", WRITE_NEW, caller=Caller(client_id="other", request_id=1))
            written = await store.open("/d/c", WRITE_NEW, caller=Caller(client_id="me", request_id=2))
            await store.close(written.attr.inode, written.session, 5, "me")
            before = [await store.stat(f"/d/{n}") for n in "abc"]
            ended = await store.end_sessions([(mine.attr.inode, mine.session),
                                              (theirs.attr.inode, theirs.session),  # another client's
                                              (written.attr.inode, written.session),  # already closed
                                              (mine.attr.inode, mine.session)], "me")  # twice
            assert ended == 1
            assert [await store.stat(f"/d/{n}") for n in "abc"] == before  # nothing but sessions changed

            async def sessions(tr):
                return [k for k, _ in await tr.get_range(*schema.session_range(mine.attr.inode))] + \
                    [k for k, _ in await tr.get_range(*schema.session_range(theirs.attr.inode))]
            left = await kv.run(sessions)
            assert left == [schema.session_key(theirs.attr.inode, theirs.session)]
            with pytest.raises(ThreeFSError) as err:
                await store.end_sessions([(1, "")], "me")
            assert err.value.code == StatusCode.INVALID_ARGUMENT
        finally:
            await kv.close()

    run(main())


# -- the client library on a cluster --------------------------------------------------------------------------


def test_untouched_close_costs_no_round_trip_and_the_session_ends(fs, d):
    """Closing files nothing was written to leaves length and times alone; their sessions end in a batch
    soon after (the loop's timer) or at once when a batch is full."""
    before = fs.stat(d)
    for i in range(3):
        with fs.open(f"{d}/e{i}", "xb"):
            pass
    with fs.open(f"{d}/full", "wb") as f:
        f.write(b"x" * 1000)
    attr = fs.stat(f"{d}/full")
    assert attr.length == 1000
    with fs.open(f"{d}/full", "r+b"):  # opened for writing, left untouched
        pass
    after = fs.stat(f"{d}/full")
    assert (after.length, after.mtime_ns, after.ctime_ns) == (attr.length, attr.mtime_ns, attr.ctime_ns)
    assert [fs.stat(f"{d}/e{i}").length for i in range(3)] == [0, 0, 0]
    assert fs.stat(d).mtime_ns >= before.mtime_ns
    _wait(lambda: not fs._deferred, "the timer's batch")
    for i in range(DEFERRED_CLOSES_MAX + 1):  # one full batch goes at once, from the caller's thread
        with fs.open(f"{d}/m{i}", "xb"):
            pass
        assert len(fs._deferred) < DEFERRED_CLOSES_MAX  # a full batch never waits for the timer
    _wait(lambda: not fs._deferred, "the timer's batch")
    assert len(fs.listdir(d)) == 3 + 1 + DEFERRED_CLOSES_MAX + 1


def test_stat_after_writes_by_another_client_is_never_stale(cluster, fs, d, rng):
    """The library caches no attributes: what one client's close published, another's next stat shows."""
    other = Client.connect(str(cluster.client_config_path))
    try:
        for i in range(12):
            size = rng.randrange(1, 20_000)
            writer, reader = (fs, other) if i % 2 else (other, fs)
            with writer.open(f"{d}/f", "wb") as f:
                f.write(os.urandom(size))
            assert reader.stat(f"{d}/f").length == size
            writer.truncate(f"{d}/f", size // 2)
            assert reader.stat(f"{d}/f").length == size // 2
    finally:
        other.close()


def test_many_threads_share_the_pool_and_fall_back_to_the_loop(fs, d):
    """More threads than pooled connections: the rest take the loop's connection; every call answers."""
    errors, n_threads = [], 24

    def work(t: int) -> None:
        try:
            for i in range(15):
                path = f"{d}/t{t}-{i}"
                with fs.open(path, "xb"):
                    pass
                assert fs.stat(path).length == 0
                fs.remove(path)
                with pytest.raises(FileNotFoundError):
                    fs.stat(path)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert fs.listdir(d) == []


def test_calls_survive_a_meta_restart_and_fail_over(private_cluster):
    """A pooled connection to a meta server that restarted is replaced without an error, also when it is
    used without the liveness poll (given back recently: the call fails on it and runs again on a fresh
    one); with one of two servers down, calls go to the other (same request ids, so nothing acts twice)."""
    c = private_cluster(meta=2)
    fs = Client.connect(str(c.client_config_path))
    try:
        fs.mkdir("/r")
        for i in range(8):  # connections to the server this client keeps to are pooled now
            with fs.open(f"/r/a{i}", "xb"):
                pass
        kept_id = fs._sync._keep_to
        kept, other = (("meta-1", "meta-2") if kept_id == 51 else ("meta-2", "meta-1"))
        addr = next(n.addr for n in fs.aio.mgmtd.routing.nodes_of_type(META) if n.node_id == kept_id)
        c.kill(kept)
        c.up()
        _wait(lambda: _listening(addr), f"{kept} listening at {addr} again", 60)
        _wait(lambda: {n.node_id for n in fs.aio.mgmtd.routing.nodes_of_type(META)} == {51, 52},
              "both meta servers in the client's routing again", 60)
        pool = fs._sync._pool
        dead = list(pool._idle[addr])
        assert dead
        pool.recent_s = 3600  # the pooled connections are used unpolled: a call fails on one...
        for i in range(8):
            assert fs.stat(f"/r/a{i}").length == 0  # ...and runs again on a fresh one
        assert set(map(id, dead)) - set(map(id, pool._idle[addr]))  # a dead one was taken and dropped
        pool.recent_s = RECENT_S
        c.kill(other)
        _wait(lambda: stat_answers(fs, "/r/a0"), f"a call failing over to {kept}", 60)  # routing converges
        for i in range(8):
            fs.remove(f"/r/a{i}")
            with pytest.raises(FileNotFoundError):
                fs.stat(f"/r/a{i}")
        assert fs.listdir("/r") == []
    finally:
        fs.close()


def _listening(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_forked_child_uses_its_own_connections(fs, d):
    """After fork the child's calls open their own connections (the parent's sockets stay the parent's)."""
    with fs.open(f"{d}/before", "xb"):
        pass
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if its calls worked
        code = 1
        try:
            with fs.open(f"{d}/child", "xb"):
                pass
            code = 0 if fs.stat(f"{d}/child").length == 0 and fs.stat(f"{d}/before").length == 0 else 2
            fs.close()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child did not finish in 60 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fs.stat(f"{d}/child").length == 0  # the parent's connections still work
    assert sorted(fs.listdir(d)) == ["before", "child"]


def test_engine_without_loop_thread_check(fs):
    """A blocking call from inside the client's own event loop is refused, as before (not a hang)."""
    async def inner():
        fs.stat("/")

    with pytest.raises(RuntimeError):
        fs._loop.run(_call_in_loop(inner))


async def _call_in_loop(fn):
    await asyncio.sleep(0)
    await fn()
