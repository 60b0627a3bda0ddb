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
LOCAL_STATES = (UPTODATE, ONLINE, LOCAL_OFFLINE)

# A NOT_PRIMARY error's message ends with this marker and the primary's address (if one is known), so any
# mgmtd can redirect a caller: "... primary is at 127.0.0.1:8000".
PRIMARY_MARKER = "primary is at "


def not_primary_message(me: str, primary_addr: str) -> str:
    if primary_addr and primary_addr != me:
        return f"mgmtd {me} is a standby; {PRIMARY_MARKER}{primary_addr}"
    return f"mgmtd {me} is a standby and knows no live primary yet (election in progress); retry"


def primary_from_message(message: str) -> str:
    """The redirect address carried by a NOT_PRIMARY message ('' when none)."""
    _, found, addr = message.rpartition(PRIMARY_MARKER)
    return addr.strip() if found else ""


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
    admin_offline: bool = False  # `threefs admin offline-target`: counts as locally OFFLINE until undone
    free_bytes: int = 0  # free space of the file system the target lives on (statfs; meta.statfs)
    fs_id: str = ""  # that file system's id on its host ("" = not reported), so shared disks count once
    admin_offline_ver: int = 0  # the routing version that set admin_offline (chain_state.admin_offline_effective)


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
    token_version: int = 0  # bumped when user tokens change: services then fetch `list_tokens`
    primary_addr: str = ""


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
    free_bytes: int = 0  # see TargetInfo
    fs_id: str = ""


class SyncProgress(msgspec.Struct):
    """A resync run by the sending node: `source` (ours) brings `target_id` (its successor) up to date."""

    target_id: int
    source_id: int
    chunks_done: int
    chunks_total: int


class HeartbeatReq(msgspec.Struct):
    node_id: int
    hb_version: int  # monotonic per registration; an older one is a stale duplicate
    targets: list[LocalTarget] = []
    syncs: list[SyncProgress] = []
    problems: list[str] = []  # what the node knows is wrong with itself (common/health.py), bounded
    routing_version: int = 0  # the node's routing when it sent this: what it has seen (admin offline waits for it)


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
    chain_id: int
    chain_ver: int  # the chain version the resync started under (after quiescing older flows)


class OkRsp(msgspec.Struct):
    pass


# -- HA --------------------------------------------------------------------------------------------------
class MgmtdLease(msgspec.Struct):
    """KV key `SING` + `MgmtdLease` (3FS): who is primary, until when (wall clock, ns)."""

    primary_id: int
    primary_addr: str
    lease_start_ns: int
    lease_end_ns: int


class MgmtdMember(msgspec.Struct):
    """KV key `MGMT` + id: every mgmtd writes its own on each lease pass (for `threefs status`)."""

    node_id: int
    addr: str
    last_seen_ns: int


class PrimaryRsp(msgspec.Struct):
    """Answered by every mgmtd, primary or standby."""

    node_id: int
    addr: str
    is_primary: bool
    primary_id: int
    primary_addr: str
    lease_end_ns: int
    kv_error: str = ""  # this mgmtd cannot write its KV (its lease renewals fail), with the error


# -- admin -----------------------------------------------------------------------------------------------
class TargetAdminReq(msgspec.Struct):
    target_id: int
    offline: bool = True  # False: undo an earlier offline
    force: bool = False  # allow taking the last SERVING target of a chain offline


class ChainAdminReq(msgspec.Struct):
    chain_id: int


class ChainRsp(msgspec.Struct):
    chain: ChainInfo


class UserReq(msgspec.Struct):
    name: str
    uid: int = 0
    gid: int = 0


class UserInfo(msgspec.Struct):
    """KV key `USER` + name. Only the SHA-256 of the token is stored; the token is shown once."""

    name: str
    uid: int
    gid: int
    token_sha256: str  # hex; "" = revoked
    created_ns: int
    token_issued_ns: int = 0


class UserTokenRsp(msgspec.Struct):
    user: UserInfo
    token: str


class UserListRsp(msgspec.Struct):
    users: list[UserInfo]


class ListTokensReq(msgspec.Struct):
    known_version: int = -1


class TokenEntry(msgspec.Struct, array_like=True):
    token_sha256: str
    name: str
    uid: int
    gid: int


class ListTokensRsp(msgspec.Struct):
    version: int
    tokens: list[TokenEntry] | None  # None = unchanged since known_version


# -- status ----------------------------------------------------------------------------------------------
FLAPPING_FAILURES = 3  # failures in the status window that make `threefs status` call a node flapping


class MgmtdStatusRsp(msgspec.Struct):
    routing: RoutingInfo
    primary: PrimaryRsp
    members: list[MgmtdMember]
    heartbeat_age_s: dict[int, float]  # node id -> seconds since its last heartbeat (this primary's view)
    syncs: list[SyncProgress]
    primary_since_ns: int
    heartbeat_timeout_s: float
    node_problems: dict[int, list[str]] = {}  # node id -> what it reported wrong in its last heartbeat
    failures: dict[int, int] = {}  # node id -> times it was marked failed in the last FLAP_WINDOW_S
    kv_error: str = ""  # this mgmtd cannot write its KV (lease renewals failing), with the error
    flap_window_s: float = 600.0
