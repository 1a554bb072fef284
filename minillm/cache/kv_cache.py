"""The KV cache, its simplest form: one contiguous region per sequence, reserved for its longest life.

Without a cache, step t of generation runs the model over all P + t tokens again, although the keys
and values of the first P + t - 1 tokens are exactly what the last step computed (a token's K and V
depend only on the tokens before it). Keeping them turns each step into one token's work:

    prefill: run the P prompt tokens, write their K, V into the cache, predict token P+1
    decode:  run one token, append its K, V, attend over the P+t cached keys, predict the next

Layout, per layer, for K and for V (vLLM's cache shape with a block as long as the whole sequence):

    k_cache[layer]: [num_slots, max_len, num_kv_heads, head_dim]

A sequence owns one slot. Token at position p of the sequence in slot s is row (s, p), i.e. flat
"slot" s * max_len + p: the `slot_mapping` an attention layer writes to. Readers find a sequence's
keys through a one-column `block_table` holding s. Chapter 05 keeps all three names and shrinks the
block from max_len to 16 tokens, which is what stops this design from wasting memory: a slot here is
reserved for max_len tokens however short the sequence turns out to be.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..kernels import store_kv as store_kv_kernels  # kernels/store_kv.py: the kernel and its reference
from ..kv_memory import kv_bytes_per_token


class CacheSizes:
    """Chapter 00's formula, now as real allocations (for any cache with k_caches/v_caches lists)."""

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return int(kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, itemsize))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)


class KVCache(CacheSizes):
    """Contiguous per-sequence K/V storage for every layer of one model."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("num_slots", num_slots), ("max_len", max_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCache {name} must be a positive int, not {value!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_slots, self.max_len, self.dtype = num_slots, max_len, dtype
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        # torch.empty: the memory is reserved now; what is in it does not matter until written.
        self.k_caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @classmethod
    def for_model(cls, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype,
                  device: torch.device | str) -> KVCache:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, num_slots, max_len, dtype, device)

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

    # ---- wiring into a model ---------------------------------------------------------------------

    def bind(self, model: torch.nn.Module) -> None:
        """Give each attention layer its (k_cache, v_cache) pair, in layer order."""
        bind_caches(model, self.k_caches, self.v_caches)

    def unbind(self, model: torch.nn.Module) -> None:
        unbind_caches(model, self.k_caches)


def attention_layers(model: torch.nn.Module) -> list:
    from ..layers import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_caches(model: torch.nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
    layers = attention_layers(model)
    if len(layers) != len(k_caches):
        raise ValueError(f"the model has {len(layers)} attention layers, the cache {len(k_caches)}")
    for layer, k, v in zip(layers, k_caches, v_caches):
        layer.kv_cache = (k, v)


def unbind_caches(model: torch.nn.Module, k_caches: list[torch.Tensor]) -> None:
    """Detach these caches from the model (and only these: another cache may be bound by now)."""
    for layer in attention_layers(model):
        if layer.kv_cache is not None and any(layer.kv_cache[0] is k for k in k_caches):
            layer.kv_cache = None


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' K and V into their cache rows (vLLM: reshape_and_cache).

    k, v: [T, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [T] flat row of each token (block * block_size + offset), int64 or int32. A slot < 0
    (vLLM's PAD_SLOT_ID = -1, a padding token of a CUDA-graph batch) writes nothing.

    On a GPU this is one Triton launch (`minillm.kernels.store_kv`, CUDA-graph capturable); elsewhere,
    or with MINILLM_KERNELS=torch, its PyTorch reference: index_copy_ into the caches viewed flat.
    """
    # Imported here: minillm.layers imports this module (attention calls store_kv), so a module-level
    # import of minillm.layers.backend would be circular.
    from ..layers.backend import use_triton

    store = store_kv_kernels.store_kv if use_triton(k) else store_kv_kernels.store_kv_ref
    store(k, v, k_cache, v_cache, slot_mapping)
