"""A quantized KV cache: one byte per cached number (fp8 e4m3 or int8) instead of two, with scales
per layer calibrated on a few prompts: keys one per KV head and channel, values one per KV head
(vLLM's `kv_cache_dtype`, `k_scale`, `v_scale`).

    LLM(kv_cache_dtype="fp8")        # or "fp8_e4m3" (the same), "int8"; "auto": the model's dtype

Decode reads every cached key and value once per step, so half the bytes per token is both twice the
tokens in the same pool (the engine sizes it from the spec's bytes_per_token) and, for long contexts,
up to half the attention time. What it costs is rounding: each cached number is stored as

    q = round(x / s)    (fp8: the nearest e4m3 value, 3 mantissa bits; int8: an integer in -127..127)

and read back as q * s. The scale must fit the largest values it covers: too small and they
saturate, too large (the default 1.0 of an uncalibrated checkpoint is far too large for int8, and
fp8 loses its subnormal end) and small values round to 0. So the scales are **calibrated**: run the
model on a few prompts with a full-precision cache, record the largest |k| and |v| (after RoPE: what
the cache really holds), and set

    s = margin * absmax / qmax          qmax = 448 (fp8 e4m3) or 127 (int8)

with a margin (1.25) for values a little beyond what the prompts showed; anything further out
saturates rather than overflows.

Over what is the absmax taken? Values: per KV head, s_v[h]. Keys: per KV head **and channel**,
s_k[h, d]. Keys have outlier channels (KIVI, Liu et al. 2024; KVQuant, Hooper et al. 2024): a few
channels of a head run several times larger than the rest, whatever the token, so one scale per head
is set by those few and int8 spends most of its 255 levels on values the other channels never reach.
RoPE rotates channel d with channel d + D/2 by a position-dependent angle, moving magnitude between
the two as the position grows; the pair therefore shares one scale (the larger absmax of the two), or
a position past the calibration prompts could saturate the channel that was small there.

A per-channel key scale costs nothing in the attention kernels: a score is a sum over channels,
q . (s * k_q) = (q * s) . k_q, so store_kv writes k / s_k (per channel) and the layer multiplies
the queries by s_k (layers/attention.py: `fold_k_scale`) and hands the kernels a unit K scale. Values
keep one scale per head, the kernels' own, which multiplies the attention output. The scales are fp32 buffers of each attention layer, read by the kernels as tensors, so
CUDA graphs capture them by address. LLM calibrates on text from the model's own tokenizer; an engine
built without one (benchmarks, dummy weights) calibrates on random token ids when it allocates its
cache (`ensure_kv_scales`).
"""

from __future__ import annotations

import random

import torch

from ...cache.spec import cache_layers
from ...kernels.checks import KV_QUANT_DTYPES
from ...kernels.quant_fp8 import FP8_E4M3_MAX, INT8_MAX
from ..attention import AttentionMetadata

KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
QMAX = {torch.float8_e4m3fn: FP8_E4M3_MAX, torch.int8: INT8_MAX}
KV_SCALE_MARGIN = 1.25
CALIBRATION_TEXTS = [  # a handful of prompts of different kinds: prose, dialogue, code, numbers, a list
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books "
    "quickly and cheaply. Within fifty years presses were running in more than two hundred cities.",
    "User: Can you explain why the sky is blue?\nAssistant: Sunlight is made of many colors. Air molecules "
    "scatter short wavelengths, like blue, much more strongly than long ones, so blue light reaches your "
    "eyes from every direction of the sky.",
    "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        if a[i] <= "
    "b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n    "
    "return out + a[i:] + b[j:]\n",
    "Quarterly results: revenue rose 12.4% to $3.82 billion, operating margin was 18.1%, and the company "
    "repurchased 4,500,000 shares at an average price of $71.20. Guidance for 2025: 9-11% growth.",
    "Ingredients: 2 cups flour, 1 teaspoon salt, 3 eggs, 250 ml milk. Steps: 1. Whisk the eggs and milk. "
    "2. Add the flour slowly. 3. Rest the batter for 30 minutes. 4. Cook in a hot pan until golden.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is split, oxygen "
    "is released, and carbon dioxide is fixed into sugars through the Calvin cycle.",
    "Write a short poem about the sea.\nThe sea is grey at morning, silver by noon, and black beneath the "
    "moon; it keeps the shapes of every ship and gives them back too soon.",
    "Paris is the capital of France, Berlin of Germany, Madrid of Spain, Rome of Italy, Lisbon of Portugal, "
    "Vienna of Austria, Warsaw of Poland, Athens of Greece and Dublin of Ireland.",
]


