"""Weight-only quantized GEMM: y = x W^T with W stored in 4 or 8 bits and dequantized in registers.

Decode is memory-bound (chapter 00): a batch-1 step reads every weight once and does two FLOPs with
it, so its time is the weights' bytes over the memory's bandwidth. Storing W in 4 bits instead of 16
moves a quarter of the bytes, and the step can run up to 4x faster, if and only if the kernel never
writes a 16-bit copy of W back to memory. So each program loads a tile of packed weights, turns it
into activation-dtype numbers in registers and multiplies at once:

    int4, group size G (W4A16):   W[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G]
        q in 0..15, two per byte along K: qweight[n, k // 2] = q[n, 2j] | q[n, 2j + 1] << 4
        (scales, mins): one pair per output row and group of G input columns. mins is the zero point
        in the weight's domain (what q = 0 stands for): llama.cpp's Q4_1 min, torchao's float zero
        point; an integer zero point z (AWQ/GPTQ's convention, W = (q - z) * s) is mins = -z * s.
    int8, per output channel (W8A16): W[n, k] = q[n, k] * scales[n],  q in -127..127
    int8, group size G (GGUF's Q8_0, G = 32): W[n, k] = q[n, k] * scales[n, k // G]
    fp8 e4m3, per output channel (w8a16_fp8.py): W[n, k] = e4m3(q[n, k]) * scales[n], q the code's byte

The tile loop is an ordinary tiled GEMM (fp32 accumulator, tl.dot) whose B tile is made, not loaded:
  - int4: each K tile lies inside one group (BLOCK_K divides G), so a tile needs one scale and one
    min per column. A tile's bytes are loaded as they lie (contiguous along K); the low nibbles make
    W^T's even rows, the high nibbles its odd rows, and each meets the matching columns of x:
    x W^T = x[:, 0::2] W^T[0::2] + x[:, 1::2] W^T[1::2], two dots with nothing reshuffled.
  - int8: the dot runs on the raw q (integers up to 127 are exact in bf16 and fp16) and the channel's
    scale multiplies the finished sum, once per output instead of once per weight. With group scales,
    each K tile (inside one group) gets its own small dot, scaled as it joins the accumulator.

Decode has M <= 16 rows. There w4a16_gemm runs w4a16_swap.py (bf16/fp16 x, groups of 32k): the
same tensor-core product with the operands swapped (y^T = W x^T), so the dequantized weight is the
MMA's register operand instead of a round trip through shared memory; its tiles and split-K depend on
N and K only, so a row's result does not depend on its batch. w4a16_gemv.py (no tl.dot, the zero point
folded, split-K summed in the kernel) runs only up to GEMV_M rows, 0 for now: it measured slower than
the swap kernel (chapter 08). These tiles take the rest: fp32 activations on a GPU (IEEE dots, for
checking, not speed), groups the swap kernel does not take, and M > 16 when split_k is given. For
them, one row across N is too few programs to keep the GPU's loads in flight (4096 columns / 64 = 64
programs for 132 SMs): split-K cuts K into slices, each program sums one slice into an fp32 partial,
and a sum over the slices finishes (the same rule as FlashDecoding's split-KV, flash_decode.py).
Prefill (M > 16) is compute-bound: there the weight is dequantized once and cuBLAS multiplies
(wna16_dequant.py). The tiles depend on M only through DECODE_M, so every M <= 16 gets the same
summation order here too.

The references beside the kernel dequantize the whole weight and multiply (the oracle of the tests,
and what minillm runs on a CPU). Measured speeds, and why the tiles miss at M = 1: chapter 08 and
chapters/bench/ (the dated sweeps), not here.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..checks import check_int
from .checks import FLOAT_DTYPES, INTERPRET, check_device, check_float_tensor, check_tensor
from .flash_attn import dot
from .flash_decode import sm_count
from .w4a16_gemv import w4a16_gemv
from .w4a16_swap import swap_supports, w4a16_swap
from .wna16_dequant import dequant_matmul, e4m3_to_f16, nibble_to_f32

DECODE_M = 16  # up to this many rows: the decode tiles (one row of M, split-K)
GEMV_M = 0  # up to this many rows (at most w4a16_gemv.MAX_ROWS): the GEMV; 0 = off (no faster yet)
MAX_SPLIT_K = 16


@triton.jit
def _wna16_kernel(
    X, QW, S, Mins, Y,  # x [M, K]; qweight [N, K/2] u8 or [N, K] i8; scales, mins [N, K/G] (int8: [N] or [N, K/G])
    M, N, K, group_size, k_per_split,  # k_per_split: K columns per split-K slice, a multiple of BLOCK_K
    stride_xm, stride_qn, stride_sn, stride_ym, stride_ysplit,
    WEIGHT_BITS: tl.constexpr, GROUPED_8: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x and y
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output channels (rows of W)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_cols = QW + offs_n.to(tl.int64)[None, :] * stride_qn  # [1, BLOCK_N]: W^T's columns are W's rows
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if WEIGHT_BITS == 4:
            # Byte j of a row holds k = 2j (low nibble) and 2j + 1 (high): load this tile's BLOCK_K / 2
            # bytes per row as one contiguous run, and meet the low nibbles with x's even columns, the
            # high ones with its odd columns, in two dots (no reshuffling of registers).
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2] byte columns
            packed = tl.load(w_cols + offs_j[:, None], mask=n_ok[None, :], other=0)  # [BLOCK_K / 2, BLOCK_N]
            g = k0 // group_size  # this tile's group (BLOCK_K divides the group size)
            s = tl.load(S + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_N]
            mn = tl.load(Mins + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            x_even = tl.load(x_rows + 2 * offs_j[None, :], mask=m_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_K / 2]
            x_odd = tl.load(x_rows + 2 * offs_j[None, :] + 1, mask=m_ok[:, None], other=0.0)
            w_even = nibble_to_f32(packed & 0xF) * s + mn  # W^T's even rows, rounded once to x's dtype
            w_odd = nibble_to_f32(packed >> 4) * s + mn
            acc = dot(x_even, w_even.to(x_even.dtype), acc, IEEE)
            acc = dot(x_odd, w_odd.to(x_odd.dtype), acc, IEEE)
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_ok = offs_k < K  # the last tile may overhang K
            x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            q = tl.load(w_cols + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)  # int8 or e4m3 codes
            if FP8:  # the codes' values: exact in fp16, and again in x's dtype (3 mantissa bits, 2^-9..448)
                q = e4m3_to_f16(q, FP8 == 2)  # 2: FP8_CVT (wna16_dequant.py)
            if GROUPED_8:  # this tile's group scale, per column, on this tile's partial sum
                s = tl.load(S + offs_n * stride_sn + k0 // group_size, mask=n_ok, other=0.0).to(tl.float32)
                acc += dot(x, q.to(x.dtype), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE) * s[None, :]
            else:
                acc = dot(x, q.to(x.dtype), acc, IEEE)  # the channel scale comes after the sum
    if WEIGHT_BITS == 8 and not GROUPED_8:
        acc *= tl.load(S + offs_n * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]  # stride 0: per tensor
    y = Y + split.to(tl.int64) * stride_ysplit + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---- tiles ---------------------------------------------------------------------------------------


def choose_tiles(M: int, N: int, K: int, group_size: int, dtype: torch.dtype, device: torch.device,
                 split_k: int | None, bits: int = 4):
    """(BLOCK_M, BLOCK_N, BLOCK_K, split_k, num_warps, num_stages) for an [M, K] x [K, N] product.

    BLOCK_K divides the group size (a tile needs one scale per column). Decode (M <= DECODE_M) takes one
    16-row tile; int4 and group-scaled int8 split K until there are about eight programs per SM, and
    per-channel int8 runs 256-wide K tiles in one slice. Those are the best of a sweep on an H100
    (2026-11-25, Llama-3-8B shapes, M = 1 and 16: BLOCK_N 32-128, BLOCK_K 64-256, split 1-16, 3 or 5
    stages; .gpu/w4sweep.py): the same tiles for every M <= 16, so a row's sums do not depend on its batch."""
    if INTERPRET or dtype == torch.float32:
        # small tiles: the CPU tests' small shapes cross several of each; fp32 (IEEE dots, for checking
        # exactness, not for speed) would take minutes to compile wide ones (flash_attn.prune_fp32)
        bm, bn, bk, warps, stages = 16, 32, 32, 4, 1
    elif M <= DECODE_M:
        bm, bn, bk, warps, stages = (16, 64, 64, 4, 3) if bits == 4 else (16, 32, 256, 4, 4)
    else:
        bm, bn, bk, warps, stages = (64 if M <= 64 else 128), 128, 64, (4 if M <= 64 else 8), 3
    bk = math.gcd(bk, group_size)  # group_size is a multiple of 32: so is bk
    k_tiles = triton.cdiv(K, bk)
    if split_k is None:
        programs = triton.cdiv(N, bn) * triton.cdiv(M, bm)
        one_slice = M > DECODE_M or (bits == 8 and bk >= 256)  # per-channel int8: long K tiles, no split
        split_k = 1 if one_slice else triton.cdiv(8 * sm_count(device), programs)
    split_k = max(1, min(split_k, k_tiles, MAX_SPLIT_K))
    return bm, bn, bk, split_k, warps, stages


