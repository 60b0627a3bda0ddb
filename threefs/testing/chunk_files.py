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


def flip_bit(where: tuple[Path, int], offset: int) -> None:
    """Damage one byte of a chunk on disk: `where` is (file, chunk base) as chunk_replicas gives it; the
    byte at base + offset gets bit 4 flipped."""
    path, base = where
    with open(path, "r+b") as f:
        f.seek(base + offset)
        byte = f.read(1)
        f.seek(base + offset)
        f.write(bytes([byte[0] ^ 0x10]))


def random_committed_byte(data_dir: str | Path, rng) -> tuple[Path, int, str] | None:
    """A random byte of a random chunk's committed bytes on a random target under data_dir: (file, offset
    in it, what it is), or None when no target holds a committed chunk yet. v1: any chunk version file;
    v2: a chunk listed by the target's metadata (SQLite read-only plus its journal), at its block."""
    import sqlite3

    from threefs.storage.chunk_engine_v2 import (block_size, committed_position, pos_block, pos_class, pos_file,
                                                 read_journals)

    # a target is a directory two levels down (LocalCluster: storage-N/target-M; netns hosts: sN/tM)
    targets = sorted(t for t in Path(data_dir).glob("*/*") if (t / "meta.sqlite").exists() or (t / "data").is_dir())
    rng.shuffle(targets)
    for target in targets:
        if not (target / "meta.sqlite").exists():  # v1: one file per committed chunk version
            files = []
            for p in sorted(target.glob("data/*/*")):
                try:
                    if p.is_file() and p.stat().st_size > 0:
                        files.append(p)
                except FileNotFoundError:
                    continue  # replaced or removed by the storage service since the listing
            if files:
                victim = rng.choice(files)
                try:
                    size = victim.stat().st_size
                except FileNotFoundError:
                    continue
                if size:
                    return victim, rng.randrange(size), f"chunk file {victim.name}"
            continue
        try:
            db = sqlite3.connect(f"file:{target / 'meta.sqlite'}?mode=ro", uri=True, timeout=10)
            try:
                ids = {row[0] for row in db.execute("SELECT id FROM chunks")}
            finally:
                db.close()
        except sqlite3.Error:
            continue  # being created
        ids.update(cid for _, cid, _ in read_journals(str(target)))
        candidates = sorted(ids)
        rng.shuffle(candidates)
        for cid in candidates[:64]:
            found = committed_position(str(target), cid)
            if found is None or found[1] <= 0:
                continue
            pos, length = found
            path = target / "blocks" / f"c{pos_class(pos):02d}.{pos_file(pos):03d}"
            at = rng.randrange(length)
            return path, pos_block(pos) * block_size(pos_class(pos)) + at, f"chunk {cid.hex()} byte {at}"
    return None
