"""Rotary position embedding, applied to q and k in place by one Triton kernel.

Llama-family checkpoints pair coordinate i of a head with coordinate i + D/2 ("rotate half"):

    x' = x * cos + rotate_half(x) * sin,   rotate_half([a, b]) = [-b, a]
    i.e.  a' = a * cos_a - b * sin_a,   b' = b * cos_b + a * sin_b     (a, b: the two halves)

PyTorch evaluates that as five kernels per tensor (a negation, a concatenation, two multiplies, an
add; the chunks are views), ten for q and k, each a round trip through GPU memory, and allocates new
q and k. The kernel gives
each token to one program, which loads the token's cos and sin once and rotates every query head and
every key head with them, writing the result over its input: q and k are read once and written once,
in a single launch for both. Decode, a few tokens at a time, is bound by exactly those memory trips
and launches, not by the few multiplies.

In place matters too: q and k arrive as strided views of the fused qkv projection's output
[T, (Hq + 2 Hkv) * D], so rotating them where they lie leaves the attention kernel its q, k and v
in the one buffer, with no copies. The math is done in fp32 and rounded once; the reference rounds
after each multiply and after the add, so the two differ by about a unit in the last place of the
inputs (more ulps of the result where a * cos and b * sin nearly cancel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_float_tensor


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's first head of q or k
    stride_h,
    n_heads,
    cos_a,  # [1, BLOCK_HALF] fp32: cos for the first half of the head
    cos_b,  # ... and for the second
    sin_a,
    sin_b,
    HALF,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = (heads < n_heads) & (d < HALF)  # [BLOCK_H, BLOCK_HALF]
    a_ptr = x_ptr + heads * stride_h + d  # the first halves of all heads
    a = tl.load(a_ptr, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
    b = tl.load(a_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    # Both halves are read before either is written: each output needs both inputs.
    new_a = a * cos_a - b * sin_a  # rotate_half puts -b where a was
    new_b = b * cos_b + a * sin_b  # ... and a where b was
    tl.store(a_ptr, new_a.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(a_ptr + HALF, new_b.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, Hq, D], token stride stride_qt, head stride stride_qh
    k_ptr,  # [T, Hkv, D]
    cos_ptr,  # [T, D], token stride stride_ct
    sin_ptr,  # [T, D], token stride stride_st
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    Hq,
    Hkv,
    HALF,  # D // 2
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # int64: T * token stride can pass 2^31 in a long prefill
    d = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    dm = d < HALF
    # cos/sin of this token's position, loaded once and shared by all Hq + Hkv heads.
    cos_a = tl.load(cos_ptr + t * stride_ct + d, mask=dm, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=dm, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + t * stride_st + d, mask=dm, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + t * stride_st + HALF + d, mask=dm, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + t * stride_qt, stride_qh, Hq, cos_a, cos_b, sin_a, sin_b, HALF, BLOCK_HQ, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr + t * stride_kt, stride_kh, Hkv, cos_a, cos_b, sin_a, sin_b, HALF, BLOCK_HKV, BLOCK_HALF
    )


def _as_table(name: str, t: torch.Tensor, T: int, D: int) -> torch.Tensor:
    """cos or sin, [T, 1, D] or [T, D], as a [T, D] view."""
    if tuple(t.shape) not in ((T, 1, D), (T, D)):
        raise ValueError(f"{name} must have shape [T, 1, D] or [T, D] = ({T}, 1, {D}), got {tuple(t.shape)}")
    return t.reshape(T, D)


def apply_rotary_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos/sin [T, 1, D]; returns (q, k).

    q and k may be strided views (of one fused qkv tensor, say) as long as each head's D numbers are
    contiguous; cos and sin are already looked up for the T positions.
    """
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float_tensor(name, t)
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q and k must be 3-D [T, heads, head_dim], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    T, Hq, D = q.shape
    if k.shape[0] != T or k.shape[2] != D:
        raise ValueError(f"k must be [T, Hkv, D] = ({T}, Hkv, {D}) to match q, got {tuple(k.shape)}")
    if D % 2 != 0:
        raise ValueError(f"head_dim must be even (rotate half pairs i with i + D/2), got {D}")
    if k.dtype != q.dtype:
        raise TypeError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    cos, sin = _as_table("cos", cos, T, D), _as_table("sin", sin, T, D)  # [T, D] each
    Hkv = k.shape[1]
    if T == 0 or D == 0:
        return q, k
    HALF = D // 2
    # Warps in proportion to the tile (heads x D), so each thread holds a few dozen numbers.
    num_warps = min(max(triton.next_power_of_2(Hq) * D // 1024, 1), 8)
    _rotary_kernel[(T,)](
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        Hq,
        Hkv,
        HALF,
        BLOCK_HQ=triton.next_power_of_2(Hq),
        BLOCK_HKV=triton.next_power_of_2(max(Hkv, 1)),
        BLOCK_HALF=triton.next_power_of_2(HALF),
        num_warps=num_warps,
    )
    return q, k


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)  # [..., D/2] each
    return torch.cat((-b, a), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-PyTorch RoPE the kernel is tested against: new tensors, q and k untouched."""
    if cos.dim() == 2:  # [T, D] -> [T, 1, D], to broadcast over heads
        cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
