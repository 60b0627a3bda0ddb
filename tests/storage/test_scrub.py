"""The scrub's per-batch check on real engines: chunks removed while a pass runs are skipped (a
delete-heavy load removes chunks between the pass listing them and checking them; this used to end the
pass with CHUNK_NOT_FOUND: "scrub pass failed" tracebacks in soak logs), damaged ones are reported."""

from __future__ import annotations

import os

import pytest

from threefs.storage.chunk_engine import ChunkEngine
from threefs.storage.chunk_engine_v2 import ChunkEngineV2
from threefs.storage.scrub import _verify_batch

CHUNK = 4096


def cid(i: int) -> bytes:
    return bytes(15) + bytes([i])


@pytest.mark.parametrize("engine_type", [ChunkEngine, ChunkEngineV2])
def test_verify_batch_skips_chunks_removed_since_listing(tmp_path, engine_type):
    engine = engine_type(str(tmp_path / "t"))
    try:
        for i in range(4):
            engine.write(cid(i), update_ver=1, chain_ver=1, offset=0, data=bytes([i + 1]) * 3000,
                         chunk_size=CHUNK)
            engine.commit(cid(i), 1, chain_ver=1)
        listed = [m.chunk_id for m in engine.iter_metas() if m.commit_ver]
        assert listed == [cid(i) for i in range(4)]
        for i in (1, 3):  # removed after the pass listed them
            engine.remove(cid(i), update_ver=2, chain_ver=1)
            engine.commit(cid(i), 2, chain_ver=1)
        assert _verify_batch(engine, listed) == (2, [])
    finally:
        engine.close()


def test_a_partial_read_checks_the_committed_version_while_a_pending_one_exists(tmp_path):
    """A byte flipped on disk in a committed chunk is never served by a partial read, also while a write
    (or the repair of that damage) has a pending version of the chunk: the committed bytes are checked
    against the committed checksum. (They were served unchecked then: an e2e bit-flip test read the flipped
    byte while the repair it had started was under way.)"""
    from threefs.common.status import StatusCode
    from threefs.rpc.schemas import storage as ss
    from threefs.storage.service import StorageService, VerifiedChunks

    engine = ChunkEngineV2(str(tmp_path / "t"))
    try:
        good = bytes(range(256)) * 16  # 4 KiB
        engine.write(cid(1), update_ver=1, chain_ver=1, offset=0, data=good, chunk_size=CHUNK)
        engine.commit(cid(1), 1)
        with engine._lock:
            pos = engine._get(cid(1)).pos
        fd, off = engine._where(pos)
        os.pwrite(fd, bytes([good[1000] ^ 0x40]), off + 1000)  # damage at rest
        engine.write(cid(1), update_ver=2, chain_ver=1, offset=0, data=good, chunk_size=CHUNK)  # pending
        assert engine.get_meta(cid(1)).update_ver == 2 and engine.get_meta(cid(1)).commit_ver == 1
        verified = VerifiedChunks()
        out = memoryview(bytearray(512))
        res = StorageService._read_part_checked(engine, ss.ReadIO(0, 7, cid(1), 768, 512), out, False, verified)
        assert res.status == StatusCode.CHECKSUM_MISMATCH and res.length == 0, res
        assert (7, cid(1), 1, engine.get_meta(cid(1)).crc) not in verified
        engine.commit(cid(1), 2)  # the new version's bytes are good: served, and remembered as checked
        res = StorageService._read_part_checked(engine, ss.ReadIO(0, 7, cid(1), 768, 512), out, False, verified)
        assert res.status == 0 and bytes(out[:res.length]) == good[768:1280]
        assert (7, cid(1), 2, engine.get_meta(cid(1)).crc) in verified
    finally:
        engine.close()
