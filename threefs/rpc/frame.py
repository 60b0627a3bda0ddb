"""Wire framing: a fixed 16-byte prefix, a msgpack header, then bulk payload bytes.

    prefix  = magic u16 | flags u16 | header_len u32 | payload_len u64     (little-endian)
    header  = msgpack Header (request id, method, status, deadline, body = the method's msgspec Struct)
    payload = raw bytes (chunk data), received straight into the caller's preallocated buffer

`FrameReader` is the incremental parser behind a `BufferedProtocol`: small frames are parsed out of a
scratch buffer; a large payload is received directly into its destination (`recv_into` by the event
loop), so the read path never copies bulk data through a reassembly buffer.
"""

from __future__ import annotations

import struct
from typing import Callable

import msgspec

from threefs.common import limits
from threefs.common.status import StatusCode, ThreeFSError, status_error

MAGIC = 0x3F53
PREFIX = struct.Struct("<HHIQ")
PREFIX_BYTES = PREFIX.size

KIND_REQUEST = 0
KIND_RESPONSE = 1
KIND_HELLO = 2
KIND_RTS = 3  # server -> client: the response to request `rid` is ready; may it be sent?
KIND_GRANT = 4  # client -> server: send the response to request `rid` now

SCRATCH_BYTES = 256 * 1024


class Header(msgspec.Struct, array_like=True):
    kind: int
    rid: int
    method: str = ""
    status: int = 0
    message: str = ""
    timeout_ms: int = 0
    body: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)
body_encoder = msgspec.msgpack.Encoder()


def encode_frame_head(header: Header, payload_len: int) -> bytes:
    """Prefix + header bytes; the payload is written separately (no concatenation of bulk data)."""
    head = _header_encoder.encode(header)
    if len(head) > limits.FRAME_HEADER_BYTES_MAX:
        raise status_error(
            StatusCode.FRAME_TOO_LARGE,
            f"request header of {len(head)} bytes exceeds {limits.FRAME_HEADER_BYTES_MAX}",
        )
    if payload_len > limits.FRAME_PAYLOAD_BYTES_MAX:
        raise status_error(
            StatusCode.FRAME_TOO_LARGE,
            f"payload of {payload_len} bytes exceeds the frame limit {limits.FRAME_PAYLOAD_BYTES_MAX}",
        )
    return PREFIX.pack(MAGIC, 0, len(head), payload_len) + head


class FrameError(ThreeFSError):
    """The byte stream cannot be trusted any more; the connection must be closed."""


# get_payload_buffer(header, payload_len) -> writable memoryview of exactly payload_len bytes
PayloadAllocator = Callable[[Header, int], memoryview]
FrameHandler = Callable[[Header, memoryview | None], None]


class FrameReader:
    def __init__(self, on_frame: FrameHandler, allocate: PayloadAllocator):
        self._on_frame = on_frame
        self._allocate = allocate
        self._scratch = bytearray(SCRATCH_BYTES)
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        self._direct: memoryview | None = None  # payload destination being filled by the socket
        self._direct_pos = 0
        self._direct_header: Header | None = None
        self.paused = False  # set by the owner to stop delivering frames (back-pressure); see resume()

    # -- BufferedProtocol plumbing ---------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct is not None:
            return self._direct[self._direct_pos :]
        if self._end == len(self._scratch):
            self._make_room(0)
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self._direct is not None:
            self._direct_pos += nbytes
            if self._direct_pos == len(self._direct):
                header, payload = self._direct_header, self._direct
                self._direct, self._direct_header = None, None
                self._on_frame(header, payload)
            return
        self._end += nbytes
        self._parse()

    def divert(self, rid: int) -> None:
        """If frame `rid`'s payload is being received directly, send its remaining bytes elsewhere.

        Called when a caller gives up on a request: its buffer must not be written after that."""
        if self._direct is not None and self._direct_header.rid == rid:
            self._direct = memoryview(bytearray(len(self._direct)))

    def resume(self) -> None:
        """Deliver frames again, starting with those already buffered while paused."""
        self.paused = False
        self._parse()

    # -- parsing ---------------------------------------------------------------------------------
    def _make_room(self, needed: int) -> None:
        """Move unparsed bytes to the front; grow the scratch when a header needs more room."""
        pending = self._end - self._start
        size = max(len(self._scratch), needed)
        if pending == len(self._scratch) and needed <= size:
            size *= 2
        if size != len(self._scratch):
            scratch = bytearray(size)
            scratch[:pending] = self._view[self._start : self._end]
            self._view.release()
            self._scratch, self._view = scratch, memoryview(scratch)
        elif self._start:
            self._scratch[:pending] = self._scratch[self._start : self._end]
        self._start, self._end = 0, pending

    def _parse(self) -> None:
        view = self._view
        while not self.paused and self._end - self._start >= PREFIX_BYTES:
            magic, _flags, hlen, plen = PREFIX.unpack_from(self._scratch, self._start)
            if magic != MAGIC:
                raise FrameError(StatusCode.PROTOCOL_ERROR, f"bad frame magic 0x{magic:04x}")
            if hlen > limits.FRAME_HEADER_BYTES_MAX or plen > limits.FRAME_PAYLOAD_BYTES_MAX:
                raise FrameError(
                    StatusCode.FRAME_TOO_LARGE,
                    f"frame with header {hlen} B / payload {plen} B exceeds the limits "
                    f"({limits.FRAME_HEADER_BYTES_MAX} B / {limits.FRAME_PAYLOAD_BYTES_MAX} B)",
                )
            hstart = self._start + PREFIX_BYTES
            pstart = hstart + hlen
            if self._end < pstart:
                if pstart - self._start > len(self._scratch):
                    self._make_room(pstart - self._start)
                return
            try:
                # bytes(): the header's Raw body would otherwise point into the scratch buffer,
                # which the next recv overwrites (msgspec.Raw is zero-copy).
                header = _header_decoder.decode(bytes(view[hstart:pstart]))
            except msgspec.DecodeError as e:
                raise FrameError(StatusCode.PROTOCOL_ERROR, f"undecodable frame header: {e}") from e
            have = min(plen, self._end - pstart)
            if plen == 0:
                self._start = pstart
                self._on_frame(header, None)
                continue
            dest = self._allocate(header, plen)
            assert len(dest) == plen
            dest[:have] = view[pstart : pstart + have]
            if have == plen:
                self._start = pstart + plen
                self._on_frame(header, dest)
                continue
            self._direct, self._direct_pos, self._direct_header = dest, have, header
            self._start = self._end = 0
            return
        if self._start == self._end:
            self._start = self._end = 0
