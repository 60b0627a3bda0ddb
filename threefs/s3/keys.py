"""S3 access keys, stored in threefs itself so that every gateway on every host sees them.

One file per key, `R/.s3/keys/ACCESS_KEY_ID` (directory 0700, files 0600, owned by root: only the
cluster token reads them), JSON: the threefs user it acts as (name, uid, gid), when it was made, and
the secret *encrypted*: SigV4 needs the secret itself on the server (an HMAC key), so it cannot be
stored as a one-way hash. The cipher is a one-time pad: SHAKE-256(master || access key || nonce), where
master = HMAC-SHA256(cluster token, "threefs-s3-secrets") and the nonce is 16 random bytes per key.
A copy of the key files without the cluster token reveals no secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import string
import time

from threefs.client import UserCred

# a revoked key stops working on every gateway within this time
KEY_CACHE_S = float(os.environ.get("THREEFS_S3_KEY_CACHE_S", "5.0"))
ACCESS_KEY_ALPHABET = string.ascii_uppercase + string.digits


def master_key(cluster_token: str) -> bytes:
    return hmac.new(cluster_token.encode(), b"threefs-s3-secrets", hashlib.sha256).digest()


def _pad(master: bytes, access_key: str, nonce: bytes, n: int) -> bytes:
    return hashlib.shake_256(master + access_key.encode() + nonce).digest(n)


def new_key_pair() -> tuple[str, str]:
    access = "TFS" + "".join(secrets.choice(ACCESS_KEY_ALPHABET) for _ in range(17))
    return access, secrets.token_urlsafe(30)[:40]


def seal(master: bytes, access_key: str, secret: str, user: str, uid: int, gid: int) -> bytes:
    nonce = secrets.token_bytes(16)
    raw = secret.encode()
    sealed = bytes(a ^ b for a, b in zip(raw, _pad(master, access_key, nonce, len(raw))))
    record = {"access_key": access_key, "user": user, "uid": uid, "gid": gid, "created": int(time.time()),
              "nonce": base64.b64encode(nonce).decode(), "secret": base64.b64encode(sealed).decode()}
    return json.dumps(record).encode()


def unseal(master: bytes, data: bytes) -> tuple[dict, str]:
    record = json.loads(data)
    nonce, sealed = base64.b64decode(record["nonce"]), base64.b64decode(record["secret"])
    secret = bytes(a ^ b for a, b in zip(sealed, _pad(master, record["access_key"], nonce, len(sealed))))
    return record, secret.decode()


class KeyStore:
    """The gateway's view of the keys: read from threefs on first use, cached KEY_CACHE_S."""

    def __init__(self, aio, keys_dir: str, cluster_token: str):
        self.aio, self.dir = aio, keys_dir
        self.master = master_key(cluster_token)
        self._cache: dict[str, tuple[float, tuple[str, UserCred, str] | None]] = {}

    async def lookup(self, access_key: str) -> tuple[str, UserCred, str] | None:
        """(secret, the user's credentials, user name), or None for an unknown key."""
        hit = self._cache.get(access_key)
        if hit is not None and time.monotonic() - hit[0] < KEY_CACHE_S:
            return hit[1]
        value = None
        if access_key and all(c in ACCESS_KEY_ALPHABET for c in access_key) and len(access_key) <= 128:
            try:
                attr = await self.aio.stat(f"{self.dir}/{access_key}")
                buf = bytearray(attr.length)
                await self.aio.read_into(attr, 0, buf)
                record, secret = unseal(self.master, bytes(buf))
                value = (secret, UserCred(record["uid"], record["gid"]), record["user"])
            except FileNotFoundError:
                value = None
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[access_key] = (time.monotonic(), value)
        return value


# -- administration (sync client, the cluster token) ---------------------------------------------
def keys_dir(root: str) -> str:
    return "/" + f"{root.strip('/')}/.s3/keys".lstrip("/")


def add_key(fs, root: str, user: str, uid: int, gid: int) -> tuple[str, str]:
    """Issue a key pair for a threefs user; returns (access key id, secret)."""
    d = keys_dir(root)
    fs.mkdir(d.rsplit("/", 1)[0], mode=0o755, parents=True, exist_ok=True)
    fs.mkdir(d, mode=0o700, exist_ok=True)
    fs.chmod(d, 0o700)
    access, secret = new_key_pair()
    data = seal(master_key(fs.config.token), access, secret, user, uid, gid)
    with fs.open(f"{d}/{access}", "xb") as f:
        f.write(data)
    fs.chmod(f"{d}/{access}", 0o600)
    return access, secret


def list_keys(fs, root: str) -> list[dict]:
    d = keys_dir(root)
    out = []
    try:
        names = fs.listdir(d)
    except FileNotFoundError:
        return out
    for name in sorted(names):
        record = json.loads(fs.read_bytes(f"{d}/{name}"))
        out.append({k: record[k] for k in ("access_key", "user", "uid", "gid", "created")})
    return out


def revoke_key(fs, root: str, access_key: str) -> None:
    fs.remove(f"{keys_dir(root)}/{access_key}")
