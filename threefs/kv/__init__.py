"""Transactional ordered KV with FoundationDB's semantics; the only shared state of mgmtd and meta.

    engine = await open_engine("sqlite:///var/lib/threefs/kv.db")   # or "memory://"
    async def rename(tr):
        value = await tr.get(b"a")
        tr.clear(b"a")
        tr.set(b"b", value)
    await engine.run(rename)   # retried on conflict with a fresh transaction

See `threefs.kv.api` for the semantics every engine provides.
"""

from threefs.kv.api import (
    KEY_BYTES_MAX,
    MVCC_WINDOW_S,
    TXN_BYTES_MAX,
    VALUE_BYTES_MAX,
    KVEngine,
    Transaction,
    open_engine,
    register_engine,
)

__all__ = [
    "KEY_BYTES_MAX",
    "MVCC_WINDOW_S",
    "TXN_BYTES_MAX",
    "VALUE_BYTES_MAX",
    "KVEngine",
    "Transaction",
    "open_engine",
    "register_engine",
]
