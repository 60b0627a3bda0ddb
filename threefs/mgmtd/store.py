"""mgmtd's state in the KV: nodes, targets, chains, chain tables and the routing version.

mgmtd keeps nothing that is not here (DESIGN principle 2): a restarted mgmtd reloads it all.
Keys (3FS prefixes): NODE+id, TGIF+id, CHIF+id, CHIT+id (8 B big-endian ids), RVER -> version.
"""

from __future__ import annotations

import struct

import msgspec

from threefs.kv import KVEngine, Transaction
from threefs.rpc.schemas.mgmtd import ChainInfo, ChainTable, NodeInfo, RoutingInfo, TargetInfo

_ID = struct.Struct(">Q")
_PREFIXES = {NodeInfo: b"NODE", TargetInfo: b"TGIF", ChainInfo: b"CHIF", ChainTable: b"CHIT"}
_VERSION_KEY = b"RVER"
_enc = msgspec.msgpack.Encoder()


def _key(obj) -> bytes:
    ident = {
        NodeInfo: lambda o: o.node_id,
        TargetInfo: lambda o: o.target_id,
        ChainInfo: lambda o: o.chain_id,
        ChainTable: lambda o: o.table_id,
    }[type(obj)](obj)
    return _PREFIXES[type(obj)] + _ID.pack(ident)


async def _load_all(tr: Transaction, cls: type) -> list:
    prefix = _PREFIXES[cls]
    rows = await tr.get_range(prefix, prefix + b"\xff" * 9)
    dec = msgspec.msgpack.Decoder(cls)
    return [dec.decode(v) for _, v in rows]


class MgmtdStore:
    def __init__(self, kv: KVEngine):
        self.kv = kv

    async def load(self) -> RoutingInfo:
        async def fn(tr: Transaction) -> RoutingInfo:
            raw = await tr.get(_VERSION_KEY)
            version = int(raw) if raw else 1
            return RoutingInfo(
                version=version,
                nodes={n.node_id: n for n in await _load_all(tr, NodeInfo)},
                targets={t.target_id: t for t in await _load_all(tr, TargetInfo)},
                chains={c.chain_id: c for c in await _load_all(tr, ChainInfo)},
                tables={t.table_id: t for t in await _load_all(tr, ChainTable)},
            )

        return await self.kv.run(fn)

    async def save(self, objects: list, version: int, guard=None) -> None:
        """Write changed objects and the new routing version in one transaction.

        `guard(tr)` (async) runs inside the transaction first: the lease check of mgmtd HA goes there,
        so a deposed primary can never write.
        """

        async def fn(tr: Transaction) -> None:
            if guard is not None:
                await guard(tr)
            for obj in objects:
                tr.set(_key(obj), _enc.encode(obj))
            tr.set(_VERSION_KEY, str(version).encode())

        await self.kv.run(fn)
