"""Hostile-input generators for fuzzing the RPC layer: request bodies for every registered method (well
typed with edge values, wrongly typed, truncated) and malformed frames. Seeded; no network here — the
tests (tests/security/test_fuzz.py) send what these produce to real servers.
"""

from __future__ import annotations

import random
from typing import Iterator

import msgspec
import msgspec.inspect as mi

from threefs.common import limits
from threefs.rpc.frame import KIND_GRANT, KIND_HELLO, KIND_REQUEST, KIND_RESPONSE, MAGIC, PREFIX, Header

_RPC_ATTR = "__threefs_rpc__"
INTS = [0, 1, -1, 2, 7, 255, 256, 4096, 1 << 20, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40,
        (1 << 63) - 1, -(1 << 63), (1 << 64) - 1]
STRS = ["", "/", "//", ".", "..", "/..", "/../..", "a", "\x00", "/a\x00b", "é", "\udcff"[:0] + "\u2028",
        "x" * 255, "y" * 256, "/" + "d/" * 2100, "../" * 50, "/pub/hello", "user:alice#0", "-1"]
BYTES = [b"", b"\x00", b"\xff" * 16, bytes(range(16)), b"\x00" * 17, b"z" * 70_000]
LIST_LENS = [0, 1, 2, 3, 5, 1025, 3000]


def service_methods() -> dict[str, list[tuple[str, type]]]:
    """Every RPC a real service registers: {"mgmtd": [("mgmtd.status", Empty), ...], ...}.

    Read from the handler marks (`@rpc`) of the classes threefs.server registers, so a new handler is
    fuzzed without touching the fuzzer."""
    from threefs.meta.service import MetaService
    from threefs.mgmtd.admin import MgmtdAdmin
    from threefs.mgmtd.service import MgmtdService
    from threefs.storage.resync import Resyncer
    from threefs.storage.scrub import Scrubber
    from threefs.storage.service import StorageService

    classes = {"mgmtd": [MgmtdService, MgmtdAdmin], "meta": [MetaService],
               "storage": [StorageService, Resyncer, Scrubber]}
    out: dict[str, list[tuple[str, type]]] = {}
    for prefix, types in classes.items():
        methods = []
        for cls in types:
            for attr in dir(cls):
                mark = getattr(getattr(cls, attr), _RPC_ATTR, None)
                if mark is not None:
                    methods.append((f"{prefix}.{mark[0]}", mark[1]))
        out[prefix] = sorted(methods, key=lambda x: x[0])
    return out


def random_value(rng: random.Random, depth: int = 0):
    """Any msgpack value: the wrong type for most fields."""
    pick = rng.randrange(9 if depth < 3 else 6)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice(INTS)
    if pick == 3:
        return rng.random() * rng.choice([1, -1e300, 1e300])
    if pick == 4:
        return rng.choice(STRS)
    if pick == 5:
        return rng.choice(BYTES)
    if pick == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 3, 8]))]
    if pick == 7:
        return {rng.choice(STRS): random_value(rng, depth + 1) for _ in range(rng.choice([0, 1, 3]))}
    return {1: random_value(rng, depth + 1), b"k": None}  # keys msgspec Structs never accept


def typed_value(rng: random.Random, t, depth: int = 0):
    """A value of type-info `t`, biased to edge cases; sometimes deliberately the wrong type."""
    if rng.random() < 0.08:
        return random_value(rng, depth)
    if isinstance(t, mi.Metadata):
        return typed_value(rng, t.type, depth)
    if isinstance(t, mi.IntType):
        return rng.choice(INTS) if rng.random() < 0.6 else rng.randrange(0, 5000)
    if isinstance(t, mi.FloatType):
        return rng.choice([0.0, -1.0, 1e-9, 1e300, float("inf"), float("nan"), rng.random() * 100])
    if isinstance(t, mi.StrType):
        return rng.choice(STRS) if rng.random() < 0.7 else "/" + "".join(rng.choices("ab/.\x00", k=12))
    if isinstance(t, mi.BytesType):
        return rng.choice(BYTES)
    if isinstance(t, mi.BoolType):
        return rng.random() < 0.5
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.LiteralType):
        return rng.choice(list(t.values))
    if isinstance(t, mi.UnionType):
        return typed_value(rng, rng.choice(t.types), depth)
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        n = rng.choice(LIST_LENS) if depth < 2 else rng.choice([0, 1, 2])
        first = typed_value(rng, t.item_type, depth + 1)
        return [first] * n if n > 50 else [typed_value(rng, t.item_type, depth + 1) for _ in range(n)]
    if isinstance(t, mi.TupleType):
        return [typed_value(rng, x, depth + 1) for x in t.item_types]
    if isinstance(t, mi.DictType):
        return {typed_value(rng, t.key_type, depth + 1): typed_value(rng, t.value_type, depth + 1)
                for _ in range(rng.choice([0, 1, 3]))}
    if isinstance(t, mi.StructType):
        return struct_value(rng, t, depth + 1)
    return random_value(rng, depth)


