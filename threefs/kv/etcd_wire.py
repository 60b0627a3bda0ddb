"""etcd's gRPC API (v3, etcdserverpb) spoken with grpcio and hand-encoded protobuf: the few messages the etcd
KV engine uses, no generated code and no JSON gateway.

Why: through etcd's JSON gateway every request is parsed twice inside etcd (HTTP+JSON, then a loopback gRPC
call) and httpx spends about a millisecond of Python per request; on gRPC with messages built as bytes both
costs drop several-fold (docs/etcd.md has the figures).

Requests are built by the functions below (field numbers from etcd 3.4's rpc.proto and kv.proto); replies are
decoded into plain dicts shaped like etcd's JSON (snake_case names, but bytes as bytes and integers as int):
    {"header": {"revision": 7}, "kvs": [{"key": b"k", "value": b"v", "create_revision": 5, "mod_revision": 7}],
     "more": False, "count": 1}
"""

from __future__ import annotations

from typing import Any

# Compare.target / Compare.result / RangeRequest.sort_order enums
VERSION, CREATE, MOD, VALUE = 0, 1, 2, 3
EQUAL, GREATER, LESS, NOT_EQUAL = 0, 1, 2, 3
ASCEND, DESCEND = 1, 2

METHODS = {"range": "/etcdserverpb.KV/Range", "txn": "/etcdserverpb.KV/Txn",
           "lease/grant": "/etcdserverpb.Lease/LeaseGrant", "compact": "/etcdserverpb.KV/Compact",
           "status": "/etcdserverpb.Maintenance/Status"}
WATCH_METHOD = "/etcdserverpb.Watch/Watch"  # a bidirectional stream
PUT_EVENT, DELETE_EVENT = 0, 1  # Event.type


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _int(field: int, n: int) -> bytes:
    return (_varint(field << 3) + _varint(n)) if n else b""


def _bytes(field: int, data: bytes) -> bytes:
    return _varint((field << 3) | 2) + _varint(len(data)) + data


def _opt_bytes(field: int, data: bytes) -> bytes:
    return _bytes(field, data) if data else b""


def range_request(key: bytes, range_end: bytes = b"", *, limit: int = 0, revision: int = 0, sort_order: int = 0,
                  serializable: bool = False, keys_only: bool = False, count_only: bool = False,
                  min_mod_revision: int = 0) -> bytes:
    # sort_target 0 = KEY
    return (_bytes(1, key) + _opt_bytes(2, range_end) + _int(3, limit) + _int(4, revision) + _int(5, sort_order)
            + _int(7, serializable) + _int(8, keys_only) + _int(9, count_only) + _int(10, min_mod_revision))


def put_request(key: bytes, value: bytes, lease: int = 0) -> bytes:
    return _bytes(1, key) + _opt_bytes(2, value) + _int(3, lease)


def delete_request(key: bytes, range_end: bytes = b"") -> bytes:
    return _bytes(1, key) + _opt_bytes(2, range_end)


def compare(key: bytes, target: int, result: int, number: int, range_end: bytes = b"") -> bytes:
    """A compare of `target` (VERSION, CREATE or MOD: `number` is the revision or version) with `result`."""
    value_field = {VERSION: 4, CREATE: 5, MOD: 6}[target]
    # target_union is a oneof: its field is written even when 0, as etcd's own clients do
    return (_int(1, result) + _int(2, target) + _bytes(3, key) + _varint(value_field << 3) + _varint(number)
            + _opt_bytes(64, range_end))


def op_range(request: bytes) -> bytes:
    return _bytes(1, request)


def op_put(request: bytes) -> bytes:
    return _bytes(2, request)


def op_delete(request: bytes) -> bytes:
    return _bytes(3, request)


def op_txn(request: bytes) -> bytes:
    return _bytes(4, request)


def txn_request(compares: list[bytes], success: list[bytes], failure: list[bytes] = ()) -> bytes:  # type: ignore[assignment]
    return (b"".join(_bytes(1, c) for c in compares) + b"".join(_bytes(2, s) for s in success)
            + b"".join(_bytes(3, f) for f in failure))


def lease_grant_request(ttl_s: int) -> bytes:
    return _int(1, ttl_s)


def compaction_request(revision: int, physical: bool = True) -> bytes:
    return _int(1, revision) + _int(2, physical)


