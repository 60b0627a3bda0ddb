"""An in-memory chunk store with the chunk engine's version semantics, for the CRAQ simulator.

It keeps what the real engine keeps per chunk (a committed version and at most one pending version) and
behaves like it on a crash: pending versions vanish, committed ones stay (kill -9 with the page cache
intact). The simulator replaces the disk with this so that thousands of seeds run in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import crc32c

from threefs.common.status import StatusCode, status_error


@dataclass(frozen=True)
class SimMeta:
    chunk_id: bytes
    chain_ver: int
    update_ver: int
    commit_ver: int
    length: int
    crc: int
    pending_length: int
    pending_crc: int
    pending_remove: bool = False


@dataclass
class _Pending:
    ver: int
    data: bytes | None  # None = removal
    chain_ver: int


class SimStore:
    def __init__(self, durable_pending: bool = True) -> None:
        self.durable_pending = durable_pending
        self.committed: dict[bytes, tuple[int, int, bytes]] = {}  # cid -> (commit_ver, chain_ver, data)
        self.pending: dict[bytes, _Pending] = {}

    def get_meta(self, cid: bytes) -> SimMeta | None:
        c, p = self.committed.get(cid), self.pending.get(cid)
        if c is None and p is None:
            return None
        ver, chain_ver, data = c if c is not None else (0, 0, b"")
        meta = SimMeta(cid, chain_ver, ver, ver, len(data), crc32c.crc32c(data), len(data), crc32c.crc32c(data))
        if p is None:
            return meta
        pdata = p.data or b""
        return replace(meta, update_ver=p.ver, pending_length=len(pdata), pending_crc=crc32c.crc32c(pdata),
                       pending_remove=p.data is None)

    def newest(self, cid: bytes) -> bytes:
        p = self.pending.get(cid)
        if p is not None:
            return p.data or b""
        c = self.committed.get(cid)
        return c[2] if c else b""

    def read_committed(self, cid: bytes) -> tuple[int, bytes]:
        c = self.committed.get(cid)
        return (c[0], c[2]) if c else (0, b"")

    def write(self, cid: bytes, update_ver: int, chain_ver: int, offset: int, data, chunk_size: int,
              full_replace: bool) -> SimMeta:
        data = bytes(data)
        if offset + len(data) > chunk_size:
            raise status_error(StatusCode.INVALID_ARGUMENT, "write past the chunk size")
        if full_replace:
            new = data
        else:
            base = bytearray(self.read_committed(cid)[1])
            if len(base) < offset + len(data):
                base.extend(bytes(offset + len(data) - len(base)))
            base[offset:offset + len(data)] = data
            new = bytes(base)
        self.pending[cid] = _Pending(update_ver, new, chain_ver)
        return self.get_meta(cid)

    def truncate(self, cid: bytes, update_ver: int, chain_ver: int, length: int) -> SimMeta:
        base = self.read_committed(cid)[1][:length]
        self.pending[cid] = _Pending(update_ver, base + bytes(length - len(base)), chain_ver)
        return self.get_meta(cid)

    def remove(self, cid: bytes, update_ver: int, chain_ver: int) -> SimMeta | None:
        if self.get_meta(cid) is None:
            return None
        self.pending[cid] = _Pending(update_ver, None, chain_ver)
        return self.get_meta(cid)

    def commit(self, cid: bytes, update_ver: int, chain_ver: int) -> SimMeta | None:
        p = self.pending.get(cid)
        c = self.committed.get(cid)
        if p is None or p.ver != update_ver:
            if c is None or update_ver <= c[0]:
                return self.get_meta(cid)  # already committed (or removed): a no-op, like the engine
            raise status_error(StatusCode.MISSING_UPDATE, f"version {update_ver} is not pending")
        del self.pending[cid]
        if p.data is None:
            self.committed.pop(cid, None)
            return None
        self.committed[cid] = (update_ver, chain_ver, p.data)
        return self.get_meta(cid)

    def crash(self) -> None:
        if not self.durable_pending:
            self.pending.clear()
