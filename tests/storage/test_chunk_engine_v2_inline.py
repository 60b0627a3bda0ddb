"""Updates on an event loop's thread (ChunkEngineV2.inline): a storage service runs small writes and commits
right on its loop when they only write into the page cache, and hands everything else to a disk thread.

What must hold, on a real engine with real files: what needs the disk (a write that reads a chunk's older
bytes, a commit that folds an overlay, an update of a chunk another thread is updating, the journal's flush
into SQLite) raises BlockingIOError instead of waiting, and the same call run again in a thread ends exactly
as if it had run there first; a target written this way reopens consistent with every committed byte. And
the storage service really runs them inline (its counters), with the cluster's data correct."""

from __future__ import annotations

import threading

import pytest

from threefs.storage import chunk_engine_v2
from threefs.storage.chunk_engine_v2 import ChunkEngineV2
from threefs.storage.target_check import check_target

CHUNK = 64 * 1024


def cid(i: int) -> bytes:
    return bytes(8) + i.to_bytes(8, "big")


def inline_or_thread(eng: ChunkEngineV2, call):
    """What the storage service does: try inline; on BlockingIOError run it plainly. Returns (result,
    whether it ran inline)."""
    try:
        with eng.inline():
            return call(), True
    except BlockingIOError:
        return call(), False


def write(eng, c, ver, offset, data, **kw):
    return lambda: eng.write(c, update_ver=ver, chain_ver=1, offset=offset, data=data, chunk_size=CHUNK, **kw)


def test_page_cache_updates_run_inline_the_rest_is_handed_over(tmp_path):
    eng = ChunkEngineV2(str(tmp_path / "t"))
    x = cid(1)
    expect = bytearray()
    steps = [  # (offset, data, runs inline)
        (0, b"a" * 3000, True),          # a new chunk (a 4 KiB block)
        (3000, b"b" * 500, True),        # an append inside the chunk's block
        (0, b"c" * 5000, True),          # an overwrite from 0 covering the chunk
        (1000, b"d" * 500, False),       # an overwrite inside: an overlay, reads the bytes it replaces
        (3000, b"e" * 4000, False),      # from inside past the end: a new block, older bytes copied
    ]
    for ver, (offset, data, inline) in enumerate(steps, start=1):
        _, ran_inline = inline_or_thread(eng, write(eng, x, ver, offset, data))
        assert ran_inline == inline, (offset, len(data))
        end = offset + len(data)
        expect[offset:end] = data
        meta = eng.get_meta(x)
        if meta.update_ver == ver and (meta.commit_ver < ver):
            pending_ov = eng._get(x).p.ov is not None
            _, commit_inline = inline_or_thread(eng, lambda: eng.commit(x, ver))
            assert commit_inline == (not pending_ov)  # a commit that folds an overlay goes to a thread
        assert eng.read(x, 0, CHUNK)[0] == bytes(expect)
        assert eng.verify(x)
    eng.close()
    reopened = ChunkEngineV2(str(tmp_path / "t"))
    assert reopened.read(x, 0, CHUNK)[0] == bytes(expect)
    reopened.close()
    report = check_target(str(tmp_path / "t"))
    assert report.ok, "\n".join(report.lines())


def test_a_handed_over_write_ends_as_a_plain_one(tmp_path):
    """The write that raises after dropping the chunk's pending version: its rerun in a thread leaves the
    same state as the same write on an engine that never tried inline."""
    a, b = ChunkEngineV2(str(tmp_path / "a")), ChunkEngineV2(str(tmp_path / "b"))
    x = cid(1)
    for eng in (a, b):
        eng.write(x, update_ver=1, chain_ver=1, offset=0, data=b"a" * 8192, chunk_size=CHUNK)
        eng.commit(x, 1)
        eng.write(x, update_ver=2, chain_ver=1, offset=0, data=b"p" * 100, chunk_size=CHUNK)  # left pending
    with pytest.raises(BlockingIOError):
        with a.inline():
            a.write(x, update_ver=3, chain_ver=1, offset=2000, data=b"z" * 300, chunk_size=CHUNK)
    a.write(x, update_ver=3, chain_ver=1, offset=2000, data=b"z" * 300, chunk_size=CHUNK)
    b.write(x, update_ver=3, chain_ver=1, offset=2000, data=b"z" * 300, chunk_size=CHUNK)
    for eng in (a, b):
        eng.commit(x, 3)
    assert a.get_meta(x) == b.get_meta(x)
    assert a.read(x, 0, CHUNK)[0] == b.read(x, 0, CHUNK)[0] == b"a" * 2000 + b"z" * 300 + b"a" * 5892
    for name, eng in (("a", a), ("b", b)):
        eng.close()
        report = check_target(str(tmp_path / name))
        assert report.ok, "\n".join(report.lines())


