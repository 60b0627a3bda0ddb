"""An in-memory chunk store with the chunk engine's API and version semantics, for the CRAQ simulator.

It keeps what the real engine (threefs/storage/chunk_engine.py) keeps per chunk — a committed version and
at most one pending version — and answers every call the CRAQ flows make (`craq.apply_to_store`) as the
engine does, errors included; tests/storage/test_chunk_store_conformance.py runs one suite against both.
The simulator replaces the disk with this so that thousands of seeds run in seconds.

A crash (`crash()`) models `kill -9` with the page cache intact, i.e. an engine closed and reopened:
committed versions stay and so do pending ones (the engine logs a pending version before the write
returns). `durable_pending=False` models the engine before it logged them (pending versions vanish on a
crash); the simulator's sensitivity test uses it to show the checker catches the versions it loses.
"""

from __future__ import annotations

from dataclasses import dataclass

from threefs.common import crc32c
from threefs.common.limits import CHUNK_SIZE_BYTES_MAX
from threefs.common.status import StatusCode, status_error

CHUNK_ID_BYTES = 16
LAST_REQUEST_BYTES_MAX = 256


@dataclass(frozen=True)
class SimMeta:  # the fields of chunk_engine.ChunkMeta, same meanings
    chunk_id: bytes
    chain_ver: int
    update_ver: int
    commit_ver: int
    length: int
    crc: int
    pending_length: int
    pending_crc: int
    pending_remove: bool = False
    last_request: bytes = b""


@dataclass(frozen=True)
class _Committed:
    ver: int
    chain_ver: int
    data: bytes
    last_request: bytes
    crc: int = -1  # of data, computed on creation

    def __post_init__(self):
        object.__setattr__(self, "crc", crc32c.crc32c(self.data))


@dataclass(frozen=True)
class _Pending:
    ver: int
    data: bytes | None  # None = removal
    chain_ver: int
    last_request: bytes
    crc: int = -1  # of data (0 for a removal), computed on creation

    def __post_init__(self):
        object.__setattr__(self, "crc", 0 if self.data is None else crc32c.crc32c(self.data))


_NOTHING = _Committed(0, 0, b"", b"")


def _check_chunk_id(cid: bytes) -> None:
    if not isinstance(cid, bytes) or len(cid) != CHUNK_ID_BYTES:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"chunk id must be {CHUNK_ID_BYTES} bytes: {cid!r}")


def _check_update(update_ver: int, chain_ver: int, last_request: bytes) -> None:
    if update_ver < 1 or chain_ver < 0:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"bad versions: update {update_ver}, chain {chain_ver}")
    if len(last_request) > LAST_REQUEST_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT,
                           f"last_request is {len(last_request)} bytes, max {LAST_REQUEST_BYTES_MAX}")


def _check_extent(end: int, chunk_size: int) -> None:
    if not 0 < chunk_size <= CHUNK_SIZE_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"chunk size {chunk_size} not in (0, {CHUNK_SIZE_BYTES_MAX}]")
    if end > chunk_size:
        raise status_error(StatusCode.INVALID_ARGUMENT,
                           f"chunk would grow to {end} bytes, beyond chunk size {chunk_size}")


