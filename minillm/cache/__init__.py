"""The KV cache: where each sequence's keys and values live between steps (chapter 03)."""

from .kv_cache import KVCache, attention_layers, store_kv

__all__ = ["KVCache", "attention_layers", "store_kv"]
