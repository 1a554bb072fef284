"""The KV cache: where each sequence's keys and values live between steps: contiguous (chapter 03),
then paged (chapter 05)."""

from .kv_cache import KVCache, attention_layers, store_kv
from .paged import PagedKVCache

__all__ = ["KVCache", "PagedKVCache", "attention_layers", "store_kv"]