class SimStore:
    def __init__(self, durable_pending: bool = True) -> None:
        self.durable_pending = durable_pending
        self.committed: dict[bytes, _Committed] = {}
        self.pending: dict[bytes, _Pending] = {}

    # -- queries -----------------------------------------------------------------------------------
    def get_meta(self, cid: bytes) -> SimMeta | None:
        _check_chunk_id(cid)
        c, p = self.committed.get(cid), self.pending.get(cid)
        if c is None and p is None:
            return None
        c = c or _NOTHING
        if p is None:
            return SimMeta(cid, c.chain_ver, c.ver, c.ver, len(c.data), c.crc, len(c.data), c.crc, False,
                           c.last_request)
        plen = 0 if p.data is None else len(p.data)
        return SimMeta(cid, c.chain_ver, p.ver, c.ver, len(c.data), c.crc, plen, p.crc, p.data is None,
                       p.last_request)

    def iter_metas(self, begin: bytes = b"", end: bytes | None = None, *, reverse: bool = False,
                   limit: int = 0) -> list[SimMeta]:
        if limit < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"limit must be >= 0: {limit}")
        ids = sorted(c for c in self.committed.keys() | self.pending.keys()
                     if c >= begin and (end is None or c < end))
        ids = ids[::-1] if reverse else ids
        return [self.get_meta(c) for c in (ids[:limit] if limit else ids)]

    def read(self, cid: bytes, offset: int, length: int, *, pending: bool = False) -> tuple[bytes, SimMeta]:
        """[offset, offset+length) of the committed version (the pending one if `pending`), clamped;
        CHUNK_NOT_FOUND for a missing chunk or (pending=True) a pending removal; a chunk never
        committed reads as empty."""
        meta = self.get_meta(cid)
        if offset < 0 or length < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"bad read: offset {offset}, length {length}")
        if meta is None:
            raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {cid.hex()} not found")
        p = self.pending.get(cid)
        if pending and p is not None:
            if p.data is None:
                raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {cid.hex()} has a pending removal")
            data = p.data
        else:
            data = self.read_committed(cid)[1]
        return data[offset:offset + length] if offset < len(data) else b"", meta

    def verify(self, cid: bytes) -> bool:
        """The committed bytes match their checksum (ChunkEngine.verify; nothing here damages them, so
        this only fails for a copy changed behind the store's back, as a test may do); CHUNK_NOT_FOUND
        for an unknown chunk."""
        if self.get_meta(cid) is None:
            raise status_error(StatusCode.CHUNK_NOT_FOUND, f"chunk {cid.hex()} not found")
        c = self.committed.get(cid)
        return c is None or crc32c.crc32c(c.data) == c.crc

    def read_committed(self, cid: bytes) -> tuple[int, bytes]:
        """(committed version, its bytes); (0, b"") when none (the simulator's checker reads this)."""
        c = self.committed.get(cid)
        return (c.ver, c.data) if c else (0, b"")

    # -- pending versions --------------------------------------------------------------------------
    def write(self, cid: bytes, *, update_ver: int, chain_ver: int, offset: int, data, chunk_size: int,
              full_replace: bool = False, last_request: bytes = b"", data_crc: int | None = None) -> SimMeta:
        _check_chunk_id(cid)
        _check_update(update_ver, chain_ver, last_request)
        data = bytes(data)
        # a flow that passes a crc32c must pass its data's own (the engines build the version's crc on it)
        assert data_crc is None or data_crc == crc32c.crc32c(data), "a write's data_crc is not its data's"
        if offset < 0 or (full_replace and offset != 0):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"bad write offset {offset} (full_replace={full_replace})")
        _check_extent(offset + len(data), chunk_size)
        if full_replace:
            new = data
        else:
            base = bytearray(self.read_committed(cid)[1])
            if len(base) < offset + len(data):
                base.extend(bytes(offset + len(data) - len(base)))
            base[offset:offset + len(data)] = data
            new = bytes(base)
        self.pending[cid] = _Pending(update_ver, new, chain_ver, bytes(last_request))
        return self.get_meta(cid)

    def truncate(self, cid: bytes, *, update_ver: int, chain_ver: int, length: int, chunk_size: int,
                 last_request: bytes = b"") -> SimMeta:
        _check_chunk_id(cid)
        _check_update(update_ver, chain_ver, last_request)
        if length < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"bad truncate length {length}")
        _check_extent(length, chunk_size)
        base = self.read_committed(cid)[1][:length]
        self.pending[cid] = _Pending(update_ver, base + bytes(length - len(base)), chain_ver, bytes(last_request))
        return self.get_meta(cid)

    def remove(self, cid: bytes, *, update_ver: int, chain_ver: int, last_request: bytes = b"") -> SimMeta | None:
        _check_chunk_id(cid)
        _check_update(update_ver, chain_ver, last_request)
        if self.get_meta(cid) is None:
            return None
        self.pending[cid] = _Pending(update_ver, None, chain_ver, bytes(last_request))
        return self.get_meta(cid)

    def abort(self, cid: bytes) -> None:
        _check_chunk_id(cid)
        self.pending.pop(cid, None)

    # -- commit ------------------------------------------------------------------------------------
    def commit(self, cid: bytes, update_ver: int, *, chain_ver: int | None = None) -> SimMeta | None:
        """As ChunkEngine.commit: pending `update_ver` becomes committed (a removal deletes the chunk:
        None). Not pending: a no-op if already committed (None for a chunk that no longer exists),
        STALE_UPDATE if a newer version is pending, else MISSING_UPDATE — never a silent success for
        a version this replica does not hold (CRAQ would acknowledge a write that is not here)."""
        _check_chunk_id(cid)
        p, c = self.pending.get(cid), self.committed.get(cid)
        if p is None or p.ver != update_ver:
            if p is None and c is None:
                return None  # e.g. a repeated commit of a removal
            commit_ver = c.ver if c is not None else 0
            if update_ver <= commit_ver:
                return self.get_meta(cid)
            code = StatusCode.STALE_UPDATE if p is not None and p.ver > update_ver else StatusCode.MISSING_UPDATE
            raise status_error(code, f"chunk {cid.hex()}: cannot commit version {update_ver}: committed "
                               f"{commit_ver}, pending {p.ver if p is not None else None}")
        del self.pending[cid]
        if p.data is None:
            self.committed.pop(cid, None)
            return None
        self.committed[cid] = _Committed(update_ver, p.chain_ver if chain_ver is None else chain_ver, p.data,
                                         p.last_request)
        return self.get_meta(cid)

    def crash(self) -> None:
        """kill -9 (page cache intact) and restart: committed versions stay, pending ones too unless
        `durable_pending` is off."""
        if not self.durable_pending:
            self.pending.clear()
