"""The kvcache meta service's wire format: length-prefixed msgpack frames over TCP (a Unix socket on one host).

    request  = [request_id, op, {args}]
    response = [request_id, status_code, result | message]

One request in flight per connection (the client is a blocking socket in the caller's thread: a lookup is
one send and one receive, no event-loop hop). Bulk page bytes never travel here: they go straight between
the client and the storage services through threefs batch IO.
"""

from __future__ import annotations

import socket
import struct

import msgspec

from threefs.common.status import StatusCode, status_error

FRAME_BYTES_MAX = 16 << 20  # 4096 keys of 512 bytes and their answers fit many times over
_LEN = struct.Struct(">I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode(obj) -> bytes:
    body = _encoder.encode(obj)
    if len(body) > FRAME_BYTES_MAX:
        raise status_error(StatusCode.FRAME_TOO_LARGE, f"kvcache frame of {len(body)} bytes exceeds "
                           f"{FRAME_BYTES_MAX}; send fewer keys per batch")
    return _LEN.pack(len(body)) + body


def decode(body: bytes):
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise status_error(StatusCode.PROTOCOL_ERROR, f"malformed kvcache frame: {exc}") from None


def frame_length(header: bytes) -> int:
    (n,) = _LEN.unpack(header)
    if n > FRAME_BYTES_MAX:
        raise status_error(StatusCode.FRAME_TOO_LARGE, f"kvcache frame of {n} bytes exceeds {FRAME_BYTES_MAX}")
    return n


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("kvcache service closed the connection")
        got += k
    return bytes(buf)


HEADER_BYTES = _LEN.size
