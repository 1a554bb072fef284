"""What a KV transfer's bytes mean, and the cache viewed as rows of bytes (chapter 17).

Both sides describe their cache by its spec (cache/spec.py); a transfer carries the producer's, and a
consumer whose model caches something else (other layers, heads, head size, dtype) refuses it with
the difference named, rather than decoding from the wrong numbers.
"""

from __future__ import annotations

import torch

from ...cache.spec import KVCacheSpec


def layout_of(specs: list[KVCacheSpec]) -> dict:
    for i, s in enumerate(specs):
        if s.has_scales:  # the two engines' calibrated scales would have to travel (and agree) too
            raise ValueError(f"a KV connector cannot move a quantized cache yet (layer {i} stores {s.dtype} with "
                             "scales); serve disaggregated with kv_cache_dtype='auto'")
    return {"layers": [[s.num_kv_heads, s.head_size, s.has_v] for s in specs],
            "dtype": str(specs[0].dtype).removeprefix("torch.")}


def layout_mismatch(mine: dict, theirs: dict) -> str | None:
    """None if the two layouts agree, else what differs."""
    if mine["dtype"] != theirs.get("dtype"):
        return f"the cache dtype is {theirs.get('dtype')} there, {mine['dtype']} here"
    a, b = mine["layers"], [list(x) for x in theirs.get("layers", [])]
    if len(a) != len(b):
        return f"{len(b)} cache layers there, {len(a)} here"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"layer {i} caches (kv heads, head size, has V) = {tuple(y)} there, {tuple(x)} here"
    return None


def row_view(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, ...] -> [num_blocks * block_size, row_bytes] uint8, a view: one row per
    slot, the token's K (or V) as bytes, whatever the dtype."""
    per_slot = cache[0, 0].numel()
    return cache.view(-1, per_slot).view(torch.uint8)  # [slots, per_slot * itemsize]
