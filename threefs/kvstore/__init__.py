"""A strongly consistent key-value store on threefs: small values in meta's KV, large ones in files.

    from threefs.kvstore import KVStore
    kv = KVStore.create(fs, "/kv/app")
    kv.put(b"k", b"v"); kv.get(b"k"); kv.compare_and_set(b"k", b"v", b"w")

See docs/kvstore.md.
"""

from threefs.kvstore.store import Item, KVStore, WriteBatch

__all__ = ["Item", "KVStore", "WriteBatch"]
