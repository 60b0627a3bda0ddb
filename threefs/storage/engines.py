"""Which chunk engine opens a target: `open_chunk_engine(path, kind, fsync=...)`.

kind is "v1" (threefs/storage/chunk_engine.py: a file per chunk version + a metadata log), "v2"
(threefs/storage/chunk_engine_v2.py: size-classed blocks + SQLite), or "" for the default: the
environment variable THREEFS_CHUNK_ENGINE if set, else DEFAULT_ENGINE (v2: new targets get v2; an existing v1
target keeps opening as v1 until it is migrated). A target keeps the engine that wrote it unless asked otherwise: "v2" on a v1 target migrates it in place (resumable); "v1" on a v2 target is
refused with a message (there is no way back); "" on an existing target uses the engine that wrote it.
"""

from __future__ import annotations

import os

from threefs.common.status import StatusCode, status_error

DEFAULT_ENGINE = "v2"
KINDS = ("v1", "v2")


def target_format(path: str) -> str | None:
    """"v1", "v2", "migrating" (v1 -> v2 started, not finished: v2 continues it) or None (new)."""
    v1 = os.path.exists(os.path.join(path, "meta.log"))
    v2 = os.path.exists(os.path.join(path, "meta.sqlite"))
    if v1 and v2:
        return "migrating"
    return "v1" if v1 else "v2" if v2 else None


def open_chunk_engine(path: str, kind: str = "", *, fsync: bool = False, write_cache: bool = True):
    found = target_format(path)
    if not kind:
        kind = {"migrating": "v2"}.get(found, found) or os.environ.get("THREEFS_CHUNK_ENGINE") or DEFAULT_ENGINE
    if kind not in KINDS:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"unknown chunk engine {kind!r} for target {path}: "
                           f"use one of {', '.join(KINDS)}")
    if kind == "v1":
        from threefs.storage.chunk_engine import ChunkEngine

        return ChunkEngine(path, fsync=fsync)
    from threefs.storage.chunk_engine_v2 import ChunkEngineV2

    return ChunkEngineV2(path, fsync=fsync, write_cache=write_cache)


def target_space(engine, fs_space) -> tuple[int, int, str]:
    """(used bytes, free bytes, file system id) of a target for heartbeats (statfs, `threefs status`).
    v2 answers from its allocator: used = blocks chunks own; free = the file system's free space plus
    the free blocks of groups already allocated in its data files (they hold no chunk)."""
    free, fs_id = fs_space(engine.path)
    space = getattr(engine, "space", None)
    if space is None:
        return engine.used_bytes(), free, fs_id
    figures = space()
    return figures["used_bytes"], free + figures["reusable_bytes"], fs_id
