"""Engine-specific behaviour: URLs, garbage collection, and SQLite across processes and crashes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import threefs
from threefs.common.status import KVConflictError, StatusCode, ThreeFSError
from threefs.kv import KVEngine, open_engine, register_engine
from threefs.kv.api import ENGINE_MODULES
from threefs.kv.memory import MemoryEngine
from threefs.kv import sqlite as sqlite_engine
from threefs.kv.sqlite import SqliteEngine

from tests.kv.conftest import FakeClock
from tests.kv.test_kv_model import SLOTS, STEPS, Model, step

REPO_ROOT = Path(threefs.__file__).resolve().parents[1]


async def open_fake(url: str) -> KVEngine:  # an engine registered by URL scheme, for the registry test
    return MemoryEngine()


@pytest.mark.parametrize(
    "url",
    ["etcd2://h:1", "memory", "memory://named", "sqlite://relative.db", "sqlite:///x.db?bogus=1",
     "sqlite:///x.db?sync=maybe", "/plain/path"],
)
def test_open_engine_rejects_bad_urls(url):
    with pytest.raises(ThreeFSError) as info:
        asyncio.run(open_engine(url))
    assert info.value.code == StatusCode.INVALID_ARGUMENT and url in str(info.value)


def test_registry_plugs_in_an_engine(monkeypatch):
    monkeypatch.setitem(ENGINE_MODULES, "fake", "")
    register_engine("fake", f"{__name__}:open_fake")
    engine = asyncio.run(open_engine("fake://anything"))
    assert isinstance(engine, MemoryEngine)


def stored_versions(engine: KVEngine) -> tuple[int, int]:
    """(rows of key history, commits in the write log) the engine still keeps."""
    if isinstance(engine, MemoryEngine):
        return sum(len(h) for h in engine._history.values()), len(engine._log)
    assert isinstance(engine, SqliteEngine)
    with sqlite3.connect(engine.path) as conn:
        return (conn.execute("SELECT count(*) FROM kv").fetchone()[0],
                conn.execute("SELECT count(*) FROM write_log").fetchone()[0])


def test_gc_drops_what_no_valid_reader_can_see(kv, clock):
    if kv.name.startswith("etcd"):
        pytest.skip("etcd keeps history itself (auto-compaction); its tombstone GC: tests/kv/test_kv_etcd.py")
    async def commit(engine, fn):
        tr = engine.transaction()
        fn(tr)
        return await tr.commit()

    async def body():
        engine = await kv.open(clock=clock)
        try:
            for i in range(5):
                await commit(engine, lambda tr: [tr.set(b"k%d" % j, b"v%d" % i) for j in range(10)])
            await commit(engine, lambda tr: (tr.clear_range(b"k3", b"k6"), tr.clear(b"k9"), tr.clear(b"none")))
            assert stored_versions(engine)[0] >= 50
            clock.advance(6.0)
            await commit(engine, lambda tr: tr.set(b"z", b"1"))  # GC: everything before is past the window
            clock.advance(6.0)
            await commit(engine, lambda tr: tr.set(b"z", b"2"))  # GC: the previous "z" too
            # left: the 6 live k keys, one version each; z's first version (the horizon: a reader at it may still
            # exist) and its second; the second commit's log entry
            assert stored_versions(engine) == (8, 1)
            rows = await engine.transaction().get_range(b"", b"\xff")
            assert rows == [(b"k%d" % j, b"v4") for j in (0, 1, 2, 6, 7, 8)] + [(b"z", b"2")]
        finally:
            await engine.close()

    asyncio.run(body())


def test_engine_rejects_reads_below_the_horizon(clock):
    async def body():
        engine = MemoryEngine(clock=clock)
        tr = engine.transaction()
        tr.set(b"a", b"1")
        first = await tr.commit()
        clock.advance(6.0)
        tr = engine.transaction()
        tr.set(b"a", b"2")
        await tr.commit()
        with pytest.raises(ThreeFSError) as info:
            engine.get_at(b"a", first - 1)  # the engine's own check, behind the transaction's age check
        assert info.value.code == StatusCode.KV_TOO_OLD

    asyncio.run(body())


def test_sqlite_sync_full_option(tmp_path):
    async def body():
        engine = await open_engine(f"sqlite:///{tmp_path}/a/b/kv.db?sync=full")
        assert isinstance(engine, SqliteEngine)
        assert engine._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        assert engine._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        await engine.close()

    asyncio.run(body())


def test_sqlite_conflicts_between_connections(tmp_path):
    async def body():
        url = f"sqlite:///{tmp_path}/kv.db"
        first, second = await open_engine(url), await open_engine(url)
        try:
            reader = first.transaction()
            assert await reader.get_range(b"a", b"z") == []
            writer = second.transaction()
            writer.set(b"m", b"1")
            await writer.commit()
            assert await reader.get(b"m") is None  # still its snapshot
            reader.set(b"out", b"1")
            with pytest.raises(KVConflictError):
                await reader.commit()
            assert await first.transaction().get(b"m") == b"1"
        finally:
            await first.close()
            await second.close()

    asyncio.run(body())


def spawn(script: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


INCREMENT_SCRIPT = """
    import asyncio, sys
    from threefs.kv import open_engine

    async def main(url, count):
        engine = await open_engine(url)
        attempts = 0

        async def increment(tr):
            nonlocal attempts
            attempts += 1
            value = int(await tr.get(b"counter") or b"0")
            await asyncio.sleep(0.001)  # widen the read-to-commit window: conflicts across processes
            tr.set(b"counter", b"%d" % (value + 1))

        for _ in range(count):
            await engine.run(increment)
        await engine.close()
        print(attempts)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def test_sqlite_processes_share_one_file(tmp_path):
    processes, increments = 4, 40
    url = f"sqlite:///{tmp_path}/shared/kv.db"  # not created yet: the processes race to create it too
    children = [spawn(INCREMENT_SCRIPT, url, str(increments)) for _ in range(processes)]
    attempts = 0
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        attempts += int(out)

    async def final() -> bytes | None:
        engine = await open_engine(url)
        try:
            return await engine.transaction().get(b"counter")
        finally:
            await engine.close()

    assert asyncio.run(final()) == b"%d" % (processes * increments)
    assert attempts >= processes * increments  # more when commits conflicted and were retried
    print(f"{processes} processes, {processes * increments} increments, {attempts} attempts")


