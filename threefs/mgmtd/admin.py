"""mgmtd's admin operations (`threefs admin ...`): chain tables, target overrides, users and tokens.

Served under the "mgmtd." prefix beside `MgmtdService`; primary only, and all but `list_tokens` and
`user_list` need the cluster token. Every change goes through `MgmtdService.commit` (lease re-checked in
the transaction, new routing version).
"""

from __future__ import annotations

import copy
import logging
import time

from threefs.common.status import StatusCode, status_error
from threefs.mgmtd.chain_state import TransitionError, offline_refusal, rotate_lastsrv
from threefs.mgmtd.service import MgmtdService
from threefs.mgmtd.users import USERS_MAX, check_user_name, new_token
from threefs.rpc.auth import hash_token, require_cluster, token_entries
from threefs.rpc.schemas import mgmtd as s
from threefs.rpc.schemas.common import Empty
from threefs.rpc.server import CallContext, rpc

log = logging.getLogger(__name__)

CHAIN_TABLE_ID_MAX = 1 << 16
REPLICAS_MAX = 8


class MgmtdAdmin:
    def __init__(self, svc: MgmtdService):
        self.svc = svc

    # -- chain tables --------------------------------------------------------------------------------
    @rpc(s.CreateChainTableReq)
    async def create_chain_table(self, ctx: CallContext, req: s.CreateChainTableReq) -> s.CreateChainTableRsp:
        require_cluster(ctx.principal, "creating a chain table")
        if not 1 <= req.table_id <= CHAIN_TABLE_ID_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"table id must be in 1..{CHAIN_TABLE_ID_MAX}")
        if not 1 <= req.replicas <= REPLICAS_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"replication factor must be in 1..{REPLICAS_MAX}, not {req.replicas}")
        async with self.svc._lock:
            routing = self.svc.check_primary()
            table = routing.tables.get(req.table_id)
            if table is not None:
                return s.CreateChainTableRsp(table, False)
            chains = place_chains(routing, req.replicas, req.chains)
            first = max(routing.chains, default=0) + 1
            objects: list = []
            for i, target_ids in enumerate(chains):
                chain = s.ChainInfo(first + i, 1, [s.ChainTarget(t, s.SERVING) for t in target_ids])
                objects.append(chain)
                objects.extend(self.svc._target_states(chain))
            table = s.ChainTable(req.table_id, 1, [c.chain_id for c in objects if type(c) is s.ChainInfo],
                                 req.replicas)
            await self.svc.commit(objects + [table])
        log.info("created chain table %d: %d chains x %d replicas", req.table_id, len(chains), req.replicas)
        return s.CreateChainTableRsp(table, True)

    # -- target and chain overrides ------------------------------------------------------------------
    @rpc(s.TargetAdminReq)
    async def offline_target(self, ctx: CallContext, req: s.TargetAdminReq) -> s.OkRsp:
        """Take a target out of service (maintenance, a failing disk) or put it back (`offline=False`).

        A SERVING target leaves its chain only once its node has seen this (its heartbeat carries the
        new routing version; it then refuses reads) or its node is failed: until then it keeps taking
        writes, so no read it serves can miss an acknowledged one (chain_state.admin_offline_effective;
        typically two heartbeat intervals)."""
        require_cluster(ctx.principal, "taking a target offline")
        async with self.svc._lock:
            routing = self.svc.check_primary()
            info = routing.targets.get(req.target_id)
            if info is None:
                raise status_error(StatusCode.TARGET_NOT_FOUND, f"target {req.target_id} does not exist "
                                   "(see `threefs status`)")
            if req.offline and not req.force:
                _refuse_last_server(routing, info)
            new = copy.copy(info)
            if req.offline and not info.admin_offline:
                new.admin_offline_ver = routing.version + 1  # the version this commit publishes
            new.admin_offline = req.offline
            await self.svc.commit([new])
        log.warning("target %d %s by admin", req.target_id, "taken offline" if req.offline else "put back")
        await self.svc.update_chains()
        return s.OkRsp()

    @rpc(s.ChainAdminReq)
    async def rotate_lastsrv(self, ctx: CallContext, req: s.ChainAdminReq) -> s.ChainRsp:
        """Give up on a LASTSRV head that will not return; the next target becomes LASTSRV."""
        require_cluster(ctx.principal, "rotating a LASTSRV")
        async with self.svc._lock:
            routing = self.svc.check_primary()
            chain = routing.chains.get(req.chain_id)
            if chain is None:
                raise status_error(StatusCode.CHAIN_NOT_FOUND, f"chain {req.chain_id} does not exist")
            try:
                new = rotate_lastsrv(chain)
            except TransitionError as e:
                raise status_error(StatusCode.INVALID_ARGUMENT, str(e)) from None
            await self.svc.commit([new, *self.svc._target_states(new)])
        log.warning("chain %d: LASTSRV rotated by admin to target %d", req.chain_id, new.targets[0].target_id)
        return s.ChainRsp(new)

    # -- users -----------------------------------------------------------------------------------------
    @rpc(s.UserReq)
    async def user_add(self, ctx: CallContext, req: s.UserReq) -> s.UserTokenRsp:
        require_cluster(ctx.principal, "adding a user")
        check_user_name(req.name)
        if not (0 <= req.uid < 1 << 32 and 0 <= req.gid < 1 << 32):
            raise status_error(StatusCode.INVALID_ARGUMENT, "uid and gid must be in 0..2^32-1")
        _, users = await self.svc.store.users()
        if any(u.name == req.name for u in users):
            raise status_error(StatusCode.EXISTS, f"user {req.name} exists (rotate its token with "
                               f"`threefs admin user-token {req.name}`)")
        if len(users) >= USERS_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"at most {USERS_MAX} users")
        now = time.time_ns()
        return await self._issue(s.UserInfo(req.name, req.uid, req.gid, "", now))

    @rpc(s.UserReq)
    async def user_token(self, ctx: CallContext, req: s.UserReq) -> s.UserTokenRsp:
        """A fresh token for an existing user; the old one stops working."""
        require_cluster(ctx.principal, "issuing a token")
        return await self._issue(await self._user(req.name))

    @rpc(s.UserReq)
    async def user_revoke(self, ctx: CallContext, req: s.UserReq) -> s.OkRsp:
        require_cluster(ctx.principal, "revoking a token")
        user = await self._user(req.name)
        user.token_sha256 = ""
        async with self.svc._lock:
            await self.svc.commit([], users=[user])
        await self.svc._reload_tokens()
        log.warning("token of user %s revoked", req.name)
        return s.OkRsp()

    @rpc(Empty)
    async def user_list(self, ctx: CallContext, req: Empty) -> s.UserListRsp:
        self.svc.check_primary()
        _, users = await self.svc.store.users()
        return s.UserListRsp(sorted(users, key=lambda u: u.name))

    @rpc(s.ListTokensReq)
    async def list_tokens(self, ctx: CallContext, req: s.ListTokensReq) -> s.ListTokensRsp:
        """The valid token hashes, for storage and meta to authenticate users (services only)."""
        require_cluster(ctx.principal, "listing token hashes")
        self.svc.check_primary()
        version, users = await self.svc.store.users()
        if version == req.known_version:
            return s.ListTokensRsp(version, None)
        return s.ListTokensRsp(version, token_entries(users))

    async def _user(self, name: str) -> s.UserInfo:
        check_user_name(name)
        _, users = await self.svc.store.users()
        for u in users:
            if u.name == name:
                return u
        raise status_error(StatusCode.NOT_FOUND, f"user {name} does not exist (`threefs admin user-list`)")

    async def _issue(self, user: s.UserInfo) -> s.UserTokenRsp:
        token = new_token()
        user.token_sha256, user.token_issued_ns = hash_token(token), time.time_ns()
        async with self.svc._lock:
            await self.svc.commit([], users=[user])
        await self.svc._reload_tokens()
        log.info("token issued for user %s", user.name)
        return s.UserTokenRsp(user, token)


