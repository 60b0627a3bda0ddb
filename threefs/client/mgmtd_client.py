"""Client of mgmtd, used by every process: finds the primary, caches versioned routing info."""

from __future__ import annotations

import asyncio
import logging

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.client import RpcClient
from threefs.rpc.schemas import mgmtd as s

log = logging.getLogger(__name__)


class Routing:
    """Read-only helpers over one RoutingInfo snapshot."""

    def __init__(self, info: s.RoutingInfo):
        self.info = info

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
        return sorted((n for n in self.info.nodes.values()
                       if n.type == type_ and (n.alive or not alive_only)), key=lambda n: n.node_id)

    def describe_chain(self, chain_id: int) -> str:
        chain = self.chain(chain_id)
        return ", ".join(f"target {t.target_id} {t.public_state}" for t in chain.targets)


class MgmtdClient:
    def __init__(self, rpc: RpcClient, addrs: list[str], *, timeout: float = 5.0):
        if not addrs:
            raise status_error(StatusCode.INVALID_ARGUMENT, "no mgmtd address configured")
        self.rpc = rpc
        self.addrs = list(addrs)
        self.timeout = timeout
        self.routing: Routing | None = None
        self._refreshing: asyncio.Task | None = None

    async def call(self, method: str, req, rsp_type, timeout: float | None = None):
        """Call the primary mgmtd, trying each configured address (3FS: probe + follow redirects)."""
        errors = []
        for addr in list(self.addrs):
            try:
                rsp, _ = await self.rpc.call(addr, f"mgmtd.{method}", req, rsp_type,
                                             timeout=timeout or self.timeout)
                if addr != self.addrs[0]:  # remember who answered
                    self.addrs.remove(addr)
                    self.addrs.insert(0, addr)
                return rsp
            except ThreeFSError as e:
                if e.code not in (StatusCode.UNAVAILABLE, StatusCode.NOT_PRIMARY, StatusCode.TIMEOUT):
                    raise
                errors.append(f"{addr}: {e.message}")
        raise status_error(StatusCode.UNAVAILABLE, "no mgmtd answered: " + "; ".join(errors))

    async def refresh(self, force: bool = False) -> Routing:
        """Fetch routing if it changed (one in flight at a time; callers share it)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._fetch(force))
        return await asyncio.shield(self._refreshing)

    async def _fetch(self, force: bool) -> Routing:
        known = 0 if force or self.routing is None else self.routing.version
        rsp = await self.call("get_routing", s.GetRoutingReq(known), s.GetRoutingRsp)
        if rsp.routing is not None:
            self.routing = Routing(rsp.routing)
        return self.routing

    async def get(self) -> Routing:
        return self.routing if self.routing is not None else await self.refresh()

    async def refresh_loop(self, interval: float) -> None:
        """Poll routing until cancelled; a dead mgmtd only delays the next refresh."""
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh()
            except ThreeFSError as e:
                log.debug("routing refresh failed: %s", e)