CRASH_SCRIPT = """
    import asyncio, os, signal, sys
    from threefs.kv import open_engine

    async def main(url):
        engine = await open_engine(url)
        for i in range(20):
            tr = engine.transaction()
            tr.set(b"k%02d" % i, b"v%d" % i)
            await tr.commit()
        print("committed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no close(), no checkpoint: the WAL must carry the commits

    asyncio.run(main(sys.argv[1]))
"""


def test_sqlite_commits_survive_kill_9(tmp_path):
    url = f"sqlite:///{tmp_path}/kv.db"
    child = spawn(CRASH_SCRIPT, url)
    out, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL and out.strip() == "committed", err

    async def read() -> list:
        engine = await open_engine(url)
        try:
            return await engine.transaction().get_range(b"", b"\xff")
        finally:
            await engine.close()

    assert asyncio.run(read()) == [(b"k%02d" % i, b"v%d" % i) for i in range(20)]


def test_sqlite_refuses_a_file_it_cannot_use(tmp_path):
    (tmp_path / "not-a-db").write_bytes(b"this is not an SQLite file" * 100)
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as conn:
        conn.execute("PRAGMA user_version = 99")
    for path in (tmp_path / "not-a-db", newer):
        with pytest.raises(ThreeFSError) as info:
            asyncio.run(open_engine(f"sqlite://{path}"))
        assert info.value.code == StatusCode.KV_ERROR and str(path) in str(info.value)


def _shm_descriptors(db_path: Path) -> int:
    """How many of this process's descriptors are open on the database's -shm file."""
    shm = f"{db_path}-shm"
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == shm
        except OSError:
            pass
    return count


