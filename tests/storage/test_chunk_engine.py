"""Tests of the per-target chunk engine: versions, copy-on-write, persistence, crash safety (real kill -9),
checksums and a full disk (a real tmpfs)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import crc32c
import pytest

from threefs.common.status import StatusCode, ThreeFSError
from threefs.storage.chunk_engine import ChunkEngine, ChunkMeta
from threefs.storage.chunk_store_meta import SortedKeys

CHUNK = 64 * 1024
REPO = Path(__file__).resolve().parents[2]


def cid(inode: int, index: int = 0) -> bytes:
    """A 16-byte chunk id shaped like 3FS's: tenant, reserved, inode (8 B), track (2 B), index (4 B)."""
    return bytes(2) + inode.to_bytes(8, "big") + bytes(2) + index.to_bytes(4, "big")


@pytest.fixture
def engine(tmp_path):
    with ChunkEngine(str(tmp_path / "target")) as eng:
        yield eng


def data_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "data").rglob("*") if p.is_file())


def put(eng: ChunkEngine, chunk_id: bytes, data: bytes, *, offset: int = 0, chunk_size: int = CHUNK, **kw) -> ChunkMeta:
    """Write + commit the next version; returns the committed meta."""
    meta = eng.get_meta(chunk_id)
    ver = (meta.commit_ver if meta else 0) + 1
    eng.write(chunk_id, update_ver=ver, chain_ver=1, offset=offset, data=data, chunk_size=chunk_size, **kw)
    return eng.commit(chunk_id, ver)


def committed(eng: ChunkEngine, chunk_id: bytes) -> bytes:
    """Read the whole committed version back and check it against the stored CRC (pair assertion)."""
    data, meta = eng.read(chunk_id, 0, CHUNK * 2)
    assert len(data) == meta.length
    assert crc32c.crc32c(data) == meta.crc
    return bytes(data)


# -- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK])
def test_round_trip_sizes(engine, size):
    data = random.Random(size).randbytes(size)
    crc_before = crc32c.crc32c(data)
    meta = put(engine, cid(1), data)
    assert (meta.length, meta.crc, meta.commit_ver, meta.update_ver) == (size, crc_before, 1, 1)
    assert committed(engine, cid(1)) == data
    out = bytearray(CHUNK + 10)
    view, meta = engine.read(cid(1), 0, CHUNK + 10, out)
    assert isinstance(view, memoryview) and view.obj is out and bytes(view) == data
    assert crc32c.crc32c(view) == crc_before
    assert engine.verify(cid(1))
    # reads clamp at EOF: a short read at the end, nothing past it
    assert engine.read(cid(1), max(0, size - 1), 100)[0] == data[-1:]
    assert engine.read(cid(1), size + 5, 100)[0] == b""


def test_random_offsets_seeded(engine):
    rng = random.Random(1234)
    model = bytearray()
    for _ in range(60):
        offset = rng.randrange(CHUNK)
        data = rng.randbytes(rng.randrange(1, CHUNK - offset + 1))
        put(engine, cid(2), data, offset=offset)
        end = offset + len(data)
        if end > len(model):
            model.extend(bytes(end - len(model)))
        model[offset:end] = data
        assert committed(engine, cid(2)) == model
        piece_offset = rng.randrange(len(model))
        assert engine.read(cid(2), piece_offset, 777)[0] == model[piece_offset : piece_offset + 777]
    assert engine.verify(cid(2))
    assert len(data_files(Path(engine.path))) == 1, "old versions' files must be deleted at commit"
    assert engine.used_bytes() == len(model)


