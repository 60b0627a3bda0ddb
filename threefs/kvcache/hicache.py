"""SGLang HiCache storage backend on threefs (`HiCacheStorage`'s shape), loadable as SGLang's dynamic backend:

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "threefs",
            "module_path": "threefs.kvcache.hicache", "class_name": "HiCacheThreeFS",
            "threefs_config": "/etc/threefs/client.toml", "root": "/kvcache/qwen3",
            "capacity_bytes": 1099511627776}'

SGLang builds it as `HiCacheThreeFS(storage_config, kwargs)`. Keys are SGLang's page hashes (hex SHA-256
chains, `get_hash_str`); they are stored as the 32 digest bytes plus `|model/tpRofS` (MLA models: one copy
for all ranks, written by rank 0, as SGLang's hf3fs backend does). Pages are flat tensors of the host pool's
page; `batch_get_v1`/`batch_set_v1` read straight into / write straight from the host pool's pages when its
layout is page-first (zero copy), and through a flat page buffer otherwise.

When sglang is importable the class derives from its `HiCacheStorage` (the dynamic loader checks that);
otherwise from `object`, with the same methods.
"""

from __future__ import annotations

import logging
from typing import Any

from threefs.kvcache.client import KVCache

log = logging.getLogger("threefs.kvcache.hicache")

try:  # the real base class, when SGLang is installed
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except Exception:  # not installed here (it needs CUDA-era dependencies): same interface, no base class
    _Base = object

CAPACITY_BYTES_DEFAULT = 64 << 30


def _key_bytes(key: str, suffix: bytes) -> bytes:
    try:
        raw = bytes.fromhex(key)
    except (ValueError, TypeError):
        raw = str(key).encode()
    return raw + suffix


class HiCacheThreeFS(_Base):
    """HiCacheStorage on a threefs KVCache (see the module doc)."""

    def __init__(self, storage_config=None, kwargs: Any = None, *, fs=None, root: str | None = None,
                 page_bytes: int | None = None, capacity_bytes: int | None = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.config = storage_config
        self.tp_rank = getattr(storage_config, "tp_rank", 0)
        self.tp_size = getattr(storage_config, "tp_size", 1)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        model = getattr(storage_config, "model_name", None) or extra.get("model", "model")
        tag = f"{model}/mla" if self.is_mla else f"{model}/tp{self.tp_rank}of{self.tp_size}"
        self.suffix = b"|" + tag.encode()
        self.skip_writes = self.is_mla and self.tp_rank != 0  # MLA: one copy, written by rank 0
        if fs is None:
            import threefs

            fs = threefs.connect(extra.get("threefs_config"))
            self._own_fs = fs
        else:
            self._own_fs = None
        self.fs = fs
        self.root = root or extra.get("root", "/kvcache/sglang")
        self.page_bytes = page_bytes or extra.get("page_bytes")
        self.capacity_bytes = capacity_bytes or extra.get("capacity_bytes", CAPACITY_BYTES_DEFAULT)
        self.ttl_s = float(extra.get("ttl_s", 0.0))
        self.mem_pool_host = None
        self._kv: KVCache | None = None

    # -- set-up ----------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        self.mem_pool_host = mem_pool_host
        if not self.page_bytes and hasattr(mem_pool_host, "get_data_page"):
            page = mem_pool_host.get_dummy_flat_data_page()
            self.page_bytes = page.numel() * page.element_size()

    @property
    def kv(self) -> KVCache:
        if self._kv is None:
            if not self.page_bytes:
                raise ValueError("HiCacheThreeFS needs page_bytes (extra_config) or a registered host pool")
            self._kv = KVCache(self.fs, self.root, page_bytes=int(self.page_bytes),
                               capacity_bytes=int(self.capacity_bytes), ttl_s=self.ttl_s)
        return self._kv

    def _keys(self, keys) -> list[bytes]:
        return [_key_bytes(k, self.suffix) for k in keys]

    # -- HiCacheStorage --------------------------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        import torch

        if target_locations is None:
            target_locations = [torch.empty(int(self.page_bytes), dtype=torch.uint8) for _ in keys]
        got = self.kv.batch_get_into(self._keys(keys), list(target_locations))
        out = []
        for n, t in zip(got, target_locations):
            if n < 0:
                out.append(None)
            elif n == t.numel() * t.element_size():
                out.append(t)
            else:  # a shorter page: the bytes read, as uint8
                out.append(t.view(-1).view(torch.uint8)[:n])
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if self.skip_writes:
            return True
        pages = values if values is not None else target_locations
        return all(self.kv.batch_put(self._keys(keys), [v.contiguous() for v in pages]))

    def exists(self, key: str) -> bool:
        return self.kv.batch_exists(self._keys([key])) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self.kv.batch_exists(self._keys(keys))

    def delete(self, key: str) -> None:
        self.kv.delete(self._keys([key]))

    def clear(self) -> None:
        self.kv.clear()

    def get_stats(self):
        return self.kv.stats()

    # -- zero-copy paths (host pool pages) -------------------------------------------------------
    def _pages(self, host_indices) -> list:
        pool = self.mem_pool_host
        step = pool.page_size
        return [int(host_indices[i]) for i in range(0, len(host_indices), step)]

    def batch_get_v1(self, keys: list[str], host_indices, extra_info: Any = None) -> list[bool]:
        pool = self.mem_pool_host
        starts = self._pages(host_indices)[:len(keys)]
        if getattr(pool, "layout", "") in ("page_first", "page_first_direct"):
            targets = [pool.get_data_page(s, flat=True) for s in starts]  # views of the pool: read in place
            return [n >= 0 for n in self.kv.batch_get_into(self._keys(keys), targets)]
        targets = [pool.get_dummy_flat_data_page() for _ in starts]
        got = self.kv.batch_get_into(self._keys(keys), targets)
        for s, n, t in zip(starts, got, targets):
            if n >= 0:
                pool.set_from_flat_data_page(s, t)
        return [n >= 0 for n in got]

    def batch_set_v1(self, keys: list[str], host_indices, extra_info: Any = None) -> list[bool]:
        if self.skip_writes:
            return [True] * len(keys)
        pool = self.mem_pool_host
        pages = [pool.get_data_page(s, flat=True) for s in self._pages(host_indices)[:len(keys)]]
        return self.kv.batch_put(self._keys(keys), [p.contiguous() for p in pages])

    def close(self) -> None:
        if self._kv is not None:
            self._kv.close()
        if self._own_fs is not None:
            self._own_fs.close()