def test_an_update_of_a_busy_chunk_is_handed_over_without_waiting(tmp_path):
    eng = ChunkEngineV2(str(tmp_path / "t"))
    x = cid(1)
    inside, release = threading.Event(), threading.Event()
    real_pwrite = eng._pwrite

    def held_pwrite(pos, offset, buffers):
        if threading.current_thread().name == "held" and not inside.is_set():
            inside.set()
            assert release.wait(30)
        return real_pwrite(pos, offset, buffers)

    eng._pwrite = held_pwrite
    held = threading.Thread(name="held", target=write(eng, x, 1, 0, b"a" * 4096))
    held.start()
    assert inside.wait(30)
    with pytest.raises(BlockingIOError):  # at once: the loop's thread must not wait for the other update
        with eng.inline():
            eng.write(x, update_ver=2, chain_ver=1, offset=0, data=b"b" * 4096, chunk_size=CHUNK)
    assert eng._waiters == 0
    release.set()
    held.join(30)
    eng.commit(x, 1)
    assert eng.read(x, 0, 4096)[0] == b"a" * 4096
    eng.close()


def test_inline_updates_leave_the_journal_flush_to_a_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(chunk_engine_v2, "JOURNAL_FLUSH_RECORDS", 16)
    eng = ChunkEngineV2(str(tmp_path / "t"))
    flushes = []
    real_flush = eng._write_store

    def counted(*args):
        flushes.append(threading.current_thread().name)
        return real_flush(*args)

    eng._write_store = counted
    for i in range(200):  # far past the forced-flush limit (4 x 16 records)
        with eng.inline():
            eng.write(cid(i), update_ver=1, chain_ver=1, offset=0, data=bytes([i]) * 512, chunk_size=CHUNK)
            eng.commit(cid(i), 1)
    assert flushes == [] and eng.flush_due
    t = threading.Thread(name="disk", target=eng.flush_owed)
    t.start()
    t.join(30)
    assert flushes == ["disk"] and not eng.flush_due
    eng.close()
    reopened = ChunkEngineV2(str(tmp_path / "t"))
    assert all(reopened.read(cid(i), 0, 512)[0] == bytes([i]) * 512 for i in range(200))
    reopened.close()


def test_no_inline_updates_with_fsync(tmp_path):
    eng = ChunkEngineV2(str(tmp_path / "t"), fsync=True)
    assert not eng.inline_capable
    with pytest.raises(BlockingIOError):
        with eng.inline():
            pass
    eng.close()


def test_the_storage_service_runs_small_updates_inline(private_cluster, rng):
    """On real storage processes: small writes run inline at every replica (the services' counters, read
    through their status), a large one goes to the disk threads, and every replica holds the bytes."""
    from threefs.client.client import Client
    from threefs.testing.checks import replica_differences

    cluster = private_cluster()
    with Client.connect(str(cluster.client_config_path)) as fs:
        before = _inline_counts(fs)
        small = rng.randbytes(3000)
        for i in range(20):
            fs.write_bytes(f"/s{i}", small)
        big = rng.randbytes(1 << 20)
        fs.write_bytes("/big", big)
        after = _inline_counts(fs)
        assert after["inline"] - before["inline"] >= 20 * 2 * 3  # a write and a commit at 3 replicas each
        assert all(fs.read_bytes(f"/s{i}") == small for i in range(20)) and fs.read_bytes("/big") == big
        assert replica_differences(fs, "/s0") == [] and replica_differences(fs, "/big") == []


def _inline_counts(fs) -> dict:
    from threefs.rpc.schemas import storage as ss
    from threefs.rpc.schemas.common import Empty

    async def counts():
        routing = await fs.aio.mgmtd.refresh(force=True)
        total: dict = {}
        for node in routing.info.nodes.values():
            if node.type != "storage":
                continue
            rsp, _ = await fs.aio.rpc.call(node.addr, "storage.status", Empty(), ss.StatusRsp)
            for k, v in rsp.inline_updates.items():
                total[k] = total.get(k, 0) + v
        return total

    return fs.run(counts())


def test_a_write_far_into_a_new_chunk_is_handed_over(tmp_path):
    """A small write at the end of a new (or short) chunk zero-fills everything before it: more than
    INLINE_ZERO_FILL_MAX of that is the disk threads' work."""
    eng = ChunkEngineV2(str(tmp_path / "t"))
    big = 4 * 1024 * 1024
    x, y = cid(1), cid(2)
    far = chunk_engine_v2.INLINE_ZERO_FILL_MAX + 4096
    with pytest.raises(BlockingIOError):
        with eng.inline():
            eng.write(x, update_ver=1, chain_ver=1, offset=far, data=b"t" * 100, chunk_size=big)
    _, ran_inline = inline_or_thread(eng, lambda: eng.write(y, update_ver=1, chain_ver=1, offset=4096,
                                                            data=b"t" * 100, chunk_size=big))
    assert ran_inline  # a little zero-fill is fine
    eng.write(x, update_ver=1, chain_ver=1, offset=far, data=b"t" * 100, chunk_size=big)
    eng.commit(x, 1)
    assert eng.read(x, 0, far + 100)[0] == bytes(far) + b"t" * 100
    eng.close()
