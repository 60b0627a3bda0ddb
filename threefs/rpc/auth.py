"""Who is calling: the authenticator every service's RpcServer uses, and principals.

The cluster token (DIR/token) is the services' and the admin's credential; mgmtd issues a random token
per user and stores only its SHA-256 (mgmtd/users.py). Storage and meta learn the set of valid token
hashes from mgmtd (`mgmtd.list_tokens`, versioned; the routing info carries the version, so a revoked
token stops working within one routing refresh), and connections that authenticated with a token that is
no longer valid are closed.

Principals: "cluster" for the cluster token, "user:NAME#HASHPREFIX" for a user token (`user_of` parses).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.schemas.mgmtd import TokenEntry, UserInfo

log = logging.getLogger(__name__)

CLUSTER = "cluster"
_PRINCIPAL_HASH_CHARS = 16


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def principal_of(entry: TokenEntry) -> str:
    return f"user:{entry.name}#{entry.token_sha256[:_PRINCIPAL_HASH_CHARS]}"


def user_of(principal: str) -> str | None:
    """The user name of a principal (None for the cluster credential)."""
    if not principal.startswith("user:"):
        return None
    return principal[len("user:"):].split("#", 1)[0]


def token_entries(users: list[UserInfo]) -> list[TokenEntry]:
    return [TokenEntry(u.token_sha256, u.name, u.uid, u.gid) for u in users if u.token_sha256]


def require_cluster(principal: str, what: str) -> None:
    """Admin and service-only calls need the cluster token, not a user's."""
    if principal != CLUSTER:
        raise status_error(StatusCode.PERMISSION_DENIED,
                           f"{what} needs the cluster token (DIR/token); {principal} may not do it")


class TokenAuthenticator:
    """`RpcServer` authenticator: the cluster token, or any user token mgmtd currently lists.

    `update()` installs a new set of valid tokens and closes the server's connections whose token left
    it, so revocation is not delayed until the client reconnects. An unknown token triggers `reload()`,
    so a token issued a moment ago works at once, not only after the next routing refresh. Reloads are
    shared by concurrent handshakes and run at most every RELOAD_INTERVAL_S (a handshake waits for the
    next slot), so a flood of bad tokens costs mgmtd at most 1/RELOAD_INTERVAL_S calls a second.
    """

    RELOAD_INTERVAL_S = 0.2

    def __init__(self, cluster_token: str, reload=None, clock=time.monotonic):
        self.cluster_token = cluster_token
        self.version = -1  # token version of `valid`; -1 = never loaded
        self.valid: dict[str, str] = {}  # sha256 hex -> principal
        self.identities: dict[str, TokenEntry] = {}  # principal -> its user's entry (name, uid, gid)
        self.servers: list = []  # RpcServers whose connections we police
        self.reload = reload  # async () -> None: fetch the valid tokens again (from mgmtd or the KV)
        self.clock = clock
        self._reloaded_at = -1e9
        self._reloading: asyncio.Future | None = None

    async def __call__(self, token: str) -> str | None:
        if self.cluster_token and hmac.compare_digest(token.encode(), self.cluster_token.encode()):
            return CLUSTER
        digest = hash_token(token)
        if digest not in self.valid and self.reload is not None:
            if self._reloading is None or self._reloading.done():
                self._reloading = asyncio.ensure_future(self._reload_in_turn())
            await asyncio.shield(self._reloading)
        return self.valid.get(digest)

    async def _reload_in_turn(self) -> None:
        await asyncio.sleep(max(0.0, self._reloaded_at + self.RELOAD_INTERVAL_S - self.clock()))
        self._reloaded_at = self.clock()
        try:
            await self.reload()
        except ThreeFSError as e:
            log.warning("could not reload user tokens: %s", e)

    def identity(self, principal: str) -> TokenEntry | None:
        """The user (name, uid, gid) behind a principal this authenticator handed out; None for "cluster"."""
        return self.identities.get(principal)

    def update(self, version: int, entries: list[TokenEntry]) -> None:
        self.valid = {e.token_sha256: principal_of(e) for e in entries}
        self.identities = {principal_of(e): e for e in entries}
        self.version = version
        allowed = set(self.valid.values())
        closed = 0
        for server in self.servers:
            for conn in list(server.connections):
                if conn.principal not in (None, CLUSTER) and conn.principal not in allowed:
                    conn.transport.close()
                    closed += 1
        if closed:
            log.info("token version %d: closed %d connections of revoked tokens", version, closed)