def test_overwrite_in_the_middle_and_append(engine):
    base = bytes(range(256)) * 256  # 64 KiB
    put(engine, cid(3), base)
    put(engine, cid(3), b"\xff" * 1000, offset=20000)
    expected = base[:20000] + b"\xff" * 1000 + base[21000:]
    assert committed(engine, cid(3)) == expected
    put(engine, cid(3, 1), b"abc")
    put(engine, cid(3, 1), b"def", offset=3)  # append in place
    put(engine, cid(3, 1), b"xyz", offset=10)  # past the end: a zero gap
    assert committed(engine, cid(3, 1)) == b"abcdef\0\0\0\0xyz"
    assert engine.verify(cid(3)) and engine.verify(cid(3, 1))


def test_write_into_a_new_chunk_at_an_offset_and_full_replace(engine):
    put(engine, cid(4), b"tail", offset=100)
    assert committed(engine, cid(4)) == bytes(100) + b"tail"
    put(engine, cid(4), b"short", full_replace=True)
    assert committed(engine, cid(4)) == b"short"
    put(engine, cid(4), b"AB")  # covers part of the chunk: copy-on-write keeps the rest
    assert committed(engine, cid(4)) == b"ABort"


# -- pending versions -------------------------------------------------------------------------------


def test_pending_invisible_until_commit(engine):
    put(engine, cid(5), b"version one")
    meta = engine.write(cid(5), update_ver=2, chain_ver=3, offset=8, data=b"two!", chunk_size=CHUNK, last_request=b"r2")
    assert (meta.commit_ver, meta.update_ver, meta.length, meta.pending_length) == (1, 2, 11, 12)
    assert meta.pending_crc == crc32c.crc32c(b"version two!") and meta.last_request == b"r2"
    assert engine.read(cid(5), 0, 100)[0] == b"version one"
    assert engine.read(cid(5), 0, 100, pending=True)[0] == b"version two!"
    meta = engine.commit(cid(5), 2)
    assert (meta.commit_ver, meta.update_ver, meta.chain_ver, meta.length) == (2, 2, 3, 12)
    assert committed(engine, cid(5)) == b"version two!"


def test_a_new_chunk_is_empty_until_committed(engine):
    meta = engine.write(cid(6), update_ver=1, chain_ver=1, offset=0, data=b"new", chunk_size=CHUNK)
    assert (meta.commit_ver, meta.length, meta.pending_length) == (0, 0, 3)
    assert engine.read(cid(6), 0, 10)[0] == b""
    assert engine.read(cid(6), 0, 10, pending=True)[0] == b"new"
    engine.abort(cid(6))
    assert engine.get_meta(cid(6)) is None
    assert data_files(Path(engine.path)) == []


def test_abort_keeps_the_committed_version_and_frees_the_pending(engine):
    put(engine, cid(7), b"0123456789")
    root = Path(engine.path)
    engine.write(cid(7), update_ver=2, chain_ver=1, offset=2, data=b"xx", chunk_size=CHUNK)  # copy-on-write
    assert len(data_files(root)) == 2
    engine.abort(cid(7))
    assert len(data_files(root)) == 1
    engine.write(cid(7), update_ver=2, chain_ver=1, offset=10, data=b"append", chunk_size=CHUNK)  # in place
    assert data_files(root)[0].stat().st_size == 16
    engine.abort(cid(7))
    assert data_files(root)[0].stat().st_size == 10, "an aborted in-place append is cut off"
    meta = engine.get_meta(cid(7))
    assert (meta.update_ver, meta.commit_ver, meta.pending_length) == (1, 1, 10)
    assert committed(engine, cid(7)) == b"0123456789"
    assert engine.used_bytes() == 10


def test_a_new_pending_version_replaces_the_old_one(engine):
    put(engine, cid(8), b"aaaa")
    engine.write(cid(8), update_ver=2, chain_ver=1, offset=4, data=b"bbbb", chunk_size=CHUNK)
    engine.write(cid(8), update_ver=2, chain_ver=1, offset=1, data=b"c", chunk_size=CHUNK)
    assert engine.read(cid(8), 0, 100, pending=True)[0] == b"acaa"
    engine.commit(cid(8), 2)
    assert committed(engine, cid(8)) == b"acaa"
    assert len(data_files(Path(engine.path))) == 1