def _launch(x, qweight, scales, mins, group_size, bits: int, split_k, fp8: int = 0):
    M, K = x.shape
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    bm, bn, bk, split_k, warps, stages = choose_tiles(M, N, K, group_size, x.dtype, x.device, split_k, bits)
    k_tiles = triton.cdiv(K, bk)
    k_per_split = triton.cdiv(k_tiles, split_k) * bk
    split_k = triton.cdiv(k_tiles * bk, k_per_split)  # no empty slices
    # one slice writes y itself; several write fp32 partials that one sum finishes (deterministic,
    # unlike atomics, so the same input always gives the same bits)
    out = y if split_k == 1 else torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split_k)
    _wna16_kernel[grid](
        x, qweight, scales, mins if mins is not None else scales, out,
        M, N, K, group_size, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), N, M * N,
        WEIGHT_BITS=bits, GROUPED_8=bits == 8 and scales.dim() == 2, FP8=fp8, IEEE=x.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )
    if split_k > 1:  # [split_k, M, N] fp32 -> [M, N], rounded once
        if x.device.type == "cpu":  # slice by slice: the CPU's sum over dim 0 may order its adds by M
            y.copy_(functools.reduce(torch.add, out.unbind(0)))
        else:
            y.copy_(out.sum(dim=0))
    return y


