"""The scrub's per-batch check on real engines: chunks removed while a pass runs are skipped (a
delete-heavy load removes chunks between the pass listing them and checking them; this used to end the
pass with CHUNK_NOT_FOUND: "scrub pass failed" tracebacks in soak logs), damaged ones are reported."""

from __future__ import annotations

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