def struct_value(rng: random.Random, info: mi.StructType, depth: int = 0):
    fields = [f for f in info.fields if f.required or rng.random() < 0.7]
    if info.array_like:
        return [typed_value(rng, f.type, depth) for f in info.fields]
    return {f.encode_name: typed_value(rng, f.type, depth) for f in fields}


_encoder = msgspec.msgpack.Encoder()


def random_body(rng: random.Random, req_type: type) -> bytes:
    """Encoded request body: one msgpack value (the frame header embeds it, so it must stay decodable:
    byte-level corruption is the frame fuzzer's job) — mostly the right shape with edge values, else the
    wrong type, junk bytes as a bin value, or the right shape with required fields missing."""
    roll = rng.random()
    info = mi.type_info(req_type)
    if roll < 0.6:
        value = struct_value(rng, info)
    elif roll < 0.85:
        value = random_value(rng)
    elif roll < 0.92:
        value = rng.randbytes(rng.choice([0, 1, 5, 40]))
    else:
        value = struct_value(rng, info)
        if isinstance(value, dict) and value:
            value.pop(rng.choice(list(value)))
        elif isinstance(value, list) and value:
            value = value[:-1]
    body = _encoder.encode(value)
    return body if len(body) <= limits.FRAME_HEADER_BYTES_MAX // 2 else _encoder.encode(None)


def _raw_frame(header_bytes: bytes, payload: bytes = b"", magic: int = MAGIC,
               plen: int | None = None) -> bytes:
    plen = len(payload) if plen is None else plen
    return PREFIX.pack(magic, 0, len(header_bytes), plen) + header_bytes + payload


def malformed_frames(rng: random.Random, methods: list[str]) -> Iterator[tuple[bool, bytes]]:
    """Endless (fatal, frame bytes). Non-fatal frames keep the connection (the server answers an error);
    a fatal one makes the server close it (bad magic, undecodable or oversized header, wrong kind)."""
    while True:
        roll = rng.random()
        rid = rng.randrange(1, 1 << 62)
        if roll < 0.45:  # a request whose body is junk for its method
            method = rng.choice(methods)
            h = Header(KIND_REQUEST, rid, method=method, timeout_ms=rng.choice([0, 1, 5000]),
                       body=msgspec.Raw(_encoder.encode(random_value(rng))))
            yield False, _raw_frame(_encoder.encode(h))
        elif roll < 0.7:  # an unknown or odd method name
            name = rng.choice(["", "meta.", ".", "x" * 300, "meta.__init__", "storage._disk",
                               "mgmtd.release", "\x00", "meta.stat\x00", rng.choice(methods).upper()])
            h = Header(KIND_REQUEST, rid, method=name, body=msgspec.Raw(b"\x80"))
            yield False, _raw_frame(_encoder.encode(h))
        elif roll < 0.8:  # a grant for nothing / request-id 0 / negative timeout: answered or ignored
            h = Header(rng.choice([KIND_GRANT, KIND_REQUEST]), rng.choice([0, rid]), method="meta.stat",
                       timeout_ms=rng.choice([-1, 0]), body=msgspec.Raw(b"\x80"))
            yield False, _raw_frame(_encoder.encode(h))
        elif roll < 0.86:
            yield True, _raw_frame(b"\x93\x00", magic=rng.randrange(0, 0xFFFF) ^ 1 if rng.random() < 0.5
                                   else MAGIC ^ 0x100)
        elif roll < 0.92:  # undecodable header (junk, truncated array, wrong field types)
            junk = rng.choice([rng.randbytes(rng.randrange(1, 64)), b"\x95\x00", b"\x92\xa1x\xa1y", b"\xc1"])
            yield True, _raw_frame(junk)
        elif roll < 0.96:  # header or payload claims past the limits
            yield True, PREFIX.pack(MAGIC, 0, rng.choice([limits.FRAME_HEADER_BYTES_MAX + 1, (1 << 32) - 1]),
                                    rng.choice([0, 1 << 62]))
        else:  # a response or hello kind sent to a server
            h = Header(rng.choice([KIND_RESPONSE, KIND_HELLO, 99, -1]), rid, method="meta.stat")
            yield True, _raw_frame(_encoder.encode(h))
