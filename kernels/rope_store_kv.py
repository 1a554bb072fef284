"""RoPE on q and k, and the paged KV-cache write, as one Triton kernel (with Qwen3's QK-norm).

A decode layer used to run, between its QKV projection and its attention kernel,

    q, k = q_norm(q), k_norm(k)           # Qwen3 only: RMSNorm over each head's D numbers (2 kernels)
    q, k = rotary(q, k, cos, sin)         # rotary.py: q and k rotated in place (1 kernel)
    store_kv(k, v, caches, slot_mapping)  # store_kv.py: k and v copied to their cache rows (1 kernel)

three or four launches, each reading a few kilobytes that the previous one just wrote. At batch 1 a
launch costs more than its work, so here they are one: program t takes token t, loads its cos and
sin once, and for each head

    q head:  norm (if any) -> rotate -> round -> (x the keys' per-channel scale) -> written over q
    k head:  norm (if any) -> rotate -> round -> (quantize)                      -> k_cache[slot]
    v head:                                      (quantize)                      -> v_cache[slot]

k itself is left as it was: only the cache is read after this (flash_decode, flash_attn over the
cache). A padding token (slot < 0, vLLM's PAD_SLOT_ID) gets its q rotated, never read, and writes no
cache row.

Roundings follow the unfused kernels, so the cache holds what the pair would have stored:
- the norm rounds where RMSNorm's reference does: x * rsqrt(mean(x^2) + eps) to the dtype, then the
  weight's multiply once more (rms_norm.py);
- the rotation is done in fp32 and rounded once (rotary.py; the PyTorch reference rounds after each
  multiply and the add, an ulp of the inputs away);
- a quantized cache (fp8 e4m3 / int8, chapter 08) divides the rounded k by its scale with IEEE
  division and rounds in fp32 (store_kv.py's `round_fp8_e4m3` / `round_int8`): the same bytes;
- with per-channel key scales [Hkv, D] the query carries them (layers/attention.py's fold_k_scale):
  the rounded q times k_scale[kv_head(h)], in fp32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .checks import check_float_tensor
from .quant_fp8 import round_fp8_e4m3, round_int8
from .rms_norm import rms_norm_ref
from .rotary import _as_table, apply_rotary_ref
from .store_kv import _check as _check_store
from .store_kv import store_kv_ref


@triton.jit
def _norm_rotate(a, b, w_ptr, cos_a, cos_b, sin_a, sin_b, d, D, eps, HAS_NORM: tl.constexpr):
    """One token's heads, a/b: their two halves [BLOCK_H, BLOCK_HALF] in the model's dtype ->
    the rotated halves in fp32 (not yet rounded), normalized first if HAS_NORM."""
    if HAS_NORM:  # RMSNorm over each head's D numbers (both halves); padding lanes are 0
        af, bf = a.to(tl.float32), b.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(af * af, axis=1) + tl.sum(bf * bf, axis=1)) / D + eps)[:, None]  # [BLOCK_H, 1]
        w_a = tl.load(w_ptr + d, mask=d < D // 2, other=0.0).to(tl.float32)  # [1, BLOCK_HALF]
        w_b = tl.load(w_ptr + D // 2 + d, mask=d < D // 2, other=0.0).to(tl.float32)
        a = (w_a * (af * rstd).to(a.dtype).to(tl.float32)).to(a.dtype)  # two roundings, as the reference
        b = (w_b * (bf * rstd).to(b.dtype).to(tl.float32)).to(b.dtype)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    return af * cos_a - bf * sin_a, bf * cos_b + af * sin_b  # rotate_half puts -b where a was, a where b was


@triton.jit
def _quantize(x, scale, QUANT: tl.constexpr):
    """fp32 x / scale rounded to the cache's code (QUANT 1: fp8 e4m3, 2: int8), still fp32."""
    x = tl.math.div_rn(x, scale)  # IEEE division: PyTorch's quotient, bit for bit
    if QUANT == 1:
        x = round_fp8_e4m3(x)
    else:
        x = round_int8(x)
    return x


