"""Wire schema of the storage service: chunk updates (CRAQ), batch reads, queries."""

from __future__ import annotations

import msgspec

WRITE = 1
TRUNCATE = 2
REMOVE = 3


class RequestTag(msgspec.Struct, array_like=True):
    client_id: str
    request_id: int  # unique per client; a retry reuses it (exactly-once)


class UpdateReq(msgspec.Struct):
    chain_id: int
    chain_ver: int
    chunk_id: bytes
    kind: int  # WRITE / TRUNCATE / REMOVE
    offset: int = 0
    length: int = 0  # bytes of payload for WRITE; new chunk length for TRUNCATE
    chunk_size: int = 0
    crc: int = 0  # CRC32C of the payload, checked on arrival
    tag: RequestTag | None = None
    update_ver: int = 0  # 0 from a client; the head assigns commit_ver + 1
    full_replace: bool = False  # payload is the whole chunk (resync, or repair of a lagging replica)
    from_target: int = 0  # 0 = from a client, else the predecessor's target id
    sync: bool = False  # resync: replace the chunk and its versions unconditionally


class UpdateRsp(msgspec.Struct):
    commit_ver: int
    length: int
    crc: int  # CRC32C of the whole committed chunk: predecessors compare it with their own
    removed: bool = False


class ReadIO(msgspec.Struct, array_like=True):
    chain_id: int
    target_id: int
    chunk_id: bytes
    offset: int
    length: int


class BatchReadReq(msgspec.Struct):
    ios: list[ReadIO]
    allow_uncommitted: bool = False
    request_to_send: bool = False  # ask the client for a transmission token before sending the data


class ReadResult(msgspec.Struct, array_like=True):
    status: int  # 0 = ok, else a StatusCode
    length: int  # bytes of this IO in the payload (short read = past the chunk's end / hole)
    message: str = ""
    commit_ver: int = 0
    chunk_crc: int = 0
    # crc32c of the bytes of this IO in the payload, which the client checks on arrival. For a read of a
    # whole chunk it is the checksum the chunk was written with (checked at the server too): end to end,
    # disk to the caller's buffer. For a partial read it is computed from the bytes read off the disk.
    data_crc: int = 0


class BatchReadRsp(msgspec.Struct):
    # payload: IO k's data starts at slot k = align_up(end of IO k-1's data, 64), in request order
    # (aligned destinations make the server's file reads ~10x faster on this machine)
    results: list[ReadResult]


# -- packed batch reads (storage.read_packed): one record per IO, no msgspec object per IO ----------
# IO record, little-endian, 36 bytes: chain_id u32 | target_id u32 | chunk_id 16 B | offset u64 | length u32
READ_IO_FORMAT = "<II16sQI"
READ_IO_BYTES = 36
# result record, little-endian, 24 bytes: status u32 | length u32 | commit_ver u64 | chunk_crc u32 | data_crc u32
# (status 0 = ok, else a StatusCode; length = bytes of this IO in the payload; the crcs as in ReadResult)
READ_RESULT_FORMAT = "<IIQII"
READ_RESULT_BYTES = 24


class PackedReadReq(msgspec.Struct):
    ios: bytes  # n IO records (READ_IO_FORMAT)
    allow_uncommitted: bool = False
    request_to_send: bool = False
    # The client checks the crc32c of every IO that arrives against its data_crc, so the server may send
    # bytes straight from its data files (os.sendfile): a whole committed chunk without checking it against
    # its write-time checksum first (data_crc is then that checksum), and a part of a chunk version it has
    # checked before with the crc32c of a read of it just before the send (a fold in between shows as a
    # mismatch on arrival). A client that finds a whole chunk damaged on arrival tells the server
    # (report_damage): it checks its copy and repairs it. Servers that predate this field ignore it (and
    # check every whole chunk themselves).
    zero_copy: bool = False


class PackedReadRsp(msgspec.Struct):
    # payload: IO k's bytes start at slot k = sum over j < k of align_up(requested length of IO j, 64):
    # fixed by the request (so IOs can be served in any order), trimmed after the last byte sent.
    results: bytes  # n result records (READ_RESULT_FORMAT), in request order
    messages: dict[int, str] = {}  # IO index -> error message, for IOs whose status is not 0


class ReportDamageReq(msgspec.Struct):
    """storage.report_damage: chunk `chunk_id` of target `target_id` arrived damaged at a client (a zero-copy
    read); the server checks its copy against the write-time checksum and repairs it from a peer if bad."""
    target_id: int
    chunk_id: bytes


class ReportDamageRsp(msgspec.Struct):
    damaged: bool  # the server's copy failed its checksum (a repair was started)


class RemoveRangeReq(msgspec.Struct):
    chain_id: int
    chain_ver: int
    begin: bytes
    end: bytes
    chunk_size: int
    tag: RequestTag | None = None


class RemoveRangeRsp(msgspec.Struct):
    removed: int


REMOVE_RANGES_MAX = 1024  # ranges one remove_ranges request may carry


class RemoveRangesReq(msgspec.Struct):
    """Many [begin, end) ranges of chunk ids on one chain (GC of many files): one request, one disk pass."""
    chain_id: int
    chain_ver: int
    ranges: list[tuple[bytes, bytes]]
    chunk_size: int


class LastChunkReq(msgspec.Struct):
    chain_id: int
    begin: bytes
    end: bytes


class LastChunkRsp(msgspec.Struct):
    chunk_id: bytes  # b"" when the range is empty on this chain
    length: int


class TargetStat(msgspec.Struct):
    target_id: int
    local_state: str
    chunks: int
    used_bytes: int


class StatusRsp(msgspec.Struct):
    node_id: int
    targets: list[TargetStat]
    # updates (writes, commits) run on the service's event loop / handed to a disk thread after trying /
    # inline ones that were slow (each pauses inline updates): StorageService.inline_stats
    inline_updates: dict[str, int] = {}


class SyncDumpReq(msgspec.Struct):
    target_id: int
    after: bytes = b""
    limit: int = 10_000


class ChunkBrief(msgspec.Struct, array_like=True):
    chunk_id: bytes
    commit_ver: int
    length: int
    crc: int
    update_ver: int = 0  # > commit_ver: the successor holds a pending version (resync replaces it)


class SyncDumpRsp(msgspec.Struct):
    chunks: list[ChunkBrief]
    more: bool
