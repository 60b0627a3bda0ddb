"""In-place migration of a v1 target (meta.log + one file per chunk version) to chunk engine v2.

Resumable: v1's files are only read until every chunk is in the v2 store; chunks move in batches, each one
SQLite transaction (a batch's blocks are not in any persisted bitmap until it commits, so a kill leaves no
leak), and a chunk already in the v2 store is skipped. When all are in, meta.log is renamed to
meta.log.migrated (the switch: from then on v2 is the authority), then v1's data/ tree and that file are
deleted; a kill during the deletion is finished at the next open.
"""

from __future__ import annotations

import logging
import os
import shutil

from threefs.common import crc32c
from threefs.common.status import StatusCode, status_error
from threefs.storage.chunk_store_meta import MetaLog

log = logging.getLogger(__name__)

BATCH_CHUNKS = 512


def v1_file(path: str, chunk_id: bytes, gen: int) -> str:
    sub = f"{crc32c.crc32c(chunk_id) & 0xFF:02x}"
    return os.path.join(path, "data", sub, f"{chunk_id.hex()}.{gen:x}")


def _read_v1(path: str, chunk_id: bytes, gen: int, length: int) -> bytes:
    file = v1_file(path, chunk_id, gen)
    try:
        with open(file, "rb") as f:
            data = f.read(length)
    except OSError as exc:
        raise status_error(StatusCode.IO_ERROR, f"migrating {path}: cannot read {file}: {exc.strerror}") from exc
    if len(data) != length:
        raise status_error(StatusCode.IO_ERROR, f"migrating {path}: {file} is {len(data)} bytes, its metadata says "
                           f"{length}; fix or remove the chunk with the v1 engine first")
    return data


def finish_cleanup(path: str) -> None:
    if os.path.exists(os.path.join(path, "meta.log.migrated")):
        shutil.rmtree(os.path.join(path, "data"), ignore_errors=True)
        os.unlink(os.path.join(path, "meta.log.migrated"))


def migrate_v1(eng) -> int:
    """Move every chunk of the v1 target at eng.path into `eng` (a ChunkEngineV2 on the same directory);
    returns the number of chunks moved by this call."""
    from threefs.storage.chunk_engine_v2 import Pending, State

    path = eng.path
    meta_log = MetaLog(os.path.join(path, "meta.log"), fsync=False)
    stored, pendings = meta_log.load()
    meta_log.close()
    ids = sorted(stored.keys() | pendings.keys())
    moved = 0
    log.info("target %s: migrating %d chunks from chunk engine v1 to v2", path, len(ids))
    for start in range(0, len(ids), BATCH_CHUNKS):
        todo = [c for c in ids[start:start + BATCH_CHUNKS] if eng.get_meta(c) is None]
        if not todo:
            continue
        with eng.batch():
            for chunk_id in todo:
                s, p = stored.get(chunk_id), pendings.get(chunk_id)
                pos = None
                if s is not None:
                    pos = _copy_in(eng, _read_v1(path, chunk_id, s.gen, s.length))
                pending = None
                if p is not None:
                    if p.remove:
                        pending = Pending(p.update_ver, p.chain_ver, 0, 0, None, None, True, p.last_request)
                    else:
                        ppos = _copy_in(eng, _read_v1(path, chunk_id, p.gen, p.length))
                        pending = Pending(p.update_ver, p.chain_ver, p.length, p.crc, ppos, None, False,
                                          p.last_request)
                if s is not None:
                    st = State(s.chain_ver, s.commit_ver, s.length, s.crc, pos, None, s.last_request, pending)
                else:
                    st = State(0, 0, 0, 0, None, None, b"", pending)
                with eng._lock:
                    eng._set(chunk_id, None, st)
                moved += 1
        eng._sync_all()
    eng._sync_all()
    os.rename(os.path.join(path, "meta.log"), os.path.join(path, "meta.log.migrated"))
    finish_cleanup(path)
    log.info("target %s: migrated to chunk engine v2 (%d chunks moved now, %d in all)", path, moved, len(ids))
    return moved


def _copy_in(eng, data: bytes) -> int | None:
    pos = eng._alloc(len(data))
    if pos is not None:
        eng._pwrite(pos, 0, [data])
    return pos
