"""Raw record files on threefs (`threefs://` paths, straight through the client's batch IO) or on a local
disk. Big buffers go out as one batch write (all chunks in flight together) and come back as one batch read
into a preallocated numpy array, so the bytes are copied only by the socket layer."""

from __future__ import annotations

import os
from typing import List, Sequence, Tuple

import numpy as np

from threefs.pond.common import PondError
from threefs.pond.io import filesystem as pfs

Piece = Tuple[str, int, int]  # (path, offset, length)
BATCH_ITEMS = 4096            # pieces per batch call (the client takes up to 100,000)


def is_threefs(path: str) -> bool:
    return pfs.is_threefs(path)


def strip(path: str) -> str:
    """The client's path of a threefs:// URL."""
    return "/" + path[len(pfs.THREEFS_PREFIX):].strip("/")


def client():
    """This process's threefs client (the one pond's fsspec file system holds; workers get the driver's
    config through the runtime context)."""
    return pfs.threefs_fs().client


def makedirs(path: str, chunk_size: int = 0) -> None:
    if is_threefs(path):
        c = client()
        p = strip(path)
        if not c.exists(p):
            c.mkdir(p, parents=True, exist_ok=True, chunk_size=chunk_size)
    else:
        os.makedirs(path, exist_ok=True)


def size(path: str) -> int:
    if is_threefs(path):
        return client().stat(strip(path)).length
    return os.path.getsize(path)


def listdir(path: str) -> List[str]:
    if is_threefs(path):
        return sorted(client().listdir(strip(path)))
    return sorted(os.listdir(path))


def exists(path: str) -> bool:
    return client().exists(strip(path)) if is_threefs(path) else os.path.exists(path)


def read_pieces(pieces: Sequence[Piece], out: np.ndarray) -> None:
    """Read the pieces back to back into `out` (a uint8 array of their total length)."""
    views, pos = [], 0
    for path, offset, length in pieces:
        views.append((path, offset, length, out[pos:pos + length]))
        pos += length
    if pos != out.size:
        raise ValueError(f"buffer of {out.size} bytes for {pos} bytes of pieces")
    for start in range(0, len(views), BATCH_ITEMS):
        group = [v for v in views[start:start + BATCH_ITEMS] if v[2] > 0]
        if not group:
            continue
        if group[0][0].startswith(pfs.THREEFS_PREFIX):
            got = client().batch_read([(strip(p), off, buf) for p, off, _, buf in group])
        else:
            got = []
            for p, off, length, buf in group:
                with open(p, "rb", buffering=0) as f:
                    f.seek(off)
                    got.append(f.readinto(memoryview(buf)))
        for (p, off, length, _), n in zip(group, got):
            if n != length:
                raise PondError(f"{p}: short read at offset {off}: {n} of {length} bytes (file truncated or "
                                "changed since it was written?)")


def read_all(pieces: Sequence[Piece]) -> np.ndarray:
    out = np.empty(sum(p[2] for p in pieces), np.uint8)
    read_pieces(pieces, out)
    return out


def write_at(path: str, items: Sequence[Tuple[int, np.ndarray]], create: bool = True) -> None:
    """Write (offset, buffer) items into one file (created if missing)."""
    items = [(off, buf) for off, buf in items if len(buf)]
    if is_threefs(path):
        p = strip(path)
        if not items:
            if not client().exists(p):
                create_empty(path)
            return
        client().batch_write([(p, off, memoryview(np.ascontiguousarray(buf)).cast("B")) for off, buf in items],
                             create=create)
        return
    mode = "r+b" if os.path.exists(path) else "wb"
    with open(path, mode) as f:
        for off, buf in items:
            f.seek(off)
            f.write(memoryview(np.ascontiguousarray(buf)).cast("B"))


def create_empty(path: str) -> None:
    if is_threefs(path):
        with client().open(strip(path), "wb"):
            pass
    else:
        open(path, "wb").close()


def rename(src: str, dst: str) -> None:
    if is_threefs(src):
        client().rename(strip(src), strip(dst))
    else:
        os.replace(src, dst)


def remove(path: str) -> None:
    if is_threefs(path):
        c = client()
        if c.exists(strip(path)):
            c.remove_tree(strip(path))
    elif os.path.isdir(path):
        import shutil
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def write_text(path: str, text: str) -> None:
    pfs.write_text(path, text)


def read_text(path: str) -> str:
    return pfs.read_bytes(path).decode()
