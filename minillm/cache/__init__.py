"""The KV cache: where each sequence's keys and values live between steps: contiguous (chapter 03),
then paged (chapter 05), both shaped by the model's per-layer spec (spec.py)."""

from .kv_cache import KVCache
from .paged import PagedKVCache
from .spec import KVCacheSpec, bytes_per_token, cache_layers, kv_cache_spec

__all__ = ["KVCache", "KVCacheSpec", "PagedKVCache", "bytes_per_token", "cache_layers", "kv_cache_spec"]
