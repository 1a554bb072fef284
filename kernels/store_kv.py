"""Writing the new tokens' K and V into the paged KV cache, as one Triton kernel (vLLM's
`reshape_and_cache`).

Every attention layer, every step, first puts the keys and values it just computed where later steps
will read them:

    k, v:             [T, Hkv, D]                              the T new tokens of the batch
    k_cache, v_cache: [num_blocks, block_size, Hkv, D]         one pair per layer
    slot_mapping:     [T]   token t goes to flat row slot = block * block_size + offset

Viewed flat, a cache is [num_blocks * block_size, Hkv, D] and the write is a scatter of whole rows:
`flat_k[slot_mapping[t]] = k[t]`. PyTorch does it with two `index_copy_` launches (K, then V). The
kernel gives each token to one program, which reads its slot once and copies the token's Hkv x D keys
and values (one tile each, BLOCK_D = next_power_of_2(D) with the tail masked off, so D = 80 works) to
that row of both caches: one launch, each number read once and written once, which is all a copy can
do. There is no arithmetic, so the cache holds exactly k's and v's bits.

Three details the engine relies on:
- Padding. A slot < 0 (vLLM's PAD_SLOT_ID = -1) writes nothing: the engine pads a decode batch up to
  the size of a captured CUDA graph, and the padding tokens must not overwrite anyone's cache rows.
  The kernel decides that on the GPU (a mask), so it never reads a slot back to the host: no `.item()`,
  no sync, nothing whose size depends on the data, hence capturable in a CUDA graph.
- Strides. k and v are views of the fused qkv projection's output [T, (Hq + 2 Hkv) * D]: token t's
  heads sit (Hq + 2 Hkv) * D numbers after token t-1's. The kernel takes the strides instead of a
  `.contiguous()` copy. Only each head's D numbers must be contiguous.
- int64 offsets. A cache row is slot * Hkv * D numbers in; a big cache (millions of slots x 1024) is
  past 2^31, so the row offset is computed in int64.
A slot past the end of the cache is the caller's bug; the kernel drops such a row rather than write
outside the cache (the reference raises an IndexError instead).

A quantized cache (chapter 08: `kv_cache_dtype="fp8"` or `"int8"`) stores each number in one byte.
The write is then where it is quantized, once, with the layer's scales (fp32, calibrated from a few
prompts: layers/quantization/kv_cache.py): one per KV head ([Hkv]), or for keys one per KV head and
channel ([Hkv, D]: keys have outlier channels):

    fp8:   k_cache[slot, h, d] = fp8_e4m3(k[t, h, d] / k_scale[h(, d)])            saturating at +-448
    int8:  k_cache[slot, h, d] = round(k[t, h, d] / k_scale[h(, d)]) in -127..127   ties to even

The attention kernels read the bytes back and multiply by a per-head scale (flash_attn.py); a
per-channel key scale is folded into the query instead (layers/attention.py). The rounding is done
in fp32 before the cast, identically in the kernel and the reference (`quant_fp8.round_fp8_e4m3`,
`round_int8`), so both store the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import (
    COPY_DTYPES,
    FLOAT_DTYPES,
    check_device,
    check_float_tensor,
    check_fp8_device,
    check_kv_scales,
    check_last_dim,
    check_tensor,
)
from .quant_fp8 import quantize_fp8_ref, quantize_int8_ref, round_fp8_e4m3, round_int8


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, Hkv, D]: token stride stride_kt, head stride stride_kh, D contiguous
    v_ptr,  # [T, Hkv, D]: token stride stride_vt, head stride stride_vh
    k_cache_ptr,  # [num_slots, Hkv, D] contiguous: the cache seen flat over its blocks
    v_cache_ptr,  # [num_slots, Hkv, D] contiguous
    slot_ptr,  # [T] int32 or int64
    k_scale_ptr,  # [Hkv] or [Hkv, D] (K_PER_CHANNEL) fp32 (a quantized cache; unused otherwise)
    v_scale_ptr,  # [Hkv] fp32
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_slots,  # num_blocks * block_size
    Hkv,
    D,
    BLOCK_H: tl.constexpr,  # next_power_of_2(Hkv)
    BLOCK_D: tl.constexpr,  # next_power_of_2(D)
    QUANT: tl.constexpr,  # 0: copy; 1: fp8 e4m3; 2: int8 (with the scales)
    K_PER_CHANNEL: tl.constexpr,  # k_scale is [Hkv, D] (one per channel) instead of [Hkv]
):
    t = tl.program_id(0).to(tl.int64)  # int64: T * stride_kt can pass 2^31 in a long prefill
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64 whatever the index dtype: slot * Hkv * D below
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    # A padding token (slot < 0) copies zero heads: every lane is masked off, so it loads and stores
    # nothing. (Folded into the head count rather than and-ed in as a scalar: Triton 3.9's interpreter
    # turns `tensor_mask & scalar_bool` into int32 and then refuses it as a mask.)
    n_heads = tl.where((slot >= 0) & (slot < num_slots), Hkv, 0)
    mask = (heads < n_heads) & (d < D)  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + d, mask=mask)
    if QUANT != 0:  # quantize: divide by the head's scale, round in fp32, then an exact cast
        if K_PER_CHANNEL:
            k_scale = tl.load(k_scale_ptr + heads * D + d, mask=(heads < Hkv) & (d < D),
                              other=1.0)  # [BLOCK_H, BLOCK_D]
        else:
            k_scale = tl.load(k_scale_ptr + heads, mask=heads < Hkv, other=1.0)  # [BLOCK_H, 1]
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < Hkv, other=1.0)
        k = tl.math.div_rn(k.to(tl.float32), k_scale)  # IEEE division: PyTorch's quotient, bit for bit
        v = tl.math.div_rn(v.to(tl.float32), v_scale)
        if QUANT == 1:
            k, v = round_fp8_e4m3(k), round_fp8_e4m3(v)
        else:
            k, v = round_int8(k), round_int8(v)
        k, v = k.to(k_cache_ptr.dtype.element_ty), v.to(v_cache_ptr.dtype.element_ty)
    row = slot * Hkv * D  # int64: where this token's [Hkv, D] starts in the flat cache
    tl.store(k_cache_ptr + row + heads * D + d, k, mask=mask)  # the cache is contiguous: head stride D
    tl.store(v_cache_ptr + row + heads * D + d, v, mask=mask)


def _check(k, v, k_cache, v_cache, slot_mapping, strict: bool, k_scale=None, v_scale=None) -> bool:
    """k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot_mapping [T] int32/int64; one
    dtype and device. `strict`: the kernel's extra needs (COPY_DTYPES, any float Triton can load, as
    this is a pure copy: fp8 caches would need a scale; contiguous caches and head rows; CUDA or the
    interpreter). bfloat16 is fine under the interpreter here, unlike for the attention kernels
    (kernels/checks.py): their trouble is bf16 tl.dot and fp32 -> bf16 rounding, and a copy does
    neither. The test copies all 65536 bf16 bit patterns through the interpreter bit for bit.
    A quantized cache (fp8 e4m3, int8) takes k, v in fp16/bf16/fp32 and k_scale, v_scale. True then."""
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        check_tensor(name, t)
    quantized = check_kv_scales(k_cache, v_cache, _per_head(k_scale, k_cache), v_scale)
    for name, t in (("k", k), ("v", v)) + (() if quantized else (("k_cache", k_cache), ("v_cache", v_cache))):
        check_float_tensor(name, t, (FLOAT_DTYPES if quantized else COPY_DTYPES) if strict else None,
                           contiguous=False)
        if t.dtype != k.dtype:
            raise TypeError(f"k, v and the caches must share a dtype, got k {k.dtype} and {name} {t.dtype}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k.device}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.device != k.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but k is on {k.device}")
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be 3-D [T, num_kv_heads, head_dim], got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, {k.shape[1]}, "
                         f"{k.shape[2]}] to match k, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"slot_mapping must have shape [T] = ({k.shape[0]},), got {tuple(slot_mapping.shape)}")
    if not strict:
        return quantized
    for name, t in (("k", k), ("v", v)):
        check_last_dim(name, t)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    check_device("k", k)
    check_fp8_device(k_cache)
    return quantized


def _per_head(k_scale, k_cache: torch.Tensor):
    """A per-channel k_scale [Hkv, D] checked for its D here, and its first column handed to the
    per-head checks (dtype, device, Hkv: kernels/checks.py); anything else is handed on as it is."""
    if not isinstance(k_scale, torch.Tensor) or k_scale.dim() != 2:
        return k_scale
    if k_cache.dim() == 4 and k_scale.shape != k_cache.shape[2:]:
        raise ValueError(f"a per-channel k_scale must have shape [num_kv_heads, head_dim] = "
                         f"{tuple(k_cache.shape[2:])}, got {tuple(k_scale.shape)}")
    if not k_scale.is_contiguous():  # the kernel addresses it as head * D + channel
        raise ValueError(f"a per-channel k_scale must be contiguous, got strides {k_scale.stride()}")
    return k_scale[:, 0]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write k[t], v[t] ([T, Hkv, D]) into flat row slot_mapping[t] of k_cache, v_cache
    ([num_blocks, block_size, Hkv, D]), in place; a slot < 0 writes nothing. One launch, no host sync.
    An fp8/int8 cache quantizes with k_scale (fp32 [Hkv] or [Hkv, D]) and v_scale (fp32 [Hkv])."""
    quantized = _check(k, v, k_cache, v_cache, slot_mapping, True, k_scale, v_scale)
    T, Hkv, D = k.shape
    if T == 0 or k_cache.numel() == 0:
        return
    BLOCK_H, BLOCK_D = triton.next_power_of_2(Hkv), triton.next_power_of_2(D)
    # A copy wants wide loads, not many threads: about 8 numbers per thread, at most 8 warps.
    num_warps = min(max(BLOCK_H * BLOCK_D // 256, 1), 8)
    _store_kv_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.shape[0] * k_cache.shape[1],
        Hkv,
        D,
        BLOCK_H=BLOCK_H,
        BLOCK_D=BLOCK_D,
        QUANT=0 if not quantized else 1 if k_cache.dtype == torch.float8_e4m3fn else 2,
        K_PER_CHANNEL=quantized and k_scale.dim() == 2,
        num_warps=num_warps,
    )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """The plain-PyTorch write the kernel is tested against: same arguments, same effect.

    The boolean mask below sizes a tensor by the data (a host sync), so unlike the kernel this is
    not CUDA-graph capturable when the batch has padding."""
    quantized = _check(k, v, k_cache, v_cache, slot_mapping, False, k_scale, v_scale)
    slots = slot_mapping.long()  # index_copy_ wants int64
    keep = slots >= 0  # padding rows (PAD_SLOT_ID = -1) are dropped
    for new, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = new[keep]  # [T_kept, Hkv, D]
        if quantized:
            rows = quantize_kv_ref(rows, scale, cache.dtype)
        flat = byte_view(cache).view(-1, *cache.shape[2:])  # [num_blocks * block_size, Hkv, D], no copy
        flat.index_copy_(0, slots[keep], byte_view(rows))


def quantize_kv_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hkv, D] -> dtype (fp8 e4m3 or int8) with one scale per head (scale [Hkv]) or per head
    and channel (scale [Hkv, D])."""
    s = _broadcast(scale)
    return quantize_fp8_ref(x, s) if dtype == torch.float8_e4m3fn else quantize_int8_ref(x, s)


def dequantize_kv_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., Hkv, D] fp8/int8 -> fp32 q * scale[h] (or scale[h, d]): the cached numbers' values."""
    return q.float() * _broadcast(scale)


def _broadcast(scale: torch.Tensor) -> torch.Tensor:
    """[Hkv] -> [Hkv, 1] (broadcast over D); [Hkv, D] as it is. fp32 either way."""
    return scale.float()[:, None] if scale.dim() == 1 else scale.float()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """fp8 as uint8, the same bytes: PyTorch's CPU index_copy_ has no fp8 kernel (a copy needs none)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