def watch_create_request(key: bytes, range_end: bytes, start_revision: int) -> bytes:
    """WatchRequest{create_request: WatchCreateRequest{key, range_end, start_revision}}."""
    return _bytes(1, _bytes(1, key) + _opt_bytes(2, range_end) + _int(3, start_revision))


# -- decoding ----------------------------------------------------------------------------------------------
def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    """The varint at buf[i:] and the index after it."""
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> dict[int, list[Any]]:
    """Protobuf wire format -> {field number: [int or bytes, ...]} (varint and length-delimited only, which is
    all etcd's replies use)."""
    out: dict[int, list[Any]] = {}
    i, n = 0, len(buf)
    while i < n:
        tag, i = _read_varint(buf, i)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 2:
            length, i = _read_varint(buf, i)
            value = buf[i:i + length]
            i += length
        elif wire == 1:
            value = int.from_bytes(buf[i:i + 8], "little")
            i += 8
        elif wire == 5:
            value = int.from_bytes(buf[i:i + 4], "little")
            i += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.setdefault(field, []).append(value)
    return out


def _first(fields: dict[int, list[Any]], number: int, default: Any = 0) -> Any:
    values = fields.get(number)
    return values[-1] if values else default


def _header(raw: bytes) -> dict[str, int]:
    return {"revision": _first(_fields(raw), 3)}


def _key_value(raw: bytes) -> dict[str, Any]:
    f = _fields(raw)
    return {"key": _first(f, 1, b""), "create_revision": _first(f, 2), "mod_revision": _first(f, 3),
            "version": _first(f, 4), "value": _first(f, 5, b""), "lease": _first(f, 6)}


def range_response(raw: bytes) -> dict[str, Any]:
    f = _fields(raw)
    return {"header": _header(_first(f, 1, b"")), "kvs": [_key_value(kv) for kv in f.get(2, [])],
            "more": bool(_first(f, 3)), "count": _first(f, 4)}


def txn_response(raw: bytes) -> dict[str, Any]:
    f = _fields(raw)
    responses = []
    for op in f.get(3, []):
        of = _fields(op)
        if 1 in of:
            responses.append({"response_range": range_response(of[1][-1])})
        elif 4 in of:
            responses.append({"response_txn": txn_response(of[4][-1])})
        elif 2 in of:
            responses.append({"response_put": {}})
        else:
            responses.append({"response_delete_range": {}})
    return {"header": _header(_first(f, 1, b"")), "succeeded": bool(_first(f, 2)), "responses": responses}


def lease_grant_response(raw: bytes) -> dict[str, Any]:
    f = _fields(raw)
    return {"header": _header(_first(f, 1, b"")), "ID": _first(f, 2), "TTL": _first(f, 3),
            "error": _first(f, 4, b"").decode()}


def watch_response(raw: bytes) -> dict[str, Any]:
    """WatchResponse -> {"header", "watch_id", "created", "canceled", "compact_revision", "cancel_reason",
    "events": [(type, key, value, mod_revision), ...]} (a delete's mod_revision is the deletion's revision)."""
    f = _fields(raw)
    events = []
    for raw_event in f.get(11, []):
        ef = _fields(raw_event)
        kv = _fields(_first(ef, 2, b""))
        events.append((_first(ef, 1), _first(kv, 1, b""), _first(kv, 5, b""), _first(kv, 3)))
    return {"header": _header(_first(f, 1, b"")), "watch_id": _first(f, 2), "created": bool(_first(f, 3)),
            "canceled": bool(_first(f, 4)), "compact_revision": _first(f, 5),
            "cancel_reason": _first(f, 6, b"").decode(errors="replace"), "events": events}


def status_response(raw: bytes) -> dict[str, Any]:
    """StatusResponse -> {"member_id": this member, "leader": the leader's member id, "raft_index"}."""
    f = _fields(raw)
    return {"member_id": _first(_fields(_first(f, 1, b"")), 2), "leader": _first(f, 4), "raft_index": _first(f, 5)}


def compaction_response(raw: bytes) -> dict[str, Any]:
    return {"header": _header(_first(_fields(raw), 1, b""))}


DECODERS = {"range": range_response, "txn": txn_response, "lease/grant": lease_grant_response,
            "compact": compaction_response, "status": status_response}