def test_truncate_shorter_and_longer(engine):
    put(engine, cid(9), b"0123456789")
    meta = engine.truncate(cid(9), update_ver=2, chain_ver=1, length=4, chunk_size=CHUNK)
    assert meta.pending_length == 4 and engine.read(cid(9), 0, 100)[0] == b"0123456789"
    engine.commit(cid(9), 2)
    assert committed(engine, cid(9)) == b"0123"
    engine.truncate(cid(9), update_ver=3, chain_ver=1, length=9, chunk_size=CHUNK)
    engine.commit(cid(9), 3)
    assert committed(engine, cid(9)) == b"0123" + bytes(5)
    engine.truncate(cid(10), update_ver=1, chain_ver=1, length=100, chunk_size=CHUNK)  # creates a chunk
    engine.commit(cid(10), 1)
    assert committed(engine, cid(10)) == bytes(100)
    assert engine.verify(cid(9)) and engine.verify(cid(10))


def test_remove_and_commit(engine):
    put(engine, cid(11), b"doomed")
    meta = engine.remove(cid(11), update_ver=2, chain_ver=1, last_request=b"rm")
    assert meta.pending_remove and meta.update_ver == 2 and meta.pending_length == 0
    assert engine.read(cid(11), 0, 100)[0] == b"doomed"
    with pytest.raises(ThreeFSError) as err:
        engine.read(cid(11), 0, 100, pending=True)
    assert err.value.code == StatusCode.CHUNK_NOT_FOUND
    assert engine.commit(cid(11), 2) is None
    assert engine.get_meta(cid(11)) is None and engine.chunk_count() == 0 and engine.used_bytes() == 0
    assert data_files(Path(engine.path)) == []
    with pytest.raises(ThreeFSError) as err:
        engine.read(cid(11), 0, 1)
    assert err.value.code == StatusCode.CHUNK_NOT_FOUND
    assert engine.commit(cid(11), 2) is None, "a repeated commit of a removal is a no-op"
    assert engine.remove(cid(11), update_ver=3, chain_ver=1) is None


def test_commit_of_a_version_that_is_not_pending(engine):
    put(engine, cid(12), b"v1")
    put(engine, cid(12), b"v2")
    assert engine.commit(cid(12), 2).commit_ver == 2  # already committed: no-op
    assert engine.commit(cid(12), 1).commit_ver == 2
    with pytest.raises(ThreeFSError) as err:
        engine.commit(cid(12), 3)
    assert err.value.code == StatusCode.MISSING_UPDATE
    engine.write(cid(12), update_ver=5, chain_ver=1, offset=0, data=b"v5", chunk_size=CHUNK)
    with pytest.raises(ThreeFSError) as err:
        engine.commit(cid(12), 4)
    assert err.value.code == StatusCode.STALE_UPDATE
    with pytest.raises(ThreeFSError) as err:
        engine.commit(cid(12), 6)
    assert err.value.code == StatusCode.MISSING_UPDATE
    assert engine.commit(cid(12), 5, chain_ver=9).chain_ver == 9


def test_set_versions(engine):
    put(engine, cid(13), b"data")
    meta = engine.set_versions(cid(13), update_ver=7, commit_ver=7, chain_ver=4)
    assert (meta.update_ver, meta.commit_ver, meta.chain_ver, meta.length) == (7, 7, 4, 4)
    meta = engine.set_versions(cid(13), update_ver=9, commit_ver=8, chain_ver=4)
    assert (meta.update_ver, meta.commit_ver, meta.pending_length) == (9, 8, 4)
    assert engine.commit(cid(13), 9).commit_ver == 9
    assert committed(engine, cid(13)) == b"data" and engine.verify(cid(13))
    with pytest.raises(ThreeFSError):
        engine.set_versions(cid(99), update_ver=1, commit_ver=1, chain_ver=1)


