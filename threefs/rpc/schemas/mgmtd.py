"""Wire schema of mgmtd: membership, heartbeats, routing info, chain tables, status."""

from __future__ import annotations

import msgspec

# node types
MGMTD = "mgmtd"
META = "meta"
STORAGE = "storage"

# public target states (3FS MgmtdTypes.h); order = order inside a chain after each pass
SERVING = "SERVING"
LASTSRV = "LASTSRV"
SYNCING = "SYNCING"
WAITING = "WAITING"
OFFLINE = "OFFLINE"
PUBLIC_STATES = (SERVING, LASTSRV, SYNCING, WAITING, OFFLINE)
# local target states, reported by the storage service that hosts the target
UPTODATE = "UPTODATE"
ONLINE = "ONLINE"
LOCAL_OFFLINE = "OFFLINE"


class NodeInfo(msgspec.Struct):
    node_id: int
    type: str
    addr: str  # host:port the service listens on
    hostname: str = ""
    failure_domain: str = ""
    alive: bool = True
    last_heartbeat_ns: int = 0
    hb_version: int = 0


class TargetInfo(msgspec.Struct):
    target_id: int
    node_id: int
    chain_id: int = 0
    public_state: str = SERVING
    local_state: str = UPTODATE
    used_bytes: int = 0


class ChainTarget(msgspec.Struct):
    target_id: int
    public_state: str


class ChainInfo(msgspec.Struct):
    chain_id: int
    version: int
    targets: list[ChainTarget]  # head first


class ChainTable(msgspec.Struct):
    table_id: int
    version: int
    chains: list[int]
    replicas: int = 0


class RoutingInfo(msgspec.Struct):
    version: int
    nodes: dict[int, NodeInfo]
    targets: dict[int, TargetInfo]
    chains: dict[int, ChainInfo]
    tables: dict[int, ChainTable]
    bootstrapping: bool = False


class RegisterReq(msgspec.Struct):
    node_id: int
    type: str
    addr: str
    hostname: str = ""
    failure_domain: str = ""
    targets: list[int] = []


class RegisterRsp(msgspec.Struct):
    routing_version: int


class LocalTarget(msgspec.Struct):
    target_id: int
    local_state: str
    used_bytes: int = 0


class HeartbeatReq(msgspec.Struct):
    node_id: int
    hb_version: int
    targets: list[LocalTarget] = []


class HeartbeatRsp(msgspec.Struct):
    routing_version: int


class GetRoutingReq(msgspec.Struct):
    known_version: int = 0


class GetRoutingRsp(msgspec.Struct):
    routing: RoutingInfo | None  # None = unchanged since known_version


class CreateChainTableReq(msgspec.Struct):
    table_id: int
    replicas: int
    chains: int = 0  # 0 = as many as the targets allow


class CreateChainTableRsp(msgspec.Struct):
    table: ChainTable
    created: bool


class SyncDoneReq(msgspec.Struct):
    target_id: int


class OkRsp(msgspec.Struct):
    pass
