"""Quantizing to 8 bits at run time: FP8 activations for the W8A8 GEMM, and the rounding rules that the
quantized KV cache (store_kv.py) shares with it.

FP8 e4m3 (the "fn" variant: no infinities, one NaN code) keeps 4 exponent and 3 mantissa bits: 448 is
the largest value, 2^-6 the smallest normal one, 2^-9 the smallest subnormal. A tensor is stored as
q = x / s in that format with a scale s chosen so that the largest |x| lands near 448, and read back as
q * s. The relative error of one number is at most 2^-4 (half a step of a 3-bit mantissa), wherever it
sits in the range: that is the point of a floating-point format over int8's evenly spaced levels.

Activations change every step, so their scale is computed on the fly (dynamic quantization), either
one per token (row) or one for the whole tensor:

    per token:  s_m = max_k |x[m, k]| / 448          q[m, k] = fp8(x[m, k] / s_m)        ([M, 1] scales)
    per tensor: s   = max_{m,k} |x[m, k]| / 448      q[m, k] = fp8(x[m, k] / s)          (one scale)

A per-token scale costs nothing extra in the GEMM (torch._scaled_mm multiplies row m of the result by
s_m) and keeps one outlier token from flattening all the others, so it is the default.

The kernel gives each row to one program: one pass over the row for its absmax, a second to scale,
round and store (the row is re-read from L2, not HBM, for any hidden size a model has). The rounding
itself is done in fp32 arithmetic (`round_fp8_e4m3`) rather than by the fp32 -> fp8 cast: Triton's
CPU interpreter (3.9) rounds that cast wrongly at binade edges (31.6 became 16, not 32), and rounding
first makes the cast exact on every backend, so the interpreter and the GPU store the same bits as
PyTorch's own conversion (round to nearest even, saturating at +-448).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_device, check_float_tensor

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_MAX = 127.0  # symmetric int8: -127..127 (-128 unused, so that -q is always a level)
MIN_SCALE = 1e-12 / FP8_E4M3_MAX  # an all-zero row still gets a finite scale (its q is 0)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: adding it rounds an fp32 |y| < 2^22 to an integer (ties to even)


@triton.jit
def round_fp8_e4m3(y):
    """fp32 y -> the nearest e4m3 value (ties to even), saturated to +-448, still in fp32 (so that the
    cast after it is exact). Normal range: drop the 20 low mantissa bits of the fp32 pattern with
    round-half-even on the bits; below 2^-6 e4m3 is subnormal, a fixed grid of 2^-9 steps."""
    a = tl.minimum(tl.abs(y), 448.0)  # saturating first is the same as rounding first: 448 is a level
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 = 0xFFF00000: keep 3 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    sub = ((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # multiples of 2^-9 (a * 512 is exact)
    r = tl.where(a < 0.015625, sub, normal).to(tl.int32, bitcast=True)
    sign = y.to(tl.int32, bitcast=True) & -2147483648  # y's sign bit (-0.0 stays -0.0, as in PyTorch)
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_int8(y):
    """fp32 y -> the nearest integer in -127..127 (ties to even, as torch.round), still in fp32."""
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _quant_fp8_rows(
    X, Q, S,  # x [M, K] any float; q [M, K] fp8 e4m3; s [M] fp32 (per token) or [1] (per tensor)
    stride_xm, stride_qm, K,
    PER_TOKEN: tl.constexpr,  # True: compute each row's scale here; False: read the one scale S[0]
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    if PER_TOKEN:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(X + m * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) / 448.0, 2.232142857142857e-15)  # MIN_SCALE
        tl.store(S + m, scale)
    else:
        scale = tl.load(S)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(X + m * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = round_fp8_e4m3(tl.math.div_rn(x, scale))  # IEEE division: the same quotient as PyTorch's
        tl.store(Q + m * stride_qm + k0 + offs, q.to(Q.dtype.element_ty), mask=mask)


def _check_x(x) -> None:
    check_float_tensor("x", x, FLOAT_DTYPES, dims=2, layout="[tokens, features]")


def scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor | None = None,
                     per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scales fp32: [M, 1] per token, or [] per tensor).

    per_token=False without `scale`: one dynamic scale from the whole tensor's absmax (a torch.amax
    first: the global maximum needs every row); with `scale` ([] or [1] fp32): that static scale.
    vLLM's name; one Triton launch per call (plus the amax for a dynamic per-tensor scale)."""
    _check_x(x)
    check_device("x", x)
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    if per_token and scale is None:
        s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    else:
        s = _tensor_scale(x, scale)
    if M == 0 or K == 0:
        return q, s
    BLOCK_K = min(triton.next_power_of_2(K), 2048)
    _quant_fp8_rows[(M,)](x, q, s, x.stride(0), q.stride(0), K, PER_TOKEN=per_token and scale is None,
                          BLOCK_K=BLOCK_K, num_warps=4 if BLOCK_K >= 1024 else 2)
    return q, s


def scaled_fp8_quant_ref(x: torch.Tensor, scale: torch.Tensor | None = None,
                         per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference of scaled_fp8_quant: same arguments, same bits."""
    _check_x(x)
    xf = x.float()
    if per_token and scale is None:
        s = (xf.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp_min(MIN_SCALE)  # [M, 1]
    else:
        s = _tensor_scale(x, scale)
    return quantize_fp8_ref(xf, s), s


def _tensor_scale(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """One fp32 scale: the given static one (checked), or the tensor's absmax / 448."""
    if scale is None:
        amax = x.abs().amax() if x.numel() else torch.zeros((), device=x.device)
        return (amax.float() / FP8_E4M3_MAX).clamp_min(MIN_SCALE).reshape(())
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"scale must be a one-element float32 tensor, got {getattr(scale, 'shape', scale)!r} "
                         f"{getattr(scale, 'dtype', '')}")
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device} but x is on {x.device}")
    return scale.reshape(())


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(x / scale), saturated at +-448 (PyTorch's cast rounds to nearest even; a saturating clamp
    first, because older PyTorch turns out-of-range values into NaN)."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_int8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(x / scale) in -127..127, ties to even."""
    return torch.round((x.float() / scale).clamp(-INT8_MAX, INT8_MAX)).to(torch.int8)