def test_invalid_arguments(engine):
    def code_of(fn, *args, **kw):
        with pytest.raises(ThreeFSError) as err:
            fn(*args, **kw)
        return err.value.code

    bad = StatusCode.INVALID_ARGUMENT
    assert code_of(engine.get_meta, b"short") == bad
    assert code_of(engine.write, cid(1), update_ver=1, chain_ver=1, offset=CHUNK - 1, data=b"xx",
                   chunk_size=CHUNK) == bad
    assert code_of(engine.write, cid(1), update_ver=1, chain_ver=1, offset=0, data=b"x", chunk_size=128 << 20) == bad
    assert code_of(engine.write, cid(1), update_ver=1, chain_ver=1, offset=3, data=b"x", chunk_size=CHUNK,
                   full_replace=True) == bad
    assert code_of(engine.truncate, cid(1), update_ver=1, chain_ver=1, length=CHUNK + 1, chunk_size=CHUNK) == bad
    assert code_of(engine.read, cid(1), 0, 10, bytearray(5)) == bad
    assert code_of(engine.read, cid(1), 0, 10) == StatusCode.CHUNK_NOT_FOUND
    assert engine.chunk_count() == 0


# -- ordering -------------------------------------------------------------------------------------


def test_iter_metas_ordering_range_reverse_limit(engine):
    ids = [cid(inode, index) for inode in (5, 3, 4) for index in (2, 0, 1, 10)]
    for chunk_id in ids:
        put(engine, chunk_id, chunk_id)
    engine.write(cid(4, 11), update_ver=1, chain_ver=1, offset=0, data=b"p", chunk_size=CHUNK)  # pending only
    everything = [m.chunk_id for m in engine.iter_metas()]
    assert everything == sorted([*ids, cid(4, 11)])
    inode4 = [m.chunk_id for m in engine.iter_metas(cid(4, 0), cid(5, 0))]
    assert inode4 == [cid(4, i) for i in (0, 1, 2, 10, 11)]
    last = engine.iter_metas(cid(4, 0), cid(5, 0), reverse=True, limit=1)
    assert [m.chunk_id for m in last] == [cid(4, 11)] and last[0].commit_ver == 0
    assert [m.chunk_id for m in engine.iter_metas(cid(3, 1), reverse=True, limit=2)] == [cid(5, 10), cid(5, 2)]
    assert [m.chunk_id for m in engine.iter_metas(end=cid(3, 2), reverse=True)] == [cid(3, 1), cid(3, 0)]
    assert engine.iter_metas(cid(6, 0)) == [] and engine.iter_metas(cid(3, 0), cid(3, 0)) == []
    assert engine.chunk_count() == 13


def test_sorted_keys_against_a_sorted_list(monkeypatch):
    monkeypatch.setattr(SortedKeys, "BUCKET_MAX", 8)
    rng = random.Random(99)
    keys = SortedKeys([rng.randbytes(2) for _ in range(50)])
    model = sorted(set(keys.irange(b"", None)))
    for _ in range(3000):
        key = rng.randbytes(2)
        if rng.random() < 0.6:
            keys.add(key)
            model = sorted(set(model) | {key})
        else:
            keys.discard(key)
            model = [k for k in model if k != key]
        if rng.random() < 0.05:
            begin, end = sorted([rng.randbytes(2), rng.randbytes(2)])
            assert list(keys.irange(begin, end)) == [k for k in model if begin <= k < end]
            assert list(keys.irange(begin, end, reverse=True)) == [k for k in reversed(model) if begin <= k < end]
    assert list(keys.irange(b"", None)) == model and len(keys) == len(model)


# -- persistence, concurrency -----------------------------------------------------------------------