def _refuse_last_server(routing: s.RoutingInfo, info: s.TargetInfo) -> None:
    chain = routing.chains.get(info.chain_id)
    if chain is None:
        return
    leaving = {t.target_id for t in routing.targets.values() if t.admin_offline}
    refusal = offline_refusal(chain, info.target_id, leaving)
    if refusal is not None:
        raise status_error(StatusCode.INVALID_ARGUMENT, refusal)


def place_chains(routing: s.RoutingInfo, replicas: int, wanted: int) -> list[list[int]]:
    """Chains of `replicas` free targets, each on a different failure domain, heads rotated."""
    free: dict[str, list[int]] = {}
    for t in sorted(routing.targets.values(), key=lambda t: t.target_id):
        node = routing.nodes.get(t.node_id)
        if t.chain_id == 0 and node is not None and node.alive and node.type == s.STORAGE:
            free.setdefault(node.failure_domain, []).append(t.target_id)
    domains = sorted(free)
    if len(domains) < replicas:
        raise status_error(StatusCode.NOT_ENOUGH_NODES,
                           f"replication factor {replicas} needs {replicas} storage failure domains "
                           f"with free targets; only {len(domains)} have any (add storage with "
                           "`threefs admin add-storage`)")
    chains: list[list[int]] = []
    while not wanted or len(chains) < wanted:
        ranked = sorted(domains, key=lambda d: -len(free[d]))  # most free targets first
        picked = [d for d in ranked if free[d]][:replicas]
        if len(picked) < replicas:
            break
        shift = len(chains) % replicas  # rotate which domain heads the chain
        picked = picked[shift:] + picked[:shift]
        chains.append([free[d].pop(0) for d in picked])
    if not chains or (wanted and len(chains) < wanted):
        raise status_error(StatusCode.NOT_ENOUGH_NODES,
                           f"only {len(chains)} chains of {replicas} replicas fit the free targets")
    return chains
