"""The KV cache, its simplest form: one contiguous region per sequence, reserved for its longest life.

Without a cache, step t of generation runs the model over all P + t tokens again, although the keys
and values of the first P + t - 1 tokens are exactly what the last step computed (a token's K and V
depend only on the tokens before it). Keeping them turns each step into one token's work:

    prefill: run the P prompt tokens, write their K, V into the cache, predict token P+1
    decode:  run one token, append its K, V, attend over the P+t cached keys, predict the next

Layout, per layer, for K and for V (vLLM's cache shape with a block as long as the whole sequence;
the heads and sizes are what the model's layers state, `cache/spec.py`):

    k_cache[layer]: [num_slots, max_len, num_kv_heads, head_dim]

A sequence owns one slot. Token at position p of the sequence in slot s is row (s, p), i.e. flat
"slot" s * max_len + p: the `slot_mapping` an attention layer writes to. Readers find a sequence's
keys through a one-column `block_table` holding s. Chapter 05 keeps all three names and shrinks the
block from max_len to 16 tokens, which is what stops this design from wasting memory: a slot here is
reserved for max_len tokens however short the sequence turns out to be.
"""

from __future__ import annotations

import torch

from ..checks import check_int
from .spec import KVCacheSpec, bind_caches, bytes_per_token, kv_cache_spec, unbind_caches


class CacheSizes:
    """Chapter 00's formula, now as real allocations (for any cache with specs and k/v_caches lists)."""

    specs: list[KVCacheSpec]

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element, as the spec has it per layer."""
        return bytes_per_token(self.specs)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches if t is not None)

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    def bind(self, model: torch.nn.Module) -> None:
        """Give each attention layer its (k_cache, v_cache) pair, in layer order."""
        bind_caches(model, self.k_caches, self.v_caches)

    def unbind(self, model: torch.nn.Module) -> None:
        unbind_caches(model, self.k_caches)


def allocate(specs: list[KVCacheSpec], rows: tuple[int, int], device, pin_memory: bool = False):
    """K (and V) tensors of [rows[0], rows[1], heads, head_size] per layer, zeroed; V None where the
    layer has no separate V."""
    def one(s: KVCacheSpec) -> torch.Tensor:
        return torch.zeros((*rows, s.num_kv_heads, s.head_size), dtype=s.dtype, device=device, pin_memory=pin_memory)

    return [one(s) for s in specs], [one(s) if s.has_v else None for s in specs]


class KVCache(CacheSizes):
    """Contiguous per-sequence K/V storage for every layer of one model."""

    def __init__(self, specs: list[KVCacheSpec], num_slots: int, max_len: int, device: torch.device | str):
        check_int("num_slots", num_slots, prefix="KVCache ")
        check_int("max_len", max_len, prefix="KVCache ")
        if not specs:
            raise ValueError("KVCache needs the spec of at least one layer")
        self.specs, self.num_slots, self.max_len = list(specs), num_slots, max_len
        self.k_caches, self.v_caches = allocate(self.specs, (num_slots, max_len), device)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @classmethod
    def for_model(cls, model, num_slots: int, max_len: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """model: a built model, or its ModelConfig (then pass dtype and device)."""
        if device is None:
            device = next(model.parameters()).device
        return cls(kv_cache_spec(model, dtype), num_slots, max_len, device)

    # ---- slots -----------------------------------------------------------------------------------

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"the KV cache has no free slot (all {self.num_slots} are in use)")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not an allocated slot of this cache")
        self._free.append(slot)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def slot_mapping(self, slot: int, start: int, end: int) -> list[int]:
        """Flat cache rows of positions [start, end) of the sequence in `slot`."""
        if not 0 <= start <= end <= self.max_len:
            raise ValueError(f"positions [{start}, {end}) do not fit a cache of max_len {self.max_len}")
        base = slot * self.max_len
        return list(range(base + start, base + end))
