"""LLM inference's context (KV) cache on threefs: see docs/kvcache.md."""

from threefs.kvcache.client import KVCache
from threefs.kvcache.keys import namespace_tag, page_digests, page_keys

__all__ = ["KVCache", "page_keys", "page_digests", "namespace_tag"]