def kv_cache_torch_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """'auto' -> None (the model's dtype); 'fp8'/'fp8_e4m3' -> float8_e4m3fn; 'int8' -> int8."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        allowed = ", ".join(repr(n) for n in KV_CACHE_DTYPES)
        raise ValueError(f"kv_cache_dtype must be one of {allowed}, not {kv_cache_dtype!r}")
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    if dtype == torch.float8_e4m3fn and not hasattr(torch, "float8_e4m3fn"):  # pragma: no cover (torch < 2.1)
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a PyTorch with float8 (2.1 or newer)")
    return dtype


def check_kv_cache_device(dtype: torch.dtype | None, device: torch.device) -> None:
    """fp8 on a GPU needs FP8 conversions in hardware (compute capability >= 8.9: Ada, Hopper); on a
    CPU the PyTorch references store and read it (PyTorch converts fp8 in software)."""
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(f"kv_cache_dtype='fp8' needs a GPU with compute capability >= 8.9 (Ada, Hopper); "
                             f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}: use 'int8'")


def quantized_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The cache-holding layers, each of which must carry k_scale and v_scale to take a quantized cache."""
    layers = cache_layers(model)
    for layer in layers:
        if not (hasattr(layer, "k_scale") and hasattr(layer, "v_scale")):
            raise ValueError(f"{type(layer).__name__} has no k_scale/v_scale: it cannot use a quantized KV cache")
    return layers


def calibration_prompts(tokenizer=None, vocab_size: int | None = None, count: int = 8,
                        length: int = 64) -> list[list[int]]:
    """Token ids of a few prompts: CALIBRATION_TEXTS through the tokenizer, or (none given) `count`
    random sequences of `length` ids with a fixed seed."""
    if tokenizer is not None:
        return [tokenizer.encode(t) for t in CALIBRATION_TEXTS[:count]]
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


@torch.inference_mode()
def calibrate_kv_scales(model: torch.nn.Module, prompts: list[list[int]], dtype: torch.dtype,
                        margin: float = KV_SCALE_MARGIN, per_channel_keys: bool = True) -> dict[str, torch.Tensor]:
    """Run the prompts through the model without a cache (every layer computes in the model's own
    dtype), record each attention layer's absmax of K per KV head and RoPE channel pair and of V per
    KV head, and set the layers' k_scale [Hkv, D], v_scale [Hkv] for `dtype` (fp8 e4m3 or int8).
    per_channel_keys=False: every channel of a head gets the head's absmax (one key scale per head,
    for comparison). Returns {"k_absmax": [L, Hkv, D], "v_absmax": [L, Hkv]}."""
    if dtype not in QMAX:
        raise ValueError(f"KV scales are for a float8_e4m3fn or int8 cache, not {dtype}")
    if not prompts or any(not p for p in prompts):
        raise ValueError("calibrate_kv_scales needs at least one prompt, none of them empty")
    layers = quantized_layers(model)
    amax = {id(layer): [None, None] for layer in layers}

    def record(layer, args):  # forward pre-hook: args = (q, k, v, positions, attn_metadata)
        k, v = args[1].detach().float(), args[2].detach().float()  # [T, Hkv, D], K already rotated
        for i, m in enumerate((k.abs().amax(dim=0), v.abs().amax(dim=(0, 2)))):  # [Hkv, D], [Hkv]
            seen = amax[id(layer)][i]
            amax[id(layer)][i] = m if seen is None else torch.maximum(seen, m)

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    try:
        device = next(model.parameters()).device
        for p in prompts:  # one prompt per pass: the non-cached path needs no block tables
            ids = torch.tensor(p, dtype=torch.long, device=device)  # [T]
            meta = AttentionMetadata.from_seq_lens([len(p)], device)
            model(ids, torch.arange(len(p), device=device), meta)
    finally:
        for h in hooks:
            h.remove()
    qmax = QMAX[dtype]
    for layer in layers:
        k_amax, v_amax = amax[id(layer)]
        k_amax = rope_pair_max(k_amax) if per_channel_keys else k_amax.amax(-1, keepdim=True).expand_as(k_amax)
        amax[id(layer)][0] = k_amax
        # a channel or head whose values were all 0 still gets a usable scale (any, its q is 0)
        layer.k_scale.copy_((k_amax * margin / qmax).clamp_min(1e-8))
        layer.v_scale.copy_((v_amax * margin / qmax).clamp_min(1e-8))
        layer.kv_scale_qmax = qmax
    return {"k_absmax": torch.stack([amax[id(x)][0] for x in layers]),
            "v_absmax": torch.stack([amax[id(x)][1] for x in layers])}


def rope_pair_max(a: torch.Tensor) -> torch.Tensor:
    """a [..., D] -> [..., D] with channels d and d + D/2 (a RoPE pair, "rotate half" layout) both
    set to the larger of the two."""
    half = a.shape[-1] // 2
    m = torch.maximum(a[..., :half], a[..., half:])  # [..., D/2]
    return torch.cat([m, m], dim=-1)


@torch.inference_mode()
def ensure_kv_scales(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Before a cache of `dtype` is used: scales calibrated for it. Calibrated for the other quantized
    dtype: rescaled (s = margin * absmax / qmax, so only qmax changes). Never calibrated: calibrated
    now on random token ids (an engine built without a tokenizer; LLM calibrates on text first)."""
    if dtype not in KV_QUANT_DTYPES:
        return
    layers = quantized_layers(model)
    qmax = QMAX[dtype]
    if all(getattr(layer, "kv_scale_qmax", None) is not None for layer in layers):
        for layer in layers:
            if layer.kv_scale_qmax != qmax:
                layer.k_scale.mul_(layer.kv_scale_qmax / qmax)
                layer.v_scale.mul_(layer.kv_scale_qmax / qmax)
                layer.kv_scale_qmax = qmax
        return
    calibrate_kv_scales(model, calibration_prompts(vocab_size=model.config.vocab_size), dtype)
