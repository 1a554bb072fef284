"""What a model's KV cache holds, layer by layer: the spec every cache is allocated and sized from.

A Llama layer caches, per token, one key and one value vector per KV head. Other layouts exist:
DeepSeek's latent attention (MLA, chapter 10) caches one latent vector per token and no separate V;
a quantized cache (chapter 08) stores fp8 or int8 with scales to read them back. The model says
which, per layer: each layer that holds a cache has a `kv_cache_spec(dtype)` method, and a
`kv_cache` attribute the cache binds its tensors to. This module never imports the layers: it finds
them by those two names (duck typing), so the storage below knows nothing of the code above it.

    spec = kv_cache_spec(model, torch.bfloat16)   # [KVCacheSpec(num_kv_heads=3, head_size=64, ...)] x 30
    bytes_per_token(spec)                         # 2 x 30 x 3 x 64 x 2 = 23,040 B for SmolLM2
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's cache, per token: num_kv_heads vectors of head_size for K (and as many for V)."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    has_v: bool = True  # False: a single tensor per token (MLA's latent), read as both K and V
    has_scales: bool = False  # per-head scales that dequantize a quantized cache (fp8, int8)

    def __post_init__(self):
        check_int("num_kv_heads", self.num_kv_heads, prefix="KVCacheSpec ")
        check_int("head_size", self.head_size, prefix="KVCacheSpec ")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"KVCacheSpec dtype must be a torch.dtype, not {self.dtype!r}")

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return (2 if self.has_v else 1) * self.num_kv_heads * self.head_size * itemsize


def cache_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers that hold a cache, in model order (anything with a `kv_cache` attribute)."""
    return [m for m in model.modules() if hasattr(m, "kv_cache")]


def model_dtype(model) -> torch.dtype:
    """The dtype a model computes in, which its KV cache defaults to: what the loader built it in
    (`model.dtype`), else its first floating-point parameter's. Not simply its first parameter's: a
    quantized layer's first parameter holds packed integers (chapter 08)."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def kv_cache_spec(source, dtype: torch.dtype | None = None) -> list[KVCacheSpec]:
    """Per cache-holding layer, what it stores: from a built model, or from a ModelConfig (the model is
    built on the "meta" device, which allocates nothing). dtype: the cache's (default: the model's)."""
    if not isinstance(source, torch.nn.Module):  # a ModelConfig
        from ..models.registry import get_model_class

        with torch.device("meta"):
            source = get_model_class(source.architecture)(source)
        dtype = dtype or torch.get_default_dtype()
    if hasattr(source, "kv_cache_spec"):  # a model may state its whole spec itself
        return list(source.kv_cache_spec(dtype))
    dtype = dtype or model_dtype(source)
    specs = [layer.kv_cache_spec(dtype) for layer in cache_layers(source)]
    if not specs:
        raise ValueError(f"{type(source).__name__} has no layer that holds a KV cache")
    return specs


def bytes_per_token(specs: list[KVCacheSpec]) -> int:
    """Chapter 00's formula, summed over the layers as they really are."""
    return sum(s.bytes_per_token for s in specs)


def bind_caches(model: torch.nn.Module, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor | None]) -> None:
    """Give each cache-holding layer its (k_cache, v_cache) pair, in layer order (v None: no separate V)."""
    layers = cache_layers(model)
    if len(layers) != len(k_caches):
        raise ValueError(f"the model has {len(layers)} attention layers, the cache {len(k_caches)}")
    for layer, k, v in zip(layers, k_caches, v_caches):
        layer.kv_cache = (k, v)


def unbind_caches(model: torch.nn.Module, k_caches: list[torch.Tensor]) -> None:
    """Detach these caches from the model (and only these: another cache may be bound by now)."""
    for layer in cache_layers(model):
        if layer.kv_cache is not None and any(layer.kv_cache[0] is k for k in k_caches):
            layer.kv_cache = None