COMMIT_AND_TELL_SCRIPT = """
    import asyncio, sys
    from threefs.kv import open_engine

    async def main(url, count):
        engine = await open_engine(url)
        for i in range(1, count + 1):
            tr = engine.transaction()
            tr.set(b"counter", b"%d" % i)
            await tr.commit()
            print(i, flush=True)  # after COMMIT returned: a read that starts now must see it
            sys.stdin.readline()  # the reader checked
        await engine.close()

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def test_sqlite_newest_version_from_the_wal_index(tmp_path):
    """A read transaction with no commit since the engine's last version query asks SQLite nothing (the
    WAL-index header is unchanged); every commit that returned, in any process or engine, is seen by the next
    transaction all the same."""
    db = tmp_path / "kv.db"
    url = f"sqlite://{db}"

    async def body():
        first, second = await open_engine(url), await open_engine(url)
        assert first._shm is not None and first._shm is second._shm  # one mapping per process and file
        assert sqlite_engine._shm_maps[first._shm_key][2] == 2
        statements: list[str] = []
        first._conn.set_trace_callback(statements.append)
        try:
            tr = second.transaction()
            tr.set(b"counter", b"0")
            await tr.commit()
            assert await first.transaction().get(b"counter") == b"0"  # a commit since: one query
            assert len(statements) >= 1
            statements.clear()
            for _ in range(3):
                assert await first.transaction().get(b"counter") == b"0"
            assert statements == []  # nothing committed since: no statement at all

            await second.close()  # the other engine's end keeps the shared descriptor (and SQLite's locks)
            assert sqlite_engine._shm_maps[first._shm_key][2] == 1

            child = spawn(COMMIT_AND_TELL_SCRIPT, url, "200")
            try:
                for i in range(1, 201):
                    line = child.stdout.readline()
                    assert line.strip() == str(i), child.stderr.read() if not line else line
                    # The child's COMMIT returned before it printed: this transaction starts after it.
                    assert await first.transaction().get(b"counter") == b"%d" % i
                    child.stdin.write("\n")
                    child.stdin.flush()
                _, err = child.communicate(timeout=30)
                assert child.returncode == 0, err
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            statements.clear()
            tr = first.transaction()
            tr.set(b"counter", b"ours")
            await tr.commit()
            assert await first.transaction().get(b"counter") == b"ours"
        finally:
            await first.close()
            await second.close()
        assert _shm_descriptors(db) == 0  # the last engine on the file closed ours (and SQLite its own)
        assert sqlite_engine._shm_maps == {}

    asyncio.run(body())


class _EitherEngine:
    """Hands out each transaction from one of several engines, chosen by a seeded generator."""

    def __init__(self, engines: list[KVEngine], rng):
        self.engines, self.rng = engines, rng

    def transaction(self):
        return self.rng.choice(self.engines).transaction()


@pytest.mark.parametrize("seed", range(3))
def test_sqlite_two_engines_match_the_serial_model(tmp_path, seed):
    """The seeded model test (test_kv_model.py) with every transaction on one of two SQLite engines on one
    file (two meta servers on one KV): what each engine caches, and what it knows of the newest version, must
    follow the other's commits; the model checks the whole state after every commit, from either engine."""
    async def body():
        clock = FakeClock()
        engines = [SqliteEngine(f"{tmp_path}/kv.db", clock=clock) for _ in range(2)]
        try:
            rng = random.Random(seed)
            either = _EitherEngine(engines, random.Random(seed + 1000))
            model, slots, counter = Model(), [None] * SLOTS, [0]
            both_cached = 0  # steps after which both engines held cached values
            for _ in range(STEPS):
                await step(rng, model, either, slots, counter, clock)
                both_cached += all(engine._cache for engine in engines)
            for slot in slots:
                if slot is not None:
                    slot[0].cancel()
            assert len(model.log) > 50 and model.rejected > 10, (len(model.log), model.rejected)
            assert both_cached > STEPS // 4, both_cached  # not vacuous: the caches were in play
        finally:
            for engine in engines:
                await engine.close()

    asyncio.run(body())


