"""Chunk engine v2's metadata journal: every update is one journal append, SQLite gets the journaled states
in batches. Proves: a process that dies without close() (os._exit, no flush) loses nothing it returned; a
torn last record is dropped with the rest intact; the journal is bounded (flushed into SQLite past its
limits, and emptied at start-up); fsync=True with concurrent writers (group commit) keeps everything;
readers from outside the engine (committed_position) see journaled states SQLite does not hold yet."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import crc32c

from threefs.storage import chunk_engine_v2
from threefs.storage.chunk_engine_v2 import ChunkEngineV2, block_size, committed_position, pos_block, pos_class, pos_file
from threefs.storage.target_check import check_target

REPO = Path(__file__).resolve().parents[2]
CHUNK = 64 * 1024

CHILD = r"""
import os, random, sys
from threefs.storage.chunk_engine_v2 import ChunkEngineV2
target, count, fsync = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
rng = random.Random(5)
eng = ChunkEngineV2(target, files_per_class=2, fsync=fsync)
for i in range(count):
    cid = bytes(8) + (i % 50).to_bytes(8, "big")
    meta = eng.get_meta(cid)
    ver = (meta.commit_ver if meta else 0) + 1
    if meta is None or rng.random() < 0.5:
        eng.write(cid, update_ver=ver, chain_ver=1, offset=0, data=rng.randbytes(rng.randrange(1, 9000)),
                  chunk_size=65536, full_replace=True)
    else:  # a small write inside: an overlay, folded after the commit
        eng.write(cid, update_ver=ver, chain_ver=1, offset=rng.randrange(meta.length // 2),
                  data=rng.randbytes(max(1, meta.length // 4)), chunk_size=65536)
    eng.commit(cid, ver)
# the last chunk is left with a pending version (a write that returned, not committed)
eng.write(b"\xff" * 16, update_ver=1, chain_ver=1, offset=0, data=b"pending" * 10, chunk_size=65536)
state = {}
for m in [eng.get_meta(bytes(8) + i.to_bytes(8, "big")) for i in range(50)] + [eng.get_meta(b"\xff" * 16)]:
    state[m.chunk_id.hex()] = [m.commit_ver, m.length, m.crc, m.update_ver, m.pending_crc]
import json
print(json.dumps(state), flush=True)
os._exit(0)  # no close(): the journal is not flushed into SQLite
"""


def cid(i: int) -> bytes:
    return bytes(8) + i.to_bytes(8, "big")


def run_child(tmp_path: Path, count: int, fsync: bool = False) -> dict:
    import json

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "t"), str(count), "1" if fsync else "0"],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    return json.loads(out.stdout)


def states(eng: ChunkEngineV2) -> dict:
    return {m.chunk_id.hex(): [m.commit_ver, m.length, m.crc, m.update_ver, m.pending_crc]
            for m in eng.iter_metas()}


def test_exit_without_close_loses_nothing_and_a_torn_record_is_dropped(tmp_path):
    expected = run_child(tmp_path, 300)
    journal = tmp_path / "t" / "journal"
    assert journal.stat().st_size > 0, "the last updates are in the journal only"
    with open(journal, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")  # a torn record: a header and a few bytes of its payload
    with ChunkEngineV2(str(tmp_path / "t")) as e:
        assert states(e) == expected and e.chunk_count() == len(expected)
        data, meta = e.read(b"\xff" * 16, 0, 100, pending=True)
        assert bytes(data) == b"pending" * 10 and meta.commit_ver == 0
        for m in e.iter_metas():
            if m.commit_ver:
                assert e.verify(m.chunk_id)
    assert journal.stat().st_size == 0, "start-up flushed the journal into SQLite"
    assert check_target(str(tmp_path / "t")).ok


def test_fsync_and_concurrent_writers_group_commit(tmp_path):
    path = str(tmp_path / "t")
    eng = ChunkEngineV2(path, fsync=True)
    errors = []

    def writer(k: int):
        try:
            for j in range(40):
                c = cid(k * 1000 + j)
                eng.write(c, update_ver=1, chain_ver=1, offset=0, data=bytes([k]) * (100 + j), chunk_size=CHUNK)
                eng.commit(c, 1)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert eng._synced_seq == eng._seq, "every returned update is on disk"
    eng.close()
    with ChunkEngineV2(path) as e:
        assert e.chunk_count() == 160
        for k in range(4):
            for j in range(40):
                data, meta = e.read(cid(k * 1000 + j), 0, CHUNK)
                assert bytes(data) == bytes([k]) * (100 + j) and meta.commit_ver == 1
    assert check_target(path).ok


def test_journal_is_flushed_past_its_limit_and_outside_readers_see_journaled_states(tmp_path, monkeypatch):
    monkeypatch.setattr(chunk_engine_v2, "JOURNAL_FLUSH_RECORDS", 64)
    path = str(tmp_path / "t")
    with ChunkEngineV2(path) as e:
        for i in range(200):  # 400 records: flushed 6 times, 16 left in the journal
            e.write(cid(i), update_ver=1, chain_ver=1, offset=0, data=os.urandom(700), chunk_size=CHUNK)
            e.commit(cid(i), 1)
        assert e._journal_records < 64 and e._applied_seq >= 384
        e.write(cid(7), update_ver=2, chain_ver=1, offset=0, data=b"new bytes", chunk_size=CHUNK, full_replace=True)
        e.commit(cid(7), 2)  # journaled only
        found = committed_position(path, cid(7))
        assert found is not None and found[1] == len(b"new bytes")
        pos = found[0]
        file = os.path.join(path, "blocks", f"c{pos_class(pos):02d}.{pos_file(pos):03d}")
        with open(file, "rb") as f:
            f.seek(pos_block(pos) * block_size(pos_class(pos)))
            assert f.read(9) == b"new bytes"
        assert crc32c.crc32c(b"new bytes") == e.get_meta(cid(7)).crc
        assert committed_position(path, cid(999)) is None


def test_the_chunk_count_is_kept_in_the_metadata_and_checked(tmp_path):
    """Opening does not count the chunks (a 1,000,000-chunk target must open in under 2 s): every flush
    keeps the count in `info`; target-check compares it with the chunks stored."""
    import sqlite3

    path = str(tmp_path / "t")
    with ChunkEngineV2(path) as e:
        for i in range(30):
            e.write(cid(i), update_ver=1, chain_ver=1, offset=0, data=b"x" * 10, chunk_size=CHUNK)
            e.commit(cid(i), 1)
        e.remove(cid(3), update_ver=2, chain_ver=1)
        e.commit(cid(3), 2)
    with ChunkEngineV2(path) as e:
        assert e.chunk_count() == 29
    assert check_target(path).ok
    db = sqlite3.connect(os.path.join(path, "meta.sqlite"))
    db.execute("UPDATE info SET value = 31 WHERE key = 'chunk_count'")
    db.commit()
    db.close()
    report = check_target(path)
    assert any("chunk count kept in the metadata (31)" in p for p in report.problems), report.lines()


def test_a_flush_into_sqlite_runs_outside_the_engine_lock(tmp_path, monkeypatch):
    """While the update that filled the journal writes SQLite, reads (cached or not), and updates of other
    chunks go on; records appended meanwhile go to the other journal file; afterwards SQLite holds every
    state flushed, states changed during the flush stay journaled, and a reopen without close() (the
    child below is killed at an equal moment) finds all of it."""
    monkeypatch.setattr(chunk_engine_v2, "JOURNAL_FLUSH_RECORDS", 32)
    path = str(tmp_path / "t")
    e = ChunkEngineV2(path)
    for i in range(10):  # 20 records
        e.write(cid(i), update_ver=1, chain_ver=1, offset=0, data=bytes([i]) * 500, chunk_size=CHUNK)
        e.commit(cid(i), 1)
    inside, release = threading.Event(), threading.Event()
    real = e._write_store

    def held(*args):
        inside.set()
        assert release.wait(30)
        return real(*args)

    e._write_store = held
    def fill():  # 12 more records: the last commit fills the journal and flushes it
        for i in range(10, 16):
            e.write(cid(i), update_ver=1, chain_ver=1, offset=0, data=bytes([i]) * 500, chunk_size=CHUNK)
            e.commit(cid(i), 1)

    flusher = threading.Thread(target=fill)
    flusher.start()
    assert inside.wait(30)
    try:
        e._cache.clear()  # a read of a chunk that is not cached must not wait for the flush either
        done = []
        worker = threading.Thread(target=lambda: done.append((
            e.read(cid(3), 0, 500)[0],
            e.write(cid(3), update_ver=2, chain_ver=1, offset=0, data=b"during", chunk_size=CHUNK,
                    full_replace=True),
            e.commit(cid(3), 2),
            e.write(cid(50), update_ver=1, chain_ver=1, offset=0, data=b"new", chunk_size=CHUNK),
            e.commit(cid(50), 1))))
        worker.start()
        worker.join(30)
        assert done and done[0][0] == bytes([3]) * 500, "engine calls waited for the flush"
        assert os.path.getsize(os.path.join(path, "journal.1")) > 0  # appends moved to the other file
    finally:
        release.set()
        flusher.join(30)
    e._write_store = real
    assert not e._retired_dirty and os.path.getsize(os.path.join(path, "journal")) == 0
    db = sqlite3.connect(os.path.join(path, "meta.sqlite"))
    try:
        in_sqlite = {row[0] for row in db.execute("SELECT id FROM chunks")}
    finally:
        db.close()
    assert {cid(i) for i in range(16)} <= in_sqlite  # the flushed states (cid 3's first version among them)
    assert cid(50) not in in_sqlite  # appended during the flush: journaled only
    assert cid(3) in e._dirty  # changed during the flush: still journaled, SQLite holds the flushed state
    want = {m.chunk_id: (m.commit_ver, m.crc) for m in (e.get_meta(cid(i)) for i in list(range(16)) + [50])}
    e._closed = True  # as a kill: nothing more is flushed; reopen replays the journals
    e._close_files()
    os.close(e._lock_fd)
    with ChunkEngineV2(path) as again:
        got = {m.chunk_id: (m.commit_ver, m.crc) for m in (again.get_meta(cid(i)) for i in list(range(16)) + [50])}
        assert got == want
        assert bytes(again.read(cid(3), 0, 6)[0]) == b"during"
    assert check_target(path).ok


def test_a_failed_flush_leaves_everything_in_the_journals_and_the_next_one_writes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(chunk_engine_v2, "JOURNAL_FLUSH_RECORDS", 16)
    path = str(tmp_path / "t")
    e = ChunkEngineV2(path)
    real = e._write_store
    failures = []

    def failing(*args):
        if not failures:
            failures.append(1)
            raise chunk_engine_v2._sql_error(sqlite3.OperationalError("disk I/O error"), path)
        return real(*args)

    e._write_store = failing
    for i in range(20):  # the first flush fails; a later one writes everything (both journal files)
        e.write(cid(i), update_ver=1, chain_ver=1, offset=0, data=bytes([i]) * 300, chunk_size=CHUNK)
        e.commit(cid(i), 1)
    assert failures == [1]
    assert not e._retired_dirty
    want = states(e)
    e.close()
    with ChunkEngineV2(path) as again:
        assert states(again) == want
    assert check_target(path).ok
