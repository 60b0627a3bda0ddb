"""Client of mgmtd, used by every process: finds the primary, caches versioned routing info."""

from __future__ import annotations

import asyncio
import logging

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.client import RpcClient
from threefs.cluster.routing import Routing
from threefs.rpc.schemas import mgmtd as s

log = logging.getLogger(__name__)

MGMTD_ADDRS_MAX = 16  # configured addresses plus redirect targets learnt
MGMTD_ATTEMPTS_MAX = 8  # addresses tried by one call before giving up with UNAVAILABLE


class MgmtdClient:
    """Finds the primary mgmtd among `addrs` (following NOT_PRIMARY redirects) and caches routing.

    `token_listener`, if set (storage and meta), is awaited as `listener(routing)` whenever the routing
    info carries a token version the listener has not seen: it fetches the valid user tokens.
    """

    def __init__(self, rpc: RpcClient, addrs: list[str], *, timeout: float = 5.0,
                 follow_redirects: bool = True):
        if not addrs:
            raise status_error(StatusCode.INVALID_ARGUMENT, "no mgmtd address configured")
        self.rpc = rpc
        self.addrs = list(addrs)
        self.timeout = timeout
        self.follow_redirects = follow_redirects
        self.routing: Routing | None = None
        self.token_listener = None  # async (Routing) -> bool (True once that version is installed)
        self._token_version_seen = -1
        self._refreshing: asyncio.Task | None = None

    def _prefer(self, addr: str) -> None:
        """Try `addr` first from now on (the last primary that answered, or a redirect target)."""
        if addr in self.addrs:
            self.addrs.remove(addr)
        self.addrs.insert(0, addr)
        del self.addrs[MGMTD_ADDRS_MAX:]

    async def call(self, method: str, req, rsp_type, timeout: float | None = None):
        """Call the primary mgmtd: each address at most once, a NOT_PRIMARY redirect's target next."""
        errors: list[str] = []
        tried: set[str] = set()
        queue = list(self.addrs)
        while queue and len(tried) < MGMTD_ATTEMPTS_MAX:
            addr = queue.pop(0)
            if addr in tried:
                continue
            tried.add(addr)
            try:
                rsp, _ = await self.rpc.call(addr, f"mgmtd.{method}", req, rsp_type,
                                             timeout=timeout or self.timeout)
            except ThreeFSError as e:
                if e.code not in (StatusCode.UNAVAILABLE, StatusCode.NOT_PRIMARY, StatusCode.TIMEOUT):
                    raise
                errors.append(f"{addr}: {e.message}")
                redirect = s.primary_from_message(e.message) if e.code == StatusCode.NOT_PRIMARY else ""
                if redirect and redirect not in tried and (self.follow_redirects or redirect in self.addrs):
                    queue.insert(0, redirect)
                continue
            if addr != self.addrs[0]:
                self._prefer(addr)
            return rsp
        raise status_error(StatusCode.UNAVAILABLE, "no primary mgmtd answered: " + "; ".join(errors))

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
        await self._check_tokens()
        return self.routing

    async def _check_tokens(self) -> None:
        if self.token_listener is None or self.routing is None:
            return
        version = self.routing.info.token_version
        if version != self._token_version_seen:
            try:
                if await self.token_listener(self.routing):
                    self._token_version_seen = version
            except ThreeFSError as e:  # keep the old set; the next refresh tries again
                log.warning("could not fetch user tokens (version %d): %s", version, e)

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
