"""The routing model every participant reads: one versioned RoutingInfo snapshot from mgmtd, and which
targets of a chain serve reads and take writes. Used by storage (CRAQ, resync, scrub), meta and clients;
mgmtd's chain state machine (mgmtd/chain_state.py) is what writes the states these functions read."""

from __future__ import annotations

from threefs.common.status import StatusCode, status_error
from threefs.rpc.schemas import mgmtd as s
from threefs.rpc.schemas.mgmtd import SERVING, SYNCING, ChainInfo


class Routing:
    """Read-only helpers over one RoutingInfo snapshot."""

    def __init__(self, info: s.RoutingInfo):
        self.info = info
        self._nodes_of_type: dict[tuple[str, bool], list[s.NodeInfo]] = {}  # (a snapshot: computed once)

    @property
    def version(self) -> int:
        return self.info.version

    def chain(self, chain_id: int) -> s.ChainInfo:
        chain = self.info.chains.get(chain_id)
        if chain is None:
            raise status_error(StatusCode.CHAIN_NOT_FOUND, f"chain {chain_id} is not in routing "
                               f"v{self.info.version}")
        return chain

    def table(self, table_id: int) -> s.ChainTable:
        table = self.info.tables.get(table_id)
        if table is None:
            raise status_error(StatusCode.CHAIN_TABLE_NOT_FOUND,
                               f"chain table {table_id} does not exist (create it with `threefs up` "
                               "or `threefs admin create-chain-table`)")
        return table

    def target_addr(self, target_id: int) -> str:
        target = self.info.targets.get(target_id)
        if target is None:
            raise status_error(StatusCode.TARGET_NOT_FOUND, f"target {target_id} is unknown")
        node = self.info.nodes.get(target.node_id)
        if node is None:
            raise status_error(StatusCode.NODE_NOT_FOUND, f"node {target.node_id} of target "
                               f"{target_id} is unknown")
        return node.addr

    def nodes_of_type(self, type_: str, alive_only: bool = True) -> list[s.NodeInfo]:
        """The nodes of one type by node id (a new list each call: callers may change theirs)."""
        nodes = self._nodes_of_type.get((type_, alive_only))
        if nodes is None:
            nodes = self._nodes_of_type[type_, alive_only] = sorted(
                (n for n in self.info.nodes.values() if n.type == type_ and (n.alive or not alive_only)),
                key=lambda n: n.node_id)
        return list(nodes)

    def describe_chain(self, chain_id: int) -> str:
        chain = self.chain(chain_id)
        return ", ".join(f"target {t.target_id} {t.public_state}" for t in chain.targets)


def serving_targets(chain: ChainInfo) -> list[int]:
    """The targets a read may go to."""
    return [t.target_id for t in chain.targets if t.public_state == SERVING]


def write_targets(chain: ChainInfo) -> list[int]:
    """The targets a write goes through, head first (SERVING then SYNCING)."""
    return [t.target_id for t in chain.targets if t.public_state in (SERVING, SYNCING)]
