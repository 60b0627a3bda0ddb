"""Users and their tokens, as mgmtd keeps them: names, uid/gid, and a random token per user of which
only the SHA-256 is stored (`USER` keys); the token is shown once. Authentication itself (the cluster
token, principals, the RpcServer authenticator) is in rpc/auth.py.
"""

from __future__ import annotations

import re
import secrets

from threefs.common.status import StatusCode, status_error

USER_NAME_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")  # POSIX-portable user names, <= 32 bytes
USERS_MAX = 10_000
TOKEN_BYTES = 32


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def check_user_name(name: str) -> None:
    if not USER_NAME_RE.match(name):
        raise status_error(StatusCode.INVALID_ARGUMENT,
                           f"bad user name {name!r}: use 1-32 characters a-z, 0-9, '_' or '-', "
                           "starting with a letter or '_'")