@triton.jit
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr,  # [T, Hq, D], [T, Hkv, D] x 2: strided views of the qkv projection's output
    cos_ptr, sin_ptr,  # [T, D] in q's dtype (token strides stride_ct, stride_st)
    k_cache_ptr, v_cache_ptr,  # [num_slots, Hkv, D] contiguous: the caches seen flat over their blocks
    slot_ptr,  # [T] int32 or int64; < 0 writes nothing
    qw_ptr, kw_ptr,  # [D] QK-norm weights (HAS_NORM)
    k_scale_ptr, v_scale_ptr,  # fp32 [Hkv] or [Hkv, D] (K_PER_CHANNEL), [Hkv] (QUANT != 0)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    num_slots, Hq, Hkv, D, eps,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, QUANT: tl.constexpr, K_PER_CHANNEL: tl.constexpr, FOLD_K_SCALE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # chapter 18: launched under the projection's tail; everything it reads is that kernel's or older
        gdc_wait()
        gdc_launch_dependents()  # the attention kernel after it may be scheduled now
    t = tl.program_id(0).to(tl.int64)  # int64: T * token stride can pass 2^31 in a long prefill
    HALF = D // 2
    d = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    dm = d < HALF
    cos_a = tl.load(cos_ptr + t * stride_ct + d, mask=dm, other=0.0).to(tl.float32)  # [1, BLOCK_HALF]
    cos_b = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=dm, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + t * stride_st + d, mask=dm, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + t * stride_st + HALF + d, mask=dm, other=0.0).to(tl.float32)

    # --- q: rotated where it lies -------------------------------------------------------------
    hq = tl.arange(0, BLOCK_HQ)[:, None]  # [BLOCK_HQ, 1]
    q_mask = (hq < Hq) & dm
    qa_ptr = q_ptr + t * stride_qt + hq * stride_qh + d
    qa = tl.load(qa_ptr, mask=q_mask, other=0.0)  # [BLOCK_HQ, BLOCK_HALF]
    qb = tl.load(qa_ptr + HALF, mask=q_mask, other=0.0)
    new_a, new_b = _norm_rotate(qa, qb, qw_ptr, cos_a, cos_b, sin_a, sin_b, d, D, eps, HAS_NORM)
    new_a, new_b = new_a.to(qa.dtype), new_b.to(qa.dtype)
    if FOLD_K_SCALE:  # q . (s * k_code) = (q * s) . k_code: the keys' channel scales move onto q
        kv_of_q = hq // (Hq // Hkv)  # [BLOCK_HQ, 1]: the KV head each query head reads
        s_a = tl.load(k_scale_ptr + kv_of_q * D + d, mask=q_mask, other=1.0)
        s_b = tl.load(k_scale_ptr + kv_of_q * D + HALF + d, mask=q_mask, other=1.0)
        new_a = (new_a.to(tl.float32) * s_a).to(qa.dtype)
        new_b = (new_b.to(tl.float32) * s_b).to(qa.dtype)
    tl.store(qa_ptr, new_a, mask=q_mask)
    tl.store(qa_ptr + HALF, new_b, mask=q_mask)

    # --- k and v: into the cache row of this token --------------------------------------------
    slot = tl.load(slot_ptr + t).to(tl.int64)
    hk = tl.arange(0, BLOCK_HKV)[:, None]  # [BLOCK_HKV, 1]
    # Padding (slot < 0) or a slot past the cache: every lane masked off, nothing loaded or stored.
    n_heads = tl.where((slot >= 0) & (slot < num_slots), Hkv, 0)
    kv_mask = (hk < n_heads) & dm  # [BLOCK_HKV, BLOCK_HALF]
    ka_ptr = k_ptr + t * stride_kt + hk * stride_kh + d
    ka = tl.load(ka_ptr, mask=kv_mask, other=0.0)
    kb = tl.load(ka_ptr + HALF, mask=kv_mask, other=0.0)
    va_ptr = v_ptr + t * stride_vt + hk * stride_vh + d
    va = tl.load(va_ptr, mask=kv_mask, other=0.0)
    vb = tl.load(va_ptr + HALF, mask=kv_mask, other=0.0)
    new_a, new_b = _norm_rotate(ka, kb, kw_ptr, cos_a, cos_b, sin_a, sin_b, d, D, eps, HAS_NORM)
    new_a, new_b = new_a.to(ka.dtype), new_b.to(ka.dtype)  # the rotated k, rounded as rotary.py's
    if QUANT != 0:
        if K_PER_CHANNEL:
            ks_a = tl.load(k_scale_ptr + hk * D + d, mask=kv_mask, other=1.0)  # [BLOCK_HKV, BLOCK_HALF]
            ks_b = tl.load(k_scale_ptr + hk * D + HALF + d, mask=kv_mask, other=1.0)
        else:
            ks_a = tl.load(k_scale_ptr + hk, mask=hk < Hkv, other=1.0)  # [BLOCK_HKV, 1]
            ks_b = ks_a
        vs = tl.load(v_scale_ptr + hk, mask=hk < Hkv, other=1.0)
        new_a = _quantize(new_a.to(tl.float32), ks_a, QUANT)
        new_b = _quantize(new_b.to(tl.float32), ks_b, QUANT)
        va = _quantize(va.to(tl.float32), vs, QUANT)
        vb = _quantize(vb.to(tl.float32), vs, QUANT)
    row = slot * Hkv * D + hk * D + d  # int64: where this token's heads start in the flat cache
    cache_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + row, new_a.to(cache_ty), mask=kv_mask)
    tl.store(k_cache_ptr + row + HALF, new_b.to(cache_ty), mask=kv_mask)
    tl.store(v_cache_ptr + row, va.to(cache_ty), mask=kv_mask)
    tl.store(v_cache_ptr + row + HALF, vb.to(cache_ty), mask=kv_mask)


