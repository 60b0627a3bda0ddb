"""Where a chunk's committed bytes sit on disk, for tests that damage them on purpose (bit flips).

Works on both chunk engines while the storage services run: v1 keeps one file per chunk version
(data/<xx>/<id>.<gen>, bytes from offset 0); v2 keeps blocks in shared data files, found through its
SQLite metadata opened read-only plus its journal (blocks/c<kk>.<fff> at block * block size).
"""

from __future__ import annotations

from pathlib import Path


def chunk_replicas(data_dir: str | Path, chunk_id: bytes) -> list[tuple[Path, int]]:
    """(file, offset of byte 0 of the committed chunk) on every target under data_dir holding it."""
    from threefs.storage.chunk_engine_v2 import block_size, committed_position, pos_block, pos_class, pos_file

    out = []
    for target in sorted(Path(data_dir).glob("storage-*/target-*")):
        if (target / "meta.sqlite").exists():
            found = committed_position(str(target), chunk_id)  # SQLite plus its journal
            if found is not None:
                pos = found[0]
                path = target / "blocks" / f"c{pos_class(pos):02d}.{pos_file(pos):03d}"
                out.append((path, pos_block(pos) * block_size(pos_class(pos))))
        else:
            out.extend((path, 0) for path in sorted(target.glob(f"data/*/{chunk_id.hex()}.*")))
    return out
