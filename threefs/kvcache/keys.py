"""Page keys: prefix-chained SHA-256 over pages of tokens, as SGLang's HiCache computes them.

    page_keys([1, 2, 3, ...], page_tokens=64, namespace="llama-8b/tp0of1")

Page i's digest is SHA-256(digest of page i-1 || each token of page i as u32 little-endian): a page's key names
its whole prefix, so a lookup of a prompt's keys in order finds the longest cached prefix. Only full pages get
keys (a partial last page is not cached). The namespace (model, tensor-parallel rank and size, tenant) is
appended to every key, so caches shared by several models never confuse their pages; the digests themselves
are SGLang's `get_hash_str` (hex) byte for byte.
"""

from __future__ import annotations

import hashlib
import struct

from threefs.common.status import StatusCode, status_error

NAMESPACE_BYTES_MAX = 256


def namespace_tag(model: str = "", tp_rank: int = 0, tp_size: int = 1, tenant: str = "") -> str:
    """The usual namespace: `model/tp{rank}of{size}` (and `@tenant`)."""
    tag = f"{model}/tp{tp_rank}of{tp_size}"
    return f"{tag}@{tenant}" if tenant else tag


def page_digests(token_ids, page_tokens: int = 64, prior: bytes | None = None) -> list[bytes]:
    """The chained 32-byte SHA-256 digest of each full page."""
    if not isinstance(page_tokens, int) or page_tokens <= 0:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"page_tokens {page_tokens!r} must be a positive int")
    tokens = list(token_ids)
    out: list[bytes] = []
    prev = prior
    for start in range(0, len(tokens) - page_tokens + 1, page_tokens):
        h = hashlib.sha256()
        if prev:
            h.update(prev)
        try:
            h.update(struct.pack(f"<{page_tokens}I", *tokens[start:start + page_tokens]))
        except struct.error:
            raise status_error(StatusCode.INVALID_ARGUMENT, "token ids must be ints in 0..2**32-1") from None
        prev = h.digest()
        out.append(prev)
    return out


def page_keys(token_ids, page_tokens: int = 64, namespace: str | bytes = "", prior: bytes | None = None) -> list[bytes]:
    """Keys of the full pages of `token_ids`: chained digest + b"|" + namespace."""
    ns = namespace.encode() if isinstance(namespace, str) else bytes(namespace)
    if len(ns) > NAMESPACE_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"namespace of {len(ns)} bytes exceeds {NAMESPACE_BYTES_MAX}")
    suffix = b"|" + ns if ns else b""
    return [d + suffix for d in page_digests(token_ids, page_tokens, prior)]