# ---- checks --------------------------------------------------------------------------------------


def _check(x, qweight, scales, mins, group_size, bits: int, strict: bool, split_k=None) -> None:
    """x [M, K] float; int4: qweight uint8 [N, K/2], scales and mins [N, K/G]; int8: qweight int8
    [N, K], scales [N]. Every wrong input is a TypeError/ValueError here, never a Triton error."""
    check_float_tensor("x", x, FLOAT_DTYPES if strict else None, dims=2, layout="[num_tokens, in_features]",
                       contiguous=strict)
    K = x.shape[1]
    check_tensor("qweight", qweight)
    want_dtype, packing = (torch.uint8, 2) if bits == 4 else (torch.int8, 1)
    if qweight.dtype != want_dtype:
        raise TypeError(f"qweight of a W{bits}A16 GEMM must be {want_dtype}, got {qweight.dtype}")
    if qweight.dim() != 2 or qweight.shape[1] * packing != K:
        want = "[out_features, in_features / 2] (two 4-bit values per byte)" if bits == 4 else \
            "[out_features, in_features]"
        raise ValueError(f"qweight must be {want} with in_features = x.shape[1] = {K}, got {tuple(qweight.shape)}")
    if strict and qweight.shape[1] > 1 and qweight.stride(1) != 1:
        raise ValueError(f"qweight's last dim must be contiguous (stride 1), got strides {qweight.stride()}")
    N = qweight.shape[0]
    if bits == 4:
        check_int("group_size", group_size)
        if group_size % 32:  # a tile's half (its even or odd k) must be a tl.dot of K >= 16
            raise ValueError(f"group_size must be a multiple of 32 (the kernel's least K tile), not {group_size}")
        if K % group_size:
            raise ValueError(f"group_size {group_size} must divide in_features {K}")
        shape = (N, K // group_size)
    elif group_size is not None:  # int8 with group scales
        check_int("group_size", group_size)
        if group_size % 32 or K % group_size:
            raise ValueError(f"int8 group_size must be a multiple of 32 that divides in_features {K}, "
                             f"not {group_size}")
        shape = (N, K // group_size)
    else:
        shape = (N,)
    check_float_tensor("scales", scales, FLOAT_DTYPES if strict else None, contiguous=strict)
    if tuple(scales.shape) != shape:
        raise ValueError(f"scales must have shape {list(shape)}, got {tuple(scales.shape)}")
    if bits == 4:
        check_float_tensor("mins", mins, FLOAT_DTYPES if strict else None, contiguous=strict)
        if mins.shape != scales.shape or mins.dtype != scales.dtype or mins.stride() != scales.stride():
            raise ValueError(f"mins must match scales (shape {list(shape)}, {scales.dtype}, strides "
                             f"{scales.stride()}), got {tuple(mins.shape)}, {mins.dtype}, {mins.stride()}")
    tensors = {"qweight": qweight, "scales": scales} | ({"mins": mins} if bits == 4 else {})
    for name, t in tensors.items():
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    check_int("split_k", split_k, optional=True)
    if strict:
        check_device("x", x)
        if INTERPRET and x.dtype == torch.bfloat16:  # seen with Triton 3.9: bf16 tl.dot returns garbage
            raise TypeError("Triton's CPU interpreter gets bfloat16 tl.dot wrong: use float32 or float16 on a CPU")


# ---- the public functions: kernel and reference ----------------------------------------------------


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               group_size: int, *, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(qweight)^T -> [M, N] in x's dtype, the int4 weight never dequantized in memory.

    qweight uint8 [N, K/2] (pack_int4), scales and mins [N, K/group_size]; split_k None chooses: up to
    GEMV_M rows (0: none) the GEMV (w4a16_gemv.py, fp32 weights: W not rounded); up to DECODE_M rows
    the swapped tensor-core kernel (w4a16_swap.py) where it takes x (bf16/fp16, groups of 32k), else
    these tiles; above DECODE_M rows the prefill path (wna16_dequant.py: the weight dequantized once,
    then cuBLAS); a given split_k always runs the tiles."""
    _check(x, qweight, scales, mins, group_size, 4, strict=True, split_k=split_k)
    if split_k is None and x.shape[0] <= GEMV_M:
        return w4a16_gemv(x, qweight, scales, mins, group_size)
    if split_k is None and x.shape[0] <= DECODE_M and swap_supports(x, group_size):
        return w4a16_swap(x, qweight, scales, mins, group_size)
    if split_k is None and x.shape[0] > DECODE_M:
        return dequant_matmul(x, qweight, scales, mins, group_size, 4)
    return _launch(x, qweight, scales, mins, group_size, 4, split_k)


def w8a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int | None = None, *,
               split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(qweight)^T -> [M, N] in x's dtype; qweight int8 [N, K]; scales [N] (one per output
    channel, group_size None) or [N, K / group_size] (GGUF's Q8_0: group_size 32)."""
    _check(x, qweight, scales, None, group_size, 8, strict=True, split_k=split_k)
    # Per channel, one group spans the whole row: any tile size divides it (256: the preferred K tile).
    if split_k is None and x.shape[0] > DECODE_M:  # prefill: as w4a16_gemm
        return dequant_matmul(x, qweight, scales, None, group_size or 256, 8)
    return _launch(x, qweight, scales, None, group_size or 256, 8, split_k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 -> uint8 [N, K/2], two per byte along K: low nibble = even k."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] in 0..15 (pack_int4's inverse)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)  # [N, K/2, 2] -> [N, K]


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [N, K] weight the int4 layout stands for, computed in fp32 and rounded once to `dtype`
    (default: the scales' dtype)."""
    q = unpack_int4(qweight).float()  # [N, K]
    N, K = q.shape
    w = q.view(N, K // group_size, group_size) * scales.float()[..., None] + mins.float()[..., None]
    return w.view(N, K).to(dtype or scales.dtype)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [N, K] weight the int8 layout stands for: q * the scale of its row ([N]) or of its group ([N, K/G])."""
    if scales.dim() == 1:
        return (qweight.float() * scales.float()[:, None]).to(dtype or scales.dtype)
    N, K = qweight.shape
    groups = scales.shape[1]
    w = qweight.float().view(N, groups, K // groups) * scales.float()[..., None]  # [N, groups, G]
    return w.view(N, K).to(dtype or scales.dtype)


def w4a16_gemm_ref(x, qweight, scales, mins, group_size: int, *, split_k: int | None = None) -> torch.Tensor:
    """w4a16_gemm in plain PyTorch: the whole weight dequantized to x's dtype, then one matmul."""
    _check(x, qweight, scales, mins, group_size, 4, strict=False, split_k=split_k)
    return F.linear(x, dequantize_int4(qweight, scales, mins, group_size, x.dtype))


def w8a16_gemm_ref(x, qweight, scales, group_size: int | None = None, *, split_k: int | None = None) -> torch.Tensor:
    """w8a16_gemm in plain PyTorch: the whole weight dequantized to x's dtype, then one matmul."""
    _check(x, qweight, scales, None, group_size, 8, strict=False, split_k=split_k)
    return F.linear(x, dequantize_int8(qweight, scales, x.dtype))
