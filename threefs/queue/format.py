"""On-disk formats of the queue (pure: no IO): record batches in segment files, and index entries.

A batch, as a producer appends it to its own segment file:

    header  (32 B)  magic "TFQ1" | crc32 of everything after this field (rest of header + records)
                    | records_bytes u32 | count u32 | first_timestamp_ms u64 | producer_batch u64
    record  (24 B + data)  crc32 of the rest of the record | key_len i32 (-1: no key) | value_len u32
                    | timestamp_ms u64 | headers_len u32 | key | value | headers (msgpack [[k, v], ...])

Every record carries its own CRC and the batch header's CRC covers the whole batch, so a batch that a
crash left half written (a torn tail) or a flipped bit is found at once. A batch does not know its
offsets: it becomes part of a partition's order only when an index entry names it (see log.py), and the
entry gives its base offset.

An index entry is the target of a symlink `index/<seq>`:  "q1:<segment>:<position>:<bytes>:<count>:<base
offset>:<timestamp_ms of the last record>".
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

import msgspec

from threefs.common.status import StatusCode, status_error

MAGIC = b"TFQ1"
BATCH_HEADER = struct.Struct("<4sIIIQQ")
RECORD_HEADER = struct.Struct("<IiIQI")
_RECORD_REST = struct.Struct("<iIQI")  # the record header after its CRC
_CRC = struct.Struct("<I")
BATCH_HEADER_BYTES = BATCH_HEADER.size  # 32
RECORD_HEADER_BYTES = RECORD_HEADER.size  # 24
RECORD_BYTES_MAX = 64 << 20  # one record's key + value + headers
BATCH_RECORDS_MAX = 100_000
ENTRY_VERSION = "q1"

_headers_encoder = msgspec.msgpack.Encoder()
_headers_decoder = msgspec.msgpack.Decoder(list[tuple[str, bytes]])


class ConsumerRecord(NamedTuple):
    """One record as a consumer sees it (its offset comes from the batch's index entry)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


class IndexEntry(NamedTuple):
    segment: str  # file name inside the partition's segments/ directory
    position: int  # byte offset of the batch in the segment
    nbytes: int  # batch bytes (header included)
    count: int  # records
    base_offset: int  # offset of the batch's first record
    last_timestamp_ms: int

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.count

    def encode(self) -> str:
        return (f"{ENTRY_VERSION}:{self.segment}:{self.position}:{self.nbytes}:{self.count}:"
                f"{self.base_offset}:{self.last_timestamp_ms}")

    @classmethod
    def decode(cls, text: str) -> "IndexEntry":
        parts = text.split(":")
        if len(parts) != 7 or parts[0] != ENTRY_VERSION:
            raise _corrupt(f"not a queue index entry: {text[:80]!r}")
        return cls(parts[1], *(int(p) for p in parts[2:]))


def _corrupt(message: str):
    return status_error(StatusCode.CHECKSUM_MISMATCH, message)




class BatchBuilder:
    """Accumulates records into one batch (a bytearray), computing each record's CRC as it goes."""

    __slots__ = ("buf", "count", "first_timestamp_ms", "last_timestamp_ms")

    def __init__(self):
        self.buf = bytearray(BATCH_HEADER_BYTES)
        self.count = 0
        self.first_timestamp_ms = 0
        self.last_timestamp_ms = 0

    def __len__(self) -> int:
        return len(self.buf)

    def append(self, value: bytes, key: bytes | None, timestamp_ms: int,
               headers: list[tuple[str, bytes]] | None) -> int:
        """Add one record; returns the bytes it took."""
        hdr = _headers_encoder.encode(headers) if headers else b""
        buf = self.buf
        start = len(buf)
        if key is None:
            rest = _RECORD_REST.pack(-1, len(value), timestamp_ms, len(hdr))
            crc = zlib.crc32(value, zlib.crc32(rest))
        else:
            rest = _RECORD_REST.pack(len(key), len(value), timestamp_ms, len(hdr))
            crc = zlib.crc32(value, zlib.crc32(key, zlib.crc32(rest)))
        if hdr:
            crc = zlib.crc32(hdr, crc)
        buf += _CRC.pack(crc)
        buf += rest
        if key:
            buf += key
        buf += value
        if hdr:
            buf += hdr
        if self.count == 0:
            self.first_timestamp_ms = timestamp_ms
        if timestamp_ms > self.last_timestamp_ms:
            self.last_timestamp_ms = timestamp_ms
        self.count += 1
        return len(buf) - start

    def seal(self, producer_batch: int) -> bytearray:
        """Write the header; the batch is then ready to append to a segment."""
        assert self.count > 0
        buf = self.buf
        BATCH_HEADER.pack_into(buf, 0, MAGIC, 0, len(buf) - BATCH_HEADER_BYTES, self.count,
                               self.first_timestamp_ms, producer_batch)
        crc = zlib.crc32(memoryview(buf)[8:])
        struct.pack_into("<I", buf, 4, crc)
        return buf


def check_record_input(value, key, headers) -> tuple[bytes, bytes | None]:
    """Bad producer input gets a clear error before anything is buffered."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"record value must be bytes, not "
                           f"{type(value).__name__} (encode it first, e.g. json.dumps(v).encode())")
    if key is not None and not isinstance(key, (bytes, bytearray, memoryview)):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"record key must be bytes or None, not "
                           f"{type(key).__name__}")
    size = len(value) + (len(key) if key is not None else 0)
    if size > RECORD_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"record of {size} bytes exceeds "
                           f"{RECORD_BYTES_MAX}; store large values in a file and send its path")
    if headers is not None:
        if not isinstance(headers, (list, tuple)) or not all(
                isinstance(h, tuple) and len(h) == 2 and isinstance(h[0], str)
                and isinstance(h[1], (bytes, bytearray)) for h in headers):
            raise status_error(StatusCode.INVALID_ARGUMENT, "record headers must be a list of "
                               "(str, bytes) pairs")
    return bytes(value), (bytes(key) if key is not None else None)


def batch_span(view: memoryview) -> int:
    """Bytes of the valid batch at the start of `view`, or 0 if there is none (torn or corrupt)."""
    if len(view) < BATCH_HEADER_BYTES:
        return 0
    magic, crc, records_bytes, count, _, _ = BATCH_HEADER.unpack_from(view, 0)
    end = BATCH_HEADER_BYTES + records_bytes
    if magic != MAGIC or count == 0 or end > len(view):
        return 0
    if zlib.crc32(view[8:end]) != crc:
        return 0
    return end


def decode_batch(view: memoryview, entry: IndexEntry, where: str, topic: str = "",
                 partition: int = 0) -> list[ConsumerRecord]:
    """The records of the batch an index entry names; a CRC mismatch is an error naming the place."""
    if len(view) != entry.nbytes or batch_span(view) != entry.nbytes:
        raise _corrupt(f"{where}: batch at {entry.segment}@{entry.position} ({entry.nbytes} bytes) fails its "
                       "CRC or is incomplete; the segment is damaged")
    _, _, _, count, _, _ = BATCH_HEADER.unpack_from(view, 0)
    if count != entry.count:
        raise _corrupt(f"{where}: batch holds {count} records, its index entry says {entry.count}")
    out = []
    pos = BATCH_HEADER_BYTES
    offset = entry.base_offset
    unpack = RECORD_HEADER.unpack_from
    data = view.obj if isinstance(view.obj, bytes) and len(view) == len(view.obj) else bytes(view)
    for _ in range(count):
        _, key_len, value_len, ts, hdr_len = unpack(data, pos)
        pos += RECORD_HEADER_BYTES
        if key_len >= 0:
            key = data[pos:pos + key_len]
            pos += key_len
        else:
            key = None
        value = data[pos:pos + value_len]
        pos += value_len
        headers = _headers_decoder.decode(data[pos:pos + hdr_len]) if hdr_len else []
        pos += hdr_len
        out.append(ConsumerRecord(topic, partition, offset, ts, key, value, headers))
        offset += 1
    if pos != len(data):
        raise _corrupt(f"{where}: batch records end at {pos}, not at {len(data)}")
    return out


def verify_records(view: memoryview) -> list[int]:
    """Indexes of records whose own CRC is wrong (for diagnostics: `threefs queue describe --verify`)."""
    bad = []
    _, _, _, count, _, _ = BATCH_HEADER.unpack_from(view, 0)
    pos = BATCH_HEADER_BYTES
    for i in range(count):
        crc, key_len, value_len, _, hdr_len = RECORD_HEADER.unpack_from(view, pos)
        end = pos + RECORD_HEADER_BYTES + max(key_len, 0) + value_len + hdr_len
        if zlib.crc32(view[pos + 4:end]) != crc:
            bad.append(i)
        pos = end
    return bad
