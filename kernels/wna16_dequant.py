"""Prefill with quantized weights: dequantize the weight once per step, then let cuBLAS multiply.

A decode step (M <= 16 rows) reads each weight once and does 2 M FLOPs with it: memory-bound, so
w4a16.py's kernel dequantizes tiles in registers and wins by moving fewer bytes. A prefill step with
M in the hundreds or thousands does 2 M FLOPs per weight: compute-bound, where what counts is a
well-tuned tensor-core GEMM, and the weight's bytes are a small part of the time. So for M > 16 the
weight is written out once in the activations' dtype (one kernel: read N K / 2 bytes of int4 or N K
of int8, write 2 N K) and multiplied by cuBLAS. Its cost is a copy of the weight, fixed per step,
which a long prompt amortizes; AutoAWQ and vLLM's AWQ path make the same switch for large batches.

    int4:  W[n, k] = q * scales[n, k // G] + mins[n, k // G]   (the layout of w4a16.py)
    int8:  W[n, k] = q * scales[n]  or  q * scales[n, k // G]
    fp8:   W[n, k] = e4m3(q) * scales[n]        (q: the e4m3 code's byte, decoded by e4m3_to_f16)

The dequantized values are computed exactly as the references compute them (fp32 multiply-add,
rounded once to the output dtype), so the weight cuBLAS sees is the weight the reference sees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def nibble_to_f32(q):
    """uint8 values 0..15 (or any 0..255) -> the same values in float32, exactly, without an int-to-float
    conversion: OR the integer into the mantissa of 2^23 and subtract 2^23. Both are full-rate
    instructions, where the conversion runs at a quarter of the FMA rate on recent GPUs, and a decode
    kernel converts every weight it reads (Marlin and FasterTransformer use the same trick in fp16)."""
    # 0x4B000000 is 2^23 as float32 bits: with that exponent the mantissa bits count whole units
    return (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


FP8_BITS = 1  # fp8 argument of the kernels: e4m3 codes decoded with integer ops (any GPU, the interpreter)
FP8_CVT = 2  # ... converted by the GPU's own instruction (compute capability >= 8.9)


@triton.jit
def e4m3_to_f16(code, CVT: tl.constexpr):
    """uint8 fp8 e4m3 codes -> their values in float16, exactly.

    CVT: the code's byte reinterpreted as float8 and converted by the GPU (one instruction per two
    codes), which Triton lowers only for GPUs with FP8 units (compute capability >= 8.9). Otherwise
    integer ops and one multiply, for the older GPUs the fp8 weight-only path also serves. e4m3 is
    s eeee mmm (bias 7); fp16 is s eeeee mmmmmmmmmm (bias 15). Shifted left by 7, eeee becomes fp16's
    exponent field (its top bit 0) and mmm the top of its mantissa: the pattern reads 2^(e - 15) (1 + m/8),
    or for e = 0 the fp16 subnormal m 2^-17, both exactly 2^-8 times the e4m3 value. One multiply by 2^8
    finishes, exactly: every result (2^-9 to 448) is a normal fp16, and fp16 subnormals are not flushed.
    e4m3 ("fn") has no infinities; s 1111 111 (0x7F, 0xFF) is NaN, which the pattern alone would read
    as 480."""
    if CVT:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    c = code.to(tl.int32)  # [...] 0..255
    mag = c & 0x7F  # eeee mmm
    h = ((c & 0x80) << 8) | (mag << 7)  # sign to bit 15, eeee mmm to bits 13..7
    h = tl.where(mag == 0x7F, 0x7E00, h)  # fp16's NaN
    return h.to(tl.int16).to(tl.float16, bitcast=True) * 256.0  # the low 16 bits, read as fp16


@triton.jit
def _dequant_kernel(
    QW, S, Mins, W,  # qweight [N, K/2] u8 or [N, K] i8; scales/mins [N, K/G] or [N]; W out [N, K]
    N, K, group_size, stride_qn, stride_sn,
    WEIGHT_BITS: tl.constexpr, PER_CHANNEL: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    if WEIGHT_BITS == 4:
        offs_j = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2] bytes
        ok = n_ok[:, None] & (offs_j < K // 2)[None, :]
        packed = tl.load(QW + rows * stride_qn + offs_j[None, :], mask=ok, other=0)  # [BLOCK_N, BLOCK_K / 2]
        g = (2 * offs_j) // group_size  # both nibbles of a byte are in one group (G is even)
        s = tl.load(S + rows * stride_sn + g[None, :], mask=ok, other=0.0).to(tl.float32)
        m = tl.load(Mins + rows * stride_sn + g[None, :], mask=ok, other=0.0).to(tl.float32)
        lo = (nibble_to_f32(packed & 0xF) * s + m).to(W.dtype.element_ty)  # [BLOCK_N, BLOCK_K / 2]: even k
        hi = (nibble_to_f32(packed >> 4) * s + m).to(W.dtype.element_ty)  # odd k
        # interleaved back into k order in registers, so the tile is stored as contiguous rows (two stores
        # at a stride of two elements would each fill half of every memory sector they touch)
        w = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])  # [BLOCK_N, BLOCK_K / 2, 2] -> [BLOCK_N, BLOCK_K]
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        tl.store(W + rows * K + offs_k[None, :], w, mask=n_ok[:, None] & (offs_k < K)[None, :])
    else:
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        ok = n_ok[:, None] & (offs_k < K)[None, :]
        q = tl.load(QW + rows * stride_qn + offs_k[None, :], mask=ok, other=0)  # int8, or e4m3 codes (uint8)
        q = e4m3_to_f16(q, FP8 == 2).to(tl.float32) if FP8 else q.to(tl.float32)  # FP8: 0, FP8_BITS or FP8_CVT
        if PER_CHANNEL:  # stride_sn 0: one scale for the whole tensor, broadcast
            s = tl.load(S + offs_n * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[:, None]  # [BLOCK_N, 1]
        else:
            s = tl.load(S + rows * stride_sn + (offs_k // group_size)[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(W + rows * K + offs_k[None, :], (q * s).to(W.dtype.element_ty), mask=ok)


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                      bits: int, dtype: torch.dtype, fp8: int = 0) -> torch.Tensor:
    """The [N, K] weight in `dtype`, written by one kernel (arguments checked by the caller, w4a16.py or
    w8a16_fp8.py; fp8 FP8_BITS or FP8_CVT: qweight holds e4m3 codes as uint8, decoded that way)."""
    N = qweight.shape[0]
    K = qweight.shape[1] * (2 if bits == 4 else 1)
    w = torch.empty((N, K), dtype=dtype, device=qweight.device)
    if N == 0 or K == 0:
        return w
    bn, bk = 32, 128
    grid = (triton.cdiv(N, bn), triton.cdiv(K, bk))
    _dequant_kernel[grid](qweight, scales, mins if mins is not None else scales, w, N, K, group_size,
                          qweight.stride(0), scales.stride(0),
                          WEIGHT_BITS=bits, PER_CHANNEL=scales.dim() == 1, FP8=fp8, BLOCK_N=bn, BLOCK_K=bk)
    return w


def dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                   group_size: int, bits: int, fp8: int = 0) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] with W dequantized to x's dtype first (the prefill path)."""
    return F.linear(x, dequantize_weight(qweight, scales, mins, group_size, bits, x.dtype, fp8))
