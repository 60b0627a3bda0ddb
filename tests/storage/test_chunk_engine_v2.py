"""Chunk engine v2: block placement and reuse, sub-chunk writes (in place, overlay, copy-on-write), space
from the allocator, target-check finding real damage, v1 -> v2 migration (also killed midway), compaction,
a full disk (a real tmpfs), and kill -9 at random points of writes, commits, compaction and migration.

The semantics shared with v1 and the simulator are in test_chunk_store_conformance.py (engine2 there)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import crc32c
import pytest

from threefs.common.status import StatusCode, ThreeFSError
from threefs.storage.chunk_engine import ChunkEngine
from threefs.storage.chunk_engine_v2 import (BLOCK_MIN, CRC_COMBINE_BYTES_MIN, ChunkEngineV2, block_size,
                                             class_for, pos_class)
from threefs.storage.engines import open_chunk_engine, target_format
from threefs.storage.target_check import check_target

CHUNK = 64 * 1024
REPO = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("THREEFS_ENGINE_KILLS", "10"))  # soak mode: THREEFS_ENGINE_KILLS=1000
KEEP = os.environ.get("THREEFS_ENGINE_KILL_KEEP", "")  # a directory: the last target as a kill left it


def cid(i: int) -> bytes:
    return bytes(8) + i.to_bytes(8, "big")


def put(eng, chunk_id: bytes, data: bytes, offset: int = 0, chunk_size: int = CHUNK, **kw):
    meta = eng.get_meta(chunk_id)
    ver = (meta.commit_ver if meta else 0) + 1
    eng.write(chunk_id, update_ver=ver, chain_ver=1, offset=offset, data=data, chunk_size=chunk_size, **kw)
    return eng.commit(chunk_id, ver)


def committed(eng, chunk_id: bytes) -> bytes:
    data, meta = eng.read(chunk_id, 0, CHUNK * 4)
    assert len(data) == meta.length and crc32c.crc32c(data) == meta.crc
    return bytes(data)


def state(eng, chunk_id: bytes):
    with eng._lock:
        return eng._get(chunk_id)


@pytest.fixture
def eng(tmp_path):
    with ChunkEngineV2(str(tmp_path / "target"), files_per_class=2) as e:
        yield e


def test_size_classes():
    assert [class_for(n) for n in (1, 512, 513, 1024, 4096, 65536, 64 << 20)] == [0, 0, 1, 1, 3, 7, 17]
    assert block_size(class_for(1000)) == 1024 and BLOCK_MIN == 512


def test_chunks_go_to_the_smallest_class_and_freed_blocks_are_reused(eng):
    put(eng, cid(1), b"a" * 3000)
    put(eng, cid(2), b"b" * 40_000)
    assert block_size(pos_class(state(eng, cid(1)).pos)) == 4096
    assert block_size(pos_class(state(eng, cid(2)).pos)) == 65536
    first = state(eng, cid(1)).pos
    eng.remove(cid(1), update_ver=2, chain_ver=1)
    eng.commit(cid(1), 2)
    put(eng, cid(3), b"c" * 4000)
    assert state(eng, cid(3)).pos == first, "a freed block is reused first"
    assert eng.used_bytes() == 4096 + 65536
    with pytest.raises(ThreeFSError) as err:  # offline only: the open engine holds the target's lock
        check_target(eng.path)
    assert err.value.code == StatusCode.BUSY
    eng.close()
    report = check_target(eng.path)
    assert report.ok, report.lines()
    assert report.chunks == 2 and report.blocks_owned == report.blocks_marked == 2


def test_append_in_place_middle_write_overlay_and_copy_on_write(eng):
    rng = random.Random(5)
    base = rng.randbytes(40_000)
    put(eng, cid(1), base)
    pos = state(eng, cid(1)).pos
    put(eng, cid(1), b"T" * 10_000, offset=40_000)  # append that fits the 64 KiB block: in place
    model = bytearray(base + b"T" * 10_000)
    assert state(eng, cid(1)).pos == pos and committed(eng, cid(1)) == model
    meta = eng.write(cid(1), update_ver=3, chain_ver=1, offset=1000, data=b"M" * 4096, chunk_size=CHUNK)
    st = state(eng, cid(1))
    assert st.p.pos == pos and st.p.ov[:2] == (1000, 4096), "a small middle write is an overlay"
    assert committed(eng, cid(1)) == model, "the committed version is untouched before the commit"
    model[1000:5096] = b"M" * 4096
    assert bytes(eng.read(cid(1), 0, CHUNK, pending=True)[0]) == model
    assert meta.pending_crc == crc32c.crc32c(model)
    eng.commit(cid(1), 3)
    st = state(eng, cid(1))
    assert st.pos == pos and st.ov is None and committed(eng, cid(1)) == model, "folded into the block"
    put(eng, cid(1), b"G" * 20_000, offset=50_000, chunk_size=CHUNK * 2)  # straddles the end and grows past 64 KiB: copy-on-write
    model[50_000:] = b"G" * 20_000
    assert committed(eng, cid(1)) == model and state(eng, cid(1)).pos != pos
    eng.truncate(cid(1), update_ver=5, chain_ver=1, length=100, chunk_size=CHUNK * 2)
    eng.commit(cid(1), 5)
    assert committed(eng, cid(1)) == model[:100]
    eng.close()
    assert check_target(eng.path).ok


def test_a_read_across_an_overlay_fold_is_read_again_never_a_mix_of_versions(eng, monkeypatch):
    """A read that looked a chunk up before an overlay write's commit reads the old version's block, under
    the old version's length and checksum; the commit's fold writes the overlay's bytes into that block. A
    read it overlaps would return a mix of both versions that no checksum catches (the storage service
    crc32cs what it read): readers compare the engine's fold count before and after and read again."""
    base = bytes(range(256)) * 200
    put(eng, cid(1), base)
    new = bytearray(base)
    new[1000:5096] = b"M" * 4096
    # the batched path (storage service _serve_fast): the lookup tells the reader that a fold happened
    locs, epoch, folds = eng.read_locations([cid(1)], with_folds=True)
    fd, at, size, _, crc = locs[0]
    put(eng, cid(1), b"M" * 4096, offset=1000)  # an overlay write, committed (and folded) meanwhile
    assert os.pread(fd, size, at) == new, "the block the reader was reading now holds the new bytes"
    assert eng.folds != folds, "and the reader can tell"
    eng.end_reads(epoch)
    # engine.read: a fold in the middle of its preadv makes it read again (the new version, whole)
    real_preadv, fired = os.preadv, []

    def preadv_racing_a_fold(fd, buffers, offset, *flags):
        if not fired:
            fired.append(True)
            put(eng, cid(1), b"N" * 2048, offset=9000)  # commits and folds while this read is under way
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv_racing_a_fold)
    out = memoryview(bytearray(len(base)))
    data, meta = eng.read(cid(1), 0, len(base), out)
    monkeypatch.undo()
    new[9000:11048] = b"N" * 2048
    assert fired and bytes(data) == new and meta.commit_ver == 3 and crc32c.crc32c(data) == meta.crc
    eng.close()
    assert check_target(eng.path).ok