def test_persistence_across_reopen(tmp_path):
    root = tmp_path / "target"
    with ChunkEngine(str(root)) as eng:
        put(eng, cid(1), b"one", last_request=b"req-1")
        put(eng, cid(2), b"two")
        put(eng, cid(2), b"++", offset=3)
        put(eng, cid(3), b"three")
        eng.remove(cid(3), update_ver=2, chain_ver=1)
        eng.commit(cid(3), 2)
        eng.write(cid(1), update_ver=2, chain_ver=1, offset=3, data=b"pending", chunk_size=CHUNK)
        eng.write(cid(4), update_ver=1, chain_ver=1, offset=0, data=b"never committed", chunk_size=CHUNK)
        before = {m.chunk_id: m for m in eng.iter_metas()}
    with ChunkEngine(str(root)) as eng:
        metas = {m.chunk_id: m for m in eng.iter_metas()}
        assert sorted(metas) == [cid(1), cid(2), cid(4)], "pending versions survive a restart"
        assert metas == before
        assert (metas[cid(1)].update_ver, metas[cid(1)].commit_ver) == (2, 1)
        assert committed(eng, cid(1)) == b"one" and committed(eng, cid(2)) == b"two++"
        assert eng.read(cid(1), 0, 100, pending=True)[0] == b"onepending"
        assert eng.read(cid(4), 0, 100, pending=True)[0] == b"never committed"
        assert eng.commit(cid(1), 2).length == 10 and committed(eng, cid(1)) == b"onepending"
        assert len(data_files(root)) == 3
        assert eng.used_bytes() == 10 + 5 + 15


def test_fsync_mode_round_trip(tmp_path):
    root = tmp_path / "target"
    with ChunkEngine(str(root), fsync=True) as eng:
        put(eng, cid(1), b"durable")
        put(eng, cid(1), b"!", offset=7)  # in place
        put(eng, cid(1), b"D")  # copy-on-write
        eng.remove(cid(1), update_ver=4, chain_ver=1)
        eng.commit(cid(1), 4)
        put(eng, cid(2), b"kept")
    with ChunkEngine(str(root), fsync=True) as eng:
        assert [m.chunk_id for m in eng.iter_metas()] == [cid(2)]
        assert committed(eng, cid(2)) == b"kept"


def test_a_target_opens_once(tmp_path):
    with ChunkEngine(str(tmp_path / "t")):
        with pytest.raises(ThreeFSError) as err:
            ChunkEngine(str(tmp_path / "t"))
        assert err.value.code == StatusCode.BUSY


def test_metadata_log_compaction_and_torn_tail(tmp_path):
    root = tmp_path / "target"
    rng = random.Random(5)
    with ChunkEngine(str(root), meta_log_bytes_min=4096) as eng:
        for i in range(300):
            put(eng, cid(i % 20), rng.randbytes(rng.randrange(100)))
        assert eng._log.compactions > 0
        end = eng._log.bytes
        expected = eng.iter_metas()
    with open(root / "meta.log", "r+b") as f:  # a frame torn by a crash: a header and half a payload
        f.seek(end)
        f.write(b"\x40\x00\x00\x00\x12\x34\x56\x78" + b"garbage")
    with ChunkEngine(str(root), meta_log_bytes_min=4096) as eng:
        assert eng.iter_metas() == expected
        put(eng, cid(0), b"after the tear", full_replace=True)
    with ChunkEngine(str(root)) as eng:
        assert committed(eng, cid(0)) == b"after the tear"
        assert all(eng.verify(m.chunk_id) for m in eng.iter_metas())


def test_concurrent_writers_on_different_chunks(engine):
    errors: list[BaseException] = []

    def worker(t: int):
        rng = random.Random(t)
        try:
            for i in range(25):
                data = rng.randbytes(rng.randrange(1, CHUNK))
                put(engine, cid(100 + t, i % 5), data, full_replace=True)
                assert committed(engine, cid(100 + t, i % 5)) == data
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert engine.chunk_count() == 20
    assert all(engine.verify(m.chunk_id) for m in engine.iter_metas())
    assert len(data_files(Path(engine.path))) == 20


