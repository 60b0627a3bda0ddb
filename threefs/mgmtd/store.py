"""mgmtd's state in the KV: nodes, targets, chains, chain tables, the routing version, the lease, users.

mgmtd keeps nothing that is not here (DESIGN principle 2): a new primary reloads it all.
Keys (3FS prefixes): NODE+id, TGIF+id, CHIF+id, CHIT+id (8 B big-endian ids), RVER -> routing version,
SING+"MgmtdLease" -> who is primary until when, MGMT+id -> each mgmtd's last sign of life,
USER+name -> user record (token stored as SHA-256), UVER -> token version.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable

import msgspec

from threefs.kv import KVEngine, Transaction
from threefs.rpc.schemas.mgmtd import (ChainInfo, ChainTable, MgmtdLease, MgmtdMember, NodeInfo, RoutingInfo,
                                       TargetInfo, UserInfo)

_ID = struct.Struct(">Q")
_PREFIXES = {NodeInfo: b"NODE", TargetInfo: b"TGIF", ChainInfo: b"CHIF", ChainTable: b"CHIT"}
_VERSION_KEY = b"RVER"
LEASE_KEY = b"SING" + b"MgmtdLease"
_MEMBER_PREFIX = b"MGMT"
_USER_PREFIX = b"USER"
_TOKEN_VERSION_KEY = b"UVER"
_enc = msgspec.msgpack.Encoder()
_lease_dec = msgspec.msgpack.Decoder(MgmtdLease)

Guard = Callable[[Transaction], Awaitable[None]]


def _key(obj) -> bytes:
    ident = {
        NodeInfo: lambda o: o.node_id,
        TargetInfo: lambda o: o.target_id,
        ChainInfo: lambda o: o.chain_id,
        ChainTable: lambda o: o.table_id,
    }[type(obj)](obj)
    return _PREFIXES[type(obj)] + _ID.pack(ident)


async def _load_all(tr: Transaction, prefix: bytes, cls: type, snapshot: bool = False) -> list:
    rows = await tr.get_range(prefix, prefix + b"\xff" * 9, snapshot=snapshot)
    dec = msgspec.msgpack.Decoder(cls)
    return [dec.decode(v) for _, v in rows]


async def read_lease(tr: Transaction) -> MgmtdLease | None:
    """The lease, conflict-tracked: a transaction that read it fails if another mgmtd takes over."""
    raw = await tr.get(LEASE_KEY)
    return _lease_dec.decode(raw) if raw else None


async def read_token_version(tr: Transaction, snapshot: bool = False) -> int:
    raw = await tr.get(_TOKEN_VERSION_KEY, snapshot=snapshot)
    return int(raw) if raw else 0


class MgmtdStore:
    def __init__(self, kv: KVEngine):
        self.kv = kv

    async def load(self) -> RoutingInfo:
        async def fn(tr: Transaction) -> RoutingInfo:
            raw = await tr.get(_VERSION_KEY)
            version = int(raw) if raw else 1
            return RoutingInfo(
                version=version,
                nodes={n.node_id: n for n in await _load_all(tr, _PREFIXES[NodeInfo], NodeInfo)},
                targets={t.target_id: t for t in await _load_all(tr, _PREFIXES[TargetInfo], TargetInfo)},
                chains={c.chain_id: c for c in await _load_all(tr, _PREFIXES[ChainInfo], ChainInfo)},
                tables={t.table_id: t for t in await _load_all(tr, _PREFIXES[ChainTable], ChainTable)},
                token_version=await read_token_version(tr),
            )

        return await self.kv.run(fn)

    async def save(self, objects: list, version: int, guard: Guard | None = None,
                   users: list[UserInfo] | None = None) -> None:
        """Write changed objects (and user records) and the new routing version in one transaction.

        `guard(tr)` runs inside the transaction first: mgmtd's lease check goes there, so a deposed
        primary can never write. Changed users also bump the token version.
        """

        async def fn(tr: Transaction) -> None:
            if guard is not None:
                await guard(tr)
            for obj in objects:
                tr.set(_key(obj), _enc.encode(obj))
            if users:
                for user in users:
                    tr.set(_USER_PREFIX + user.name.encode(), _enc.encode(user))
                tr.set(_TOKEN_VERSION_KEY, str(await read_token_version(tr) + 1).encode())
            tr.set(_VERSION_KEY, str(version).encode())

        await self.kv.run(fn)

    # -- lease and members -----------------------------------------------------------------------
    async def renew_lease(self, me: MgmtdMember, lease_ns: int,
                          now_ns: Callable[[], int]) -> tuple[MgmtdLease, int]:
        """One lease pass (3FS `extendLease`): extend ours, take an expired one, else report the holder.

        Also records this mgmtd's sign of life. Returns (the lease after the pass, the token version).
        """

        async def fn(tr: Transaction) -> tuple[MgmtdLease, int]:
            now = now_ns()
            lease = await read_lease(tr)
            member = MgmtdMember(me.node_id, me.addr, now)
            tr.set(_MEMBER_PREFIX + _ID.pack(me.node_id), _enc.encode(member))
            if lease is None or lease.primary_id == me.node_id or lease.lease_end_ns <= now:
                start = lease.lease_start_ns if lease and lease.primary_id == me.node_id else now
                lease = MgmtdLease(me.node_id, me.addr, start, now + lease_ns)
                tr.set(LEASE_KEY, _enc.encode(lease))
            return lease, await read_token_version(tr, snapshot=True)

        return await self.kv.run(fn)

    async def release_lease(self, node_id: int, now_ns: int) -> None:
        """On a clean shutdown the primary ends its lease now, so a standby takes over at its next pass."""

        async def fn(tr: Transaction) -> None:
            lease = await read_lease(tr)
            if lease is not None and lease.primary_id == node_id:
                lease.lease_end_ns = min(lease.lease_end_ns, now_ns)
                tr.set(LEASE_KEY, _enc.encode(lease))

        await self.kv.run(fn)

    async def members(self) -> list[MgmtdMember]:
        async def fn(tr: Transaction) -> list[MgmtdMember]:
            return await _load_all(tr, _MEMBER_PREFIX, MgmtdMember, snapshot=True)

        return await self.kv.run(fn)

    # -- users -----------------------------------------------------------------------------------
    async def users(self) -> tuple[int, list[UserInfo]]:
        """(token version, every user record), from one snapshot."""

        async def fn(tr: Transaction) -> tuple[int, list[UserInfo]]:
            version = await read_token_version(tr, snapshot=True)
            return version, await _load_all(tr, _USER_PREFIX, UserInfo, snapshot=True)

        return await self.kv.run(fn)

    async def token_version(self) -> int:
        async def fn(tr: Transaction) -> int:
            return await read_token_version(tr, snapshot=True)

        return await self.kv.run(fn)