def _check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight, k_scale, v_scale,
           fold_k_scale, strict: bool):
    """The pair's own checks (store_kv's and rotary's), then what the fusion adds."""
    quantized = _check_store(k, v, k_cache, v_cache, slot_mapping, strict, k_scale, v_scale)
    check_float_tensor("q", q, dims=3, layout="[T, num_heads, head_dim]")
    T, Hq, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k must be [T, Hkv, D] = ({T}, Hkv, {D}) to match q, got {tuple(k.shape)}")
    if q.dtype != k.dtype or q.device != k.device:
        raise TypeError(f"q and k must share a dtype and device, got {q.dtype} on {q.device} and "
                        f"{k.dtype} on {k.device}")
    if D % 2 != 0:
        raise ValueError(f"head_dim must be even (rotate half pairs i with i + D/2), got {D}")
    if Hq % k.shape[1] != 0:
        raise ValueError(f"num_heads ({Hq}) must be a multiple of num_kv_heads ({k.shape[1]})")
    for name, t in (("cos", cos), ("sin", sin)):
        check_float_tensor(name, t)
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} must be {q.dtype} on {q.device} like q, got {t.dtype} on {t.device}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight come together (QK-norm) or not at all")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            check_float_tensor(name, w)
            if w.shape != (D,) or w.dtype != q.dtype or w.device != q.device:
                raise ValueError(f"{name} must be a [{D}] {q.dtype} tensor on {q.device}, got "
                                 f"{tuple(w.shape)} {w.dtype} on {w.device}")
    if fold_k_scale and not (quantized and k_scale.dim() == 2):
        raise ValueError("fold_k_scale needs a quantized cache with per-channel key scales [Hkv, D]")
    return quantized


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                  q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  fold_k_scale: bool = False, pdl: bool = False) -> torch.Tensor:
    """Rotate q [T, Hq, D] in place and write rotated k and v [T, Hkv, D] to their cache rows; -> q.

    cos, sin: [T, 1, D] or [T, D] in q's dtype (looked up for the T positions). Caches, slot_mapping,
    k_scale, v_scale: as store_kv's (a slot < 0 writes nothing). q_norm_weight, k_norm_weight [D]:
    Qwen3's per-head RMSNorm before the rotation. fold_k_scale: multiply q by the per-channel key scale
    of its KV head (a quantized cache's k_scale [Hkv, D]). One launch, no host sync. pdl: launched with
    programmatic dependent launch (chapter 18; a Hopper GPU, not the interpreter).
    """
    quantized = _check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight,
                       k_scale, v_scale, fold_k_scale, True)
    T, Hq, D = q.shape
    cos, sin = _as_table("cos", cos, T, D), _as_table("sin", sin, T, D)  # [T, D] views
    Hkv = k.shape[1]
    if T == 0:
        return q
    BLOCK_HQ, BLOCK_HALF = triton.next_power_of_2(Hq), triton.next_power_of_2(D // 2)
    num_warps = min(max(BLOCK_HQ * BLOCK_HALF // 256, 1), 8)
    _rope_store_kv_kernel[(T,)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        sin.stride(0), k_cache.shape[0] * k_cache.shape[1], Hq, Hkv, D, float(eps),
        BLOCK_HQ=BLOCK_HQ, BLOCK_HKV=triton.next_power_of_2(Hkv), BLOCK_HALF=BLOCK_HALF,
        HAS_NORM=q_norm_weight is not None,
        QUANT=0 if not quantized else 1 if k_cache.dtype == torch.float8_e4m3fn else 2,
        K_PER_CHANNEL=quantized and k_scale.dim() == 2, FOLD_K_SCALE=fold_k_scale,
        num_warps=num_warps, **({"PDL": True, "launch_pdl": True} if pdl else {}),
    )
    return q


def rope_store_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, *, q_norm_weight=None,
                      k_norm_weight=None, eps=1e-6, k_scale=None, v_scale=None, fold_k_scale=False):
    """The unfused ops the kernel replaces, in plain PyTorch: QK-norm, rotary, store_kv, the scale fold.
    Returns the new q (a new tensor); q, k, v are left untouched."""
    _check(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight, k_scale, v_scale,
           fold_k_scale, False)
    if q_norm_weight is not None:
        q, k = rms_norm_ref(q, q_norm_weight, eps), rms_norm_ref(k, k_norm_weight, eps)  # per head, over D
    q, k = apply_rotary_ref(q, k, cos, sin)  # [T, Hq, D], [T, Hkv, D]
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if fold_k_scale:
        Hkv = k_scale.shape[0]
        groups = q.unflatten(1, (Hkv, q.shape[1] // Hkv))  # [T, Hkv, group, D]
        out = torch.empty(groups.shape, dtype=q.dtype, device=q.device)
        torch.mul(groups, k_scale[:, None, :], out=out)  # in fp32, rounded once to q's dtype
        q = out.flatten(1, 2)
    return q