def test_sqlite_commit_forgets_what_others_wrote_meanwhile(tmp_path):
    """An engine's commit made after another engine's commit (within one transaction of ours) keeps its read
    cache, minus what the other wrote: the next read sees the other's value, not the cached one."""
    async def body():
        url = f"sqlite:///{tmp_path}/kv.db"
        ours, theirs = await open_engine(url), await open_engine(url)
        try:
            tr = ours.transaction()
            tr.set(b"k", b"1")
            tr.set(b"j", b"x")
            await tr.commit()
            assert await ours.transaction().get(b"k") == b"1"  # cached from here on
            mine = ours.transaction()
            assert await mine.get(b"j") == b"x"  # its snapshot: before the other's commit
            other = theirs.transaction()
            other.set(b"k", b"2")
            await other.commit()
            mine.set(b"m", b"y")
            await mine.commit()  # no conflict (it read only j); the other's commit came between
            assert ours._cache.get(b"j") == b"x"  # the cache was kept...
            assert await ours.transaction().get(b"k") == b"2"  # ...without the value the other replaced
        finally:
            await ours.close()
            await theirs.close()

    asyncio.run(body())


class _AfterCommit:
    """A connection that runs `then()` right after its next COMMIT statement (before the engine looks at
    the WAL index again): another connection's commit landing in that gap."""

    def __init__(self, conn: sqlite3.Connection, then):
        self._conn, self._then = conn, then

    def execute(self, sql, *args):
        cursor = self._conn.execute(sql, *args)
        if sql == "COMMIT" and self._then is not None:
            then, self._then = self._then, None
            then()
        return cursor

    def __getattr__(self, name):
        return getattr(self._conn, name)


def test_sqlite_knows_its_own_commit_is_the_newest(tmp_path):
    """After its own commit an engine asks SQLite nothing for the next transaction's version (the WAL index's
    commit counter moved by exactly one), unless another connection committed in between."""
    async def body():
        url = f"sqlite:///{tmp_path}/kv.db"
        ours, theirs = await open_engine(url), await open_engine(url)
        statements: list[str] = []
        ours._conn.set_trace_callback(statements.append)
        try:
            assert await ours.transaction().get(b"k") is None  # the cache starts at the newest version
            tr = ours.transaction()
            tr.set(b"k", b"1")
            await tr.commit()
            statements.clear()
            assert await ours.transaction().get(b"k") == b"1"
            assert statements == []  # neither the version nor the value was asked for

            def theirs_commits() -> None:  # a plain call: the SQLite engine's commit never waits
                other = theirs.transaction()
                other.set(b"k", b"2")
                try:
                    other.commit().send(None)
                except StopIteration:
                    pass

            real = ours._conn
            ours._conn = _AfterCommit(real, theirs_commits)
            tr = ours.transaction()
            tr.set(b"j", b"x")
            await tr.commit()  # theirs commits right after our COMMIT
            ours._conn = real
            assert await ours.transaction().get(b"k") == b"2"  # not the cached b"1"
        finally:
            await ours.close()
            await theirs.close()

    asyncio.run(body())


def test_sqlite_maps_the_wal_index_of_a_database_reached_by_a_symlink(tmp_path):
    """SQLite keeps the -shm beside the file a symbolic link points to; the engine maps that one, so an
    engine opened through the link and one opened by the real path share it and see each other's commits."""
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "x.db"
    sqlite3.connect(real).close()
    (tmp_path / "kv.db").symlink_to(real)

    async def body():
        linked, direct = await open_engine(f"sqlite://{tmp_path}/kv.db"), await open_engine(f"sqlite://{real}")
        try:
            assert linked._shm is not None and linked._shm is direct._shm
            assert not (tmp_path / "kv.db-shm").exists()
            for engine, other, value in ((linked, direct, b"1"), (direct, linked, b"2")):
                tr = engine.transaction()
                tr.set(b"k", value)
                await tr.commit()
                assert await other.transaction().get(b"k") == value
        finally:
            await linked.close()
            await direct.close()

    asyncio.run(body())
