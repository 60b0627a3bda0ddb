"""Identifiers: inode ids, chunk ids (16 B, big-endian, sortable as bytes), node/target/chain ids.

A chunk id is `[tenant 1B][reserved 1B][inode 8B][track 2B][chunk index 4B]`, as in 3FS, so every chunk
of one inode lies in `[chunk_id(ino, 0, 0), chunk_id(ino + 1, 0, 0))` and the highest chunk index sorts
last (used by the last-chunk query and by GC's range removal).
"""

from __future__ import annotations

import struct

from threefs.common.status import StatusCode, status_error

ROOT_INODE = 0
GC_ROOT_INODE = 1
FIRST_USER_INODE = 2
INODE_MAX = (1 << 63) - 1
CHUNK_INDEX_MAX = (1 << 32) - 1

_CHUNK = struct.Struct(">BBQHI")
CHUNK_ID_BYTES = _CHUNK.size
assert CHUNK_ID_BYTES == 16


def chunk_id(inode: int, chunk_index: int, track: int = 0, tenant: int = 0) -> bytes:
    if not 0 <= inode <= INODE_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"inode {inode} out of range")
    if not 0 <= chunk_index <= CHUNK_INDEX_MAX:
        raise status_error(
            StatusCode.FILE_TOO_LARGE, f"chunk index {chunk_index} exceeds {CHUNK_INDEX_MAX}"
        )
    return _CHUNK.pack(tenant, 0, inode, track, chunk_index)


def parse_chunk_id(cid: bytes) -> tuple[int, int, int, int]:
    """Return (tenant, inode, track, chunk_index)."""
    if len(cid) != CHUNK_ID_BYTES:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"chunk id must be 16 bytes, got {len(cid)}")
    tenant, _, inode, track, index = _CHUNK.unpack(cid)
    return tenant, inode, track, index


def inode_chunk_range(inode: int) -> tuple[bytes, bytes]:
    """[begin, end) of all chunk ids of one inode."""
    begin = _CHUNK.pack(0, 0, inode, 0, 0)
    end = _CHUNK.pack(0, 0, inode + 1, 0, 0) if inode < INODE_MAX else b"\x00\x01" + b"\x00" * 14
    return begin, end


def target_id(node_id: int, slot: int) -> int:
    """Targets are numbered from their node: node 101, slot 1 -> 10101."""
    return node_id * 100 + slot