@pytest.mark.parametrize("given", [False, True], ids=["computed", "crc-given"])
def test_a_write_given_its_data_crc_records_the_same_crc_on_every_write_path(eng, given):
    """The storage service passes a write's checked payload crc32c to the engine (data_crc), which derives
    the version's crc from it (as is at offset 0, combined after a prefix for big writes) instead of reading
    the bytes again: on every write path the recorded crc must be that of the chunk's bytes."""
    big = CRC_COMBINE_BYTES_MIN  # at least this long: combined, not recomputed
    size = 4 * big
    rng = random.Random(11)
    model = bytearray()

    def write(data: bytes, offset: int, full: bool = False):
        meta = eng.get_meta(cid(1))
        ver = (meta.commit_ver if meta else 0) + 1
        dc = crc32c.crc32c(data) if given else None
        eng.write(cid(1), update_ver=ver, chain_ver=1, offset=offset, data=data, chunk_size=size,
                  full_replace=full, data_crc=dc)
        if full:
            del model[:]
        model[len(model):] = bytes(max(0, offset + len(data) - len(model)))
        model[offset:offset + len(data)] = data
        meta = eng.commit(cid(1), ver)
        assert meta.length == len(model) and meta.crc == crc32c.crc32c(model)
        assert bytes(eng.read(cid(1), 0, size)[0]) == model

    write(rng.randbytes(big), offset=100)                  # a new chunk after zeros (prefix combined)
    write(rng.randbytes(big), offset=big + 100)             # an append in place, after a gap of zeros
    write(rng.randbytes(big), offset=50)                    # lands inside and past the end: a copy
    write(rng.randbytes(2 * big + 7), offset=0)             # from offset 0, covering it all: as given
    write(rng.randbytes(100), offset=3)                     # small: read, not combined
    write(rng.randbytes(big // 2), offset=0, full=True)     # a full replace
    eng.close()
    assert check_target(eng.path).ok


def test_restart_folds_an_overlay_a_crash_left_unfolded(tmp_path):
    path = str(tmp_path / "t")
    with ChunkEngineV2(path) as e:
        put(e, cid(1), bytes(range(256)) * 100)
        e.write(cid(1), update_ver=2, chain_ver=1, offset=300, data=b"X" * 1000, chunk_size=CHUNK)
        e._fold = lambda chunk_id, st: st  # as if killed between the commit and the fold
        e.commit(cid(1), 2)
    expected = bytearray(bytes(range(256)) * 100)
    expected[300:1300] = b"X" * 1000
    db = sqlite3.connect(os.path.join(path, "meta.sqlite"))
    assert db.execute("SELECT count(*) FROM chunks WHERE ov_pos IS NOT NULL").fetchone()[0] == 1
    db.close()
    with ChunkEngineV2(path) as e:
        assert committed(e, cid(1)) == expected and state(e, cid(1)).ov is None
    assert check_target(path).ok


def test_space_accounting_and_compaction_after_mass_deletes(eng):
    for i in range(600):
        put(eng, cid(i), os.urandom(4000))
    space = eng.space()
    assert space["used_bytes"] == 600 * 4096 and space["file_bytes"] >= 600 * 4096
    for i in range(600):
        if i % 100:  # keep 6 chunks spread over the groups
            eng.remove(cid(i), update_ver=2, chain_ver=1)
            eng.commit(cid(i), 2)
    assert eng.used_bytes() == 6 * 4096 and eng.chunk_count() == 6
    files_before = eng.space()["file_bytes"]
    groups = {state(eng, cid(i)).pos >> 8 for i in range(0, 600, 100)}
    assert len(groups) > 1, "the survivors are spread over several groups"
    done = eng.compact()
    assert done["chunks_moved"] > 0 and done["bytes_returned"] > 0, done  # (empty file ends are cut, not punched)
    assert len({state(eng, cid(i)).pos >> 8 for i in range(0, 600, 100)}) == 1, "moved into one group"
    assert eng.space()["file_bytes"] < files_before
    assert eng.compact()["chunks_moved"] == 0, "nothing left to move"
    for i in range(0, 600, 100):
        assert len(committed(eng, cid(i))) == 4000
    put(eng, cid(1000), b"z" * 4000)  # allocation into punched groups works again
    assert committed(eng, cid(1000)) == b"z" * 4000
    eng.close()
    report = check_target(eng.path)
    assert report.ok and report.chunks == 7, report.lines()


def test_target_check_reports_a_bit_flip_a_leak_and_a_block_owned_twice(tmp_path):
    path = str(tmp_path / "t")
    with ChunkEngineV2(path) as e:
        for i in range(3):
            put(e, cid(i), random.Random(i).randbytes(3000))
        victim = state(e, cid(0)).pos
        fd, off = e._where(victim)
        os.pwrite(fd, b"\xff", off + 10)
    report = check_target(path)
    assert not report.ok and any("checksum mismatch" in p and cid(0).hex() in p for p in report.problems)
    db = sqlite3.connect(os.path.join(path, "meta.sqlite"))
    pos1 = db.execute("SELECT pos FROM chunks WHERE id = ?", (cid(1),)).fetchone()[0]
    db.execute("UPDATE chunks SET pos = ? WHERE id = ?", (pos1, cid(2)))  # chunk 2 now claims chunk 1's block
    db.commit()
    db.close()
    text = "\n".join(check_target(path).lines())
    assert "owned twice" in text and "leaked" in text, text  # and chunk 2's own block is a leak now


def test_v1_target_migrates_in_place_and_v1_refuses_a_v2_target(tmp_path):
    path = str(tmp_path / "t")
    rng = random.Random(9)
    model = {}
    with ChunkEngine(path) as v1:
        for i in range(40):
            model[cid(i)] = rng.randbytes(rng.randrange(0, 9000))
            put(v1, cid(i), model[cid(i)])
        v1.write(cid(100), update_ver=1, chain_ver=1, offset=0, data=b"pending", chunk_size=CHUNK)
        v1.write(cid(0), update_ver=2, chain_ver=1, offset=5, data=b"PEND", chunk_size=CHUNK)
        before = {m.chunk_id: m for m in v1.iter_metas()}
    with pytest.raises(ThreeFSError) as err:
        ChunkEngineV2(path, migrate=False)
    assert "target-migrate" in err.value.message
    assert target_format(path) == "v1"
    with open_chunk_engine(path, "v2") as v2:
        assert {m.chunk_id: m for m in v2.iter_metas()} == before
        assert all(committed(v2, c) == d for c, d in model.items())
        assert bytes(v2.read(cid(100), 0, CHUNK, pending=True)[0]) == b"pending"
    assert target_format(path) == "v2" and not os.path.exists(os.path.join(path, "data"))
    assert check_target(path).ok
    with pytest.raises(ThreeFSError) as err:
        ChunkEngine(path)
    assert err.value.code == StatusCode.INVALID_ARGUMENT and "v2" in err.value.message
    with open_chunk_engine(path) as again:  # "" keeps the engine that wrote the target
        assert isinstance(again, ChunkEngineV2)


# -- full disk ------------------------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmpfs):
    return tmpfs("8m")


def test_a_full_disk_is_no_space_and_keeps_committed_data(tiny_tmpfs):
    path = str(tiny_tmpfs / "target")
    written = {}
    with ChunkEngineV2(path, files_per_class=1) as e:
        for size in (3000, 400):  # 4 KiB blocks (groups of 1 MiB), then 512 B blocks fill the rest
            while True:
                c, data = cid(len(written)), os.urandom(size)
                try:
                    put(e, c, data)
                except ThreeFSError as err:
                    assert err.code == StatusCode.NO_SPACE, err
                    assert e.get_meta(c) is None
                    break
                written[c] = data
                assert len(written) < 20_000
        big = next(iter(written))
        assert len(written[big]) == 3000 and len(written[list(written)[-1]]) == 400
        with pytest.raises(ThreeFSError) as err:  # copy-on-write needs a new 4 KiB block: none left
            e.write(big, update_ver=2, chain_ver=1, offset=1, data=os.urandom(2998), chunk_size=CHUNK)
        assert err.value.code == StatusCode.NO_SPACE
        assert e.get_meta(big).update_ver == 1 and committed(e, big) == written[big]
        for c in list(written)[:3]:  # removals still commit; their blocks take the next writes
            e.remove(c, update_ver=2, chain_ver=1)
            assert e.commit(c, 2) is None
            del written[c]
        put(e, cid(99_999), os.urandom(3500))  # a freed 4 KiB block
        written[cid(99_999)] = bytes(e.read(cid(99_999), 0, CHUNK)[0])
        assert all(committed(e, c) == d for c, d in written.items())
    report = check_target(path)
    assert report.ok and report.chunks == len(written), report.lines()


# -- kill -9 -----------------------------------------------------------------------------------------

CHILD = r"""
import os, random, sys, time
import crc32c
from threefs.common.status import StatusCode, ThreeFSError
from threefs.storage.chunk_engine_v2 import ChunkEngineV2

target, ack_path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
CHUNK = 64 * 1024
rng = random.Random(seed)
from threefs.storage import chunk_engine_v2
chunk_engine_v2.JOURNAL_FLUSH_RECORDS = int(os.environ.get("CHILD_FLUSH_RECORDS", "4096"))
eng = ChunkEngineV2(target, files_per_class=2, fsync=os.environ.get("CHILD_FSYNC") == "1")
ack = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
ids = [bytes(15) + bytes([i]) for i in range(6)]
print("ready", flush=True)


def step():
    i = rng.randrange(len(ids))
    meta = eng.get_meta(ids[i])
    old = bytes(eng.read(ids[i], 0, CHUNK)[0]) if meta else b""
    ver = (meta.commit_ver if meta else 0) + 1
    op = rng.random()
    if op < 0.04:
        eng.compact()
        return
    if op < 0.08:  # a pending version that is dropped again
        eng.write(ids[i], update_ver=ver, chain_ver=1, offset=0, data=rng.randbytes(100), chunk_size=CHUNK)
        eng.abort(ids[i])
        return
    if op < 0.15 and meta:
        eng.remove(ids[i], update_ver=ver, chain_ver=1)
        new = None
    elif op < 0.25:
        length = rng.randrange(CHUNK + 1)
        eng.truncate(ids[i], update_ver=ver, chain_ver=1, length=length, chunk_size=CHUNK)
        new = old[:length].ljust(length, b"\0")
    else:
        kind = rng.random()
        if kind < 0.4 and len(old) > 64:  # small middle write: an overlay
            size = rng.randrange(1, len(old) // 2)
            offset = rng.randrange(len(old) - size)
        else:
            offset = rng.choice([0, len(old), rng.randrange(CHUNK)])
            size = rng.randrange(CHUNK - offset + 1)
        data = rng.randbytes(size)
        full = offset == 0 and rng.random() < 0.3
        eng.write(ids[i], update_ver=ver, chain_ver=1, offset=offset, data=data, chunk_size=CHUNK, full_replace=full)
        new = data if full else (old + bytes(max(0, offset - len(old))))[:offset] + data + old[offset + len(data):]
    state = "none" if new is None else f"{ver} {len(new)} {crc32c.crc32c(new)}"
    os.write(ack, f"I {i} {ver} {state}\n".encode())
    result = eng.commit(ids[i], ver)
    assert (result is None) == (new is None) and (new is None or result.crc == crc32c.crc32c(new))
    os.write(ack, f"A {i} {ver}\n".encode())


while True:
    try:
        step()
    except ThreeFSError as e:  # the shared disk filled up for a moment: not what this test is about
        if e.code != StatusCode.NO_SPACE:
            raise
        time.sleep(0.05)
"""

MIGRATE_CHILD = r"""
import sys
from threefs.storage import engine_migrate
from threefs.storage.chunk_engine_v2 import ChunkEngineV2
engine_migrate.BATCH_CHUNKS = 8
print("ready", flush=True)
ChunkEngineV2(sys.argv[1]).close()
print("done", flush=True)
"""


def expected_states(ack_log: str) -> dict[int, set[str]]:
    """What each chunk may be after the kill: its last acknowledged commit, or the one in progress.

    A commit can finish without its "A" line (the kill between the two). The next child's intent for that
    chunk tells which: its version is one past the committed one (`ver = commit_ver + 1`), so a previous
    intent committed iff the new version is the next one (or 1 after a removal, when the chunk was gone);
    with the same version again it did not."""
    acked: dict[int, str] = {}
    intent: dict[int, tuple[int, str] | None] = {}
    for line in ack_log.splitlines():
        kind, index, ver, *rest = line.split(" ", 3)
        i, v = int(index), int(ver)
        if kind == "I":
            prev = intent.get(i)
            if prev is not None and (v == prev[0] + 1 or (prev[1] == "none" and v == 1)):
                acked[i] = prev[1]  # it committed before the kill; only its "A" line is missing
            intent[i] = (v, rest[0])
        else:
            acked[i], intent[i] = intent[i][1], None
    return {i: {acked.get(i, "none"), (intent.get(i) or (0, acked.get(i, "none")))[1]}
            for i in set(acked) | set(intent)}


def state_of(meta) -> str:
    return "none" if meta is None or not meta.commit_ver else f"{meta.commit_ver} {meta.length} {meta.crc}"


def run_and_kill(script: Path, args: list[str], rng: random.Random, wait_ready: bool, may_finish: bool = False,
                 wait_s: float = 0.25, env: dict | None = None) -> None:
    """Start the child, kill -9 it at a random instant; `may_finish`: it may be done (exit 0) by then."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    child = subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        if wait_ready:
            assert child.stdout.readline() == b"ready\n", child.stderr.read().decode()
            time.sleep(rng.uniform(0.0, wait_s))
        else:  # anywhere, start-up (fold redo, group loading) included
            time.sleep(rng.uniform(0.05, 0.4))
        if not (may_finish and child.poll() == 0):
            assert child.poll() is None, child.stderr.read().decode()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        child.stderr.close()


@pytest.mark.parametrize("child_env", [{}, {"CHILD_FLUSH_RECORDS": "8", "CHILD_FSYNC": "1"}],
                         ids=["journal-default", "journal-flushed-every-8-records-fsync"])
def test_kill_9_at_random_points_keeps_every_acknowledged_commit(tmp_path, child_env):
    """Kills land in writes, commits, folds, compactions, start-up replays and (second case, where the
    journal is flushed into SQLite every 8 records, with fsync and group commit) journal flushes."""
    root, ack_path = tmp_path / "target", tmp_path / "acks.log"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    rng = random.Random(int(os.environ.get("THREEFS_ENGINE_KILL_SEED", "2026")) + len(child_env))
    for round_ in range(KILLS):
        run_and_kill(script, [str(root), str(ack_path), str(rng.randrange(1 << 30))], rng, round_ % 5 != 4,
                     env=child_env)
        allowed = expected_states(ack_path.read_text())
        if KEEP:  # the target as the kill left it (opening it replays and flushes the journal)
            shutil.rmtree(KEEP, ignore_errors=True)
            shutil.copytree(root, KEEP)
            shutil.copy(ack_path, os.path.join(KEEP, "acks.log"))
        with ChunkEngineV2(str(root)) as e:
            for i, states in allowed.items():
                chunk_id = bytes(15) + bytes([i])
                meta = e.get_meta(chunk_id)
                assert state_of(meta) in states, (round_, i, meta, states, KEEP or "THREEFS_ENGINE_KILL_KEEP unset")
                if meta is not None and meta.commit_ver:
                    assert e.verify(chunk_id), (round_, i)
                if meta is not None and meta.update_ver != meta.commit_ver and not meta.pending_remove:
                    data, _ = e.read(chunk_id, 0, CHUNK, pending=True)
                    assert crc32c.crc32c(data) == meta.pending_crc
        report = check_target(str(root))
        assert report.ok, (round_, report.lines())
    assert len(ack_path.read_text().splitlines()) > 50, "the child should have committed many versions"


def test_kill_9_during_migration_resumes_and_loses_nothing(tmp_path):
    root = tmp_path / "target"
    rng = random.Random(31)
    model = {}
    with ChunkEngine(str(root)) as v1:
        for i in range(400):
            model[cid(i)] = rng.randbytes(rng.randrange(1, 3000))
            put(v1, cid(i), model[cid(i)])
    script = tmp_path / "migrate.py"
    script.write_text(MIGRATE_CHILD)
    kills = 0
    while target_format(str(root)) != "v2" and kills < 4:
        run_and_kill(script, [str(root)], rng, True, may_finish=True, wait_s=0.1)
        kills += 1
    # (whether a kill landed inside the migration is timing; every outcome must end the same way)
    with ChunkEngineV2(str(root)) as e:
        assert e.chunk_count() == 400
        assert all(committed(e, c) == d for c, d in model.items())
    assert check_target(str(root)).ok and not (root / "meta.log").exists()


def test_crc_patch_matches_a_full_recompute():
    from threefs.storage.crc_math import patch

    rng = random.Random(11)
    for _ in range(200):
        length = rng.randrange(1, 20_000)
        message = bytearray(rng.randbytes(length))
        offset = rng.randrange(length)
        new = rng.randbytes(rng.randrange(length - offset + 1))
        crc, old = crc32c.crc32c(message), bytes(message[offset:offset + len(new)])
        message[offset:offset + len(new)] = new
        assert patch(crc, length, offset, old, new) == crc32c.crc32c(message)


def test_admin_target_commands_in_plain_words(tmp_path):
    path = tmp_path / "t"
    with ChunkEngine(str(path)) as v1:
        for i in range(5):
            put(v1, cid(i), random.Random(i).randbytes(2000))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "threefs.cli.main", "admin", *args], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)

    out = cli("target-check", str(path))
    assert out.returncode == 0 and "chunk engine v1" in out.stdout and "OK" in out.stdout, out
    out = cli("target-migrate", str(path))
    assert out.returncode == 0 and "migrated" in out.stdout and target_format(str(path)) == "v2", out
    out = cli("target-check", str(path))
    assert out.returncode == 0 and "5 chunks" in out.stdout and "no leaked block" in out.stdout, out
    with ChunkEngineV2(str(path)) as e:
        fd, off = e._where(state(e, cid(3)).pos)
        os.pwrite(fd, b"\0\0\0", off + 7)
    out = cli("target-check", str(path))
    assert out.returncode == 1 and "checksum mismatch" in out.stdout and cid(3).hex() in out.stdout, out
    out = cli("target-compact", str(path))
    assert out.returncode == 0 and "punched" in out.stdout, out


def test_big_blocks_are_fallocated_one_at_a_time_and_given_back_one_at_a_time(eng):
    data = {i: os.urandom(600_000) for i in range(3)}  # 1 MiB blocks: a group would be 256 MiB
    for i, d in data.items():
        put(eng, cid(i), d, chunk_size=1 << 20)
    assert eng.space()["file_bytes"] < 8 << 20, "only the blocks in use are allocated"
    eng.remove(cid(1), update_ver=2, chain_ver=1)
    eng.commit(cid(1), 2)
    assert eng.space()["reusable_bytes"] == 1 << 20
    assert eng.compact()["bytes_returned"] >= 1 << 20
    assert eng.space()["reusable_bytes"] == 0
    put(eng, cid(5), data[1], chunk_size=1 << 20)  # into the punched block: fallocated again
    assert bytes(eng.read(cid(5), 0, 1 << 20)[0]) == data[1] and bytes(eng.read(cid(2), 0, 1 << 20)[0]) == data[2]
    eng.close()
    assert check_target(eng.path).ok