def test_random_operations_against_a_model(tmp_path):
    """Seeded random writes/truncates/removes/commits/aborts/reopens, checked against a dict model."""
    root, rng = str(tmp_path / "target"), random.Random(2024)
    eng = ChunkEngine(root)
    model: dict[bytes, bytes] = {}  # committed contents
    pending: dict[bytes, tuple[int, bytes | None]] = {}  # version, contents (None: removal)
    try:
        for step in range(400):
            chunk_id = cid(1, rng.randrange(4))
            base = model.get(chunk_id)
            ver = eng.get_meta(chunk_id).commit_ver + 1 if eng.get_meta(chunk_id) else 1
            action = rng.random()
            if action < 0.4:
                offset = rng.choice([0, len(base or b""), rng.randrange(CHUNK)])
                data = rng.randbytes(rng.randrange(0, CHUNK - offset + 1) // rng.choice([1, 16]))
                eng.write(chunk_id, update_ver=ver, chain_ver=1, offset=offset, data=data, chunk_size=CHUNK)
                new = bytearray(base or b"")
                new.extend(bytes(max(0, offset + len(data) - len(new))))
                new[offset : offset + len(data)] = data
                pending[chunk_id] = (ver, bytes(new))
            elif action < 0.55:
                length = rng.randrange(CHUNK + 1)
                eng.truncate(chunk_id, update_ver=ver, chain_ver=1, length=length, chunk_size=CHUNK)
                pending[chunk_id] = (ver, (base or b"")[:length].ljust(length, b"\0"))
            elif action < 0.62:
                if eng.remove(chunk_id, update_ver=ver, chain_ver=1) is not None:
                    pending[chunk_id] = (ver, None)
            elif action < 0.85 and chunk_id in pending:
                ver, new = pending.pop(chunk_id)
                eng.commit(chunk_id, ver)
                if new is None:
                    model.pop(chunk_id, None)
                else:
                    model[chunk_id] = new
            elif action < 0.92:
                eng.abort(chunk_id)
                pending.pop(chunk_id, None)
            elif action < 0.95:
                eng.close()
                eng = ChunkEngine(root)  # pending versions are logged: they survive
            check_against_model(eng, chunk_id, model, pending)
        assert sorted(m.chunk_id for m in eng.iter_metas() if m.commit_ver) == sorted(model)
        for chunk_id in list(pending):  # logged pending versions would survive the reopen below
            eng.abort(chunk_id)
    finally:
        eng.close()
    with ChunkEngine(root) as eng:
        assert len(data_files(Path(root))) == len(model) == eng.chunk_count()
        assert eng.used_bytes() == sum(len(v) for v in model.values())


def check_against_model(eng, chunk_id, model, pending) -> None:
    meta = eng.get_meta(chunk_id)
    if chunk_id not in model and chunk_id not in pending:
        assert meta is None
        return
    if chunk_id in model:
        assert committed(eng, chunk_id) == model[chunk_id]
        assert meta.crc == crc32c.crc32c(model[chunk_id])
    if chunk_id in pending and pending[chunk_id][1] is not None:
        data, _ = eng.read(chunk_id, 0, CHUNK, pending=True)
        assert data == pending[chunk_id][1] and meta.pending_crc == crc32c.crc32c(data)
        assert meta.update_ver == pending[chunk_id][0]


# -- integrity --------------------------------------------------------------------------------------


def test_bit_flip_is_detected_by_verify(engine):
    data = random.Random(3).randbytes(CHUNK)
    put(engine, cid(20), data)
    put(engine, cid(21), data)
    assert engine.verify(cid(20))
    path = next(p for p in data_files(Path(engine.path)) if p.name.startswith(cid(20).hex()))
    with open(path, "r+b") as f:
        f.seek(12345)
        byte = f.read(1)[0]
        f.seek(12345)
        f.write(bytes([byte ^ 0x10]))
    assert not engine.verify(cid(20))
    assert engine.verify(cid(21))
    os.truncate(path, 100)  # a short file is corruption too
    assert not engine.verify(cid(20))
    with pytest.raises(ThreeFSError) as err:
        engine.read(cid(20), 0, CHUNK)
    assert err.value.code == StatusCode.IO_ERROR


# -- crash safety -----------------------------------------------------------------------------------

CHILD = r"""
import os, random, sys
import crc32c
from threefs.storage.chunk_engine import ChunkEngine

target, ack_path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
CHUNK = 64 * 1024
rng = random.Random(seed)
eng = ChunkEngine(target, meta_log_bytes_min=2048)  # compact often: kills land inside compactions too
ack = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
ids = [bytes(15) + bytes([i]) for i in range(5)]
print("ready", flush=True)
while True:
    i = rng.randrange(len(ids))
    meta = eng.get_meta(ids[i])
    old = bytes(eng.read(ids[i], 0, CHUNK)[0]) if meta else b""
    ver = (meta.commit_ver if meta else 0) + 1
    op = rng.random()
    if op < 0.1 and meta:
        eng.remove(ids[i], update_ver=ver, chain_ver=1)
        new = None
    elif op < 0.25:
        length = rng.randrange(CHUNK + 1)
        eng.truncate(ids[i], update_ver=ver, chain_ver=1, length=length, chunk_size=CHUNK)
        new = old[:length].ljust(length, b"\0")
    else:
        offset = rng.choice([0, len(old), rng.randrange(CHUNK)])
        data = rng.randbytes(rng.randrange(CHUNK - offset + 1))
        full = offset == 0 and rng.random() < 0.3
        eng.write(ids[i], update_ver=ver, chain_ver=1, offset=offset, data=data, chunk_size=CHUNK, full_replace=full)
        if full:
            new = data
        else:
            new = (old + bytes(max(0, offset - len(old))))[:offset] + data + old[offset + len(data):]
    state = "none" if new is None else f"{ver} {len(new)} {crc32c.crc32c(new)}"
    os.write(ack, f"I {i} {ver} {state}\n".encode())  # intent: the commit may happen from here on
    result = eng.commit(ids[i], ver)
    assert (result is None) == (new is None) and (new is None or result.crc == crc32c.crc32c(new))
    os.write(ack, f"A {i} {ver}\n".encode())
"""


def expected_states(ack_log: str) -> dict[int, set[str]]:
    """Per chunk: the states allowed after a crash: the last acknowledged commit ("none" if there is none
    or it was a removal) and the commit in progress, as "commit_ver length crc" or "none"."""
    acked: dict[int, str] = {}
    intent: dict[int, str | None] = {}
    for line in ack_log.splitlines():
        kind, index, ver, *state = line.split(" ", 3)
        i = int(index)
        if kind == "I":
            intent[i] = state[0]
        else:
            assert intent[i] is not None
            acked[i], intent[i] = intent[i], None
    return {i: {acked.get(i, "none"), intent.get(i) or acked.get(i, "none")} for i in set(acked) | set(intent)}


def state_of(meta: ChunkMeta | None) -> str:
    return "none" if meta is None or not meta.commit_ver else f"{meta.commit_ver} {meta.length} {meta.crc}"


def test_crash_safety_with_kill_9(tmp_path):
    root, ack_path = tmp_path / "target", tmp_path / "acks.log"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    rng = random.Random(77)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for round_ in range(8):
        child = subprocess.Popen([sys.executable, str(script), str(root), str(ack_path), str(round_)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            if round_ % 4 == 3:  # kill anywhere, start-up and its reclaim included
                time.sleep(rng.uniform(0.05, 0.3))
            else:
                assert child.stdout.readline() == b"ready\n", child.stderr.read().decode()
                time.sleep(rng.uniform(0.0, 0.3))
            assert child.poll() is None, child.stderr.read().decode()
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
            child.stderr.close()
        check_after_crash(root, ack_path.read_text())
    assert len(ack_path.read_text().splitlines()) > 100, "the child should have committed many versions"


def check_after_crash(root: Path, ack_log: str) -> None:
    allowed = expected_states(ack_log)
    with ChunkEngine(str(root)) as eng:
        for i, states in allowed.items():
            chunk_id = bytes(15) + bytes([i])
            meta = eng.get_meta(chunk_id)
            assert state_of(meta) in states, (i, meta, states)
            if meta is not None:
                if meta.update_ver != meta.commit_ver and not meta.pending_remove:  # a logged pending version
                    data, _ = eng.read(chunk_id, 0, CHUNK, pending=True)
                    assert crc32c.crc32c(data) == meta.pending_crc and len(data) == meta.pending_length
                if meta.commit_ver:
                    assert eng.verify(chunk_id)
                    assert committed(eng, chunk_id) is not None
        files = data_files(root)
        named = {(m.chunk_id, g) for m in eng.iter_metas() for g in eng._gens(m.chunk_id)}
        assert len(files) == len(named), "leftover files of unlogged versions"
        assert sum(f.stat().st_size for f in files) == eng.used_bytes(), "uncut in-place tails"
        assert not (root / "meta.log.new").exists()


# -- full disk ------------------------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmpfs):
    return tmpfs("4m")


def test_disk_full_on_a_tiny_tmpfs(tiny_tmpfs):
    root = tiny_tmpfs / "target"
    with ChunkEngine(str(root)) as eng:
        written = fill(eng)
        assert written, "some chunks must fit"
        files = data_files(root)
        assert len(files) == eng.chunk_count() == len(written), "a failed write leaves no file behind"
        big, small = list(written)[0], list(written)[-1]
        assert len(written[big]) == 40 * 1024 and len(written[small]) == 4096
        for victim, offset, size in ((big, 1, CHUNK - 2), (small, 4096, CHUNK // 2)):  # copy-on-write, in place
            with pytest.raises(ThreeFSError) as err:
                eng.write(victim, update_ver=2, chain_ver=1, offset=offset, data=os.urandom(size), chunk_size=CHUNK)
            assert err.value.code == StatusCode.NO_SPACE and "is full" in err.value.message
            meta = eng.get_meta(victim)
            assert meta.update_ver == meta.commit_ver == 1 and committed(eng, victim) == written[victim]
        assert sum(f.stat().st_size for f in data_files(root)) == eng.used_bytes()
        for chunk_id in list(written)[:4]:  # removals still commit on a full disk: space comes back
            eng.remove(chunk_id, update_ver=2, chain_ver=1)
            assert eng.commit(chunk_id, 2) is None
            del written[chunk_id]
        put(eng, cid(999), b"x" * (CHUNK // 2))
        assert all(committed(eng, c) == d for c, d in written.items())
    with ChunkEngine(str(root)) as eng:
        assert all(eng.verify(c) for c in written) and eng.chunk_count() == len(written) + 1


def fill(eng: ChunkEngine) -> dict[bytes, bytes]:
    """Commit chunks of shrinking size until even a 4 KiB chunk no longer fits; return them."""
    written: dict[bytes, bytes] = {}
    for size in (40 * 1024, 4096):  # 40 KiB does not divide the free space: 4 KiB chunks fill the rest
        while True:
            chunk_id, data = cid(len(written) + 1), os.urandom(size)
            try:
                put(eng, chunk_id, data)
            except ThreeFSError as err:
                assert err.code == StatusCode.NO_SPACE
                assert eng.get_meta(chunk_id) is None
                break
            written[chunk_id] = data
            assert len(written) < 10_000
    return written
