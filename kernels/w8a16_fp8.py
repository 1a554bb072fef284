"""FP8 weight-only GEMM: y = x W^T with W stored as fp8 e4m3 and x, y in bf16/fp16 (W8A16, fp8 weights).

    W[n, k] = e4m3(q[n, k]) * scale[n]        (or one scale for the whole tensor)

This is the layout fp8 mode already keeps (layers/quantization/fp8.py, vLLM's names): `weight`
[N, K] float8_e4m3fn, `weight_scale` fp32 [N] or []. W8A8 (torch._scaled_mm) quantizes the
activations too, which costs one more kernel per GEMM and buys FP8 tensor-core arithmetic: a win
only where the GEMM is compute-bound. A decode step (a few rows) is memory-bound, its time is the
weight's bytes, and those are one per weight either way; so there the fp8 weight is read the way
W8A16 reads int8 (w4a16.py): each tile of codes becomes numbers of x's dtype in registers (every e4m3
value is exact in bf16 and in fp16), the tile's dot sums in fp32, and the channel's scale multiplies
the finished sum. No activation quantization, and no FP8 matrix units: an A100 runs it too.

The kernel is w4a16.py's 8-bit kernel with FP8 on; the codes travel as their bytes (a uint8 view, no
copy) and e4m3_to_f16 (wna16_dequant.py) decodes them: with the GPU's conversion instruction where it
has one (compute capability >= 8.9), else with integer ops (about ten a weight: on an H100 at M = 1
that may cost more than the byte's load; scripts/gpu/fp8_crossover.py times both). Above DECODE_M rows
the weight is dequantized once and cuBLAS multiplies, as for int8. The reference dequantizes the
whole weight and multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import check_int
from .checks import FLOAT_DTYPES, INTERPRET, check_device, check_float_tensor, check_tensor
from .w4a16 import DECODE_M, _launch
from .wna16_dequant import FP8_BITS, FP8_CVT, dequant_matmul

FP8 = torch.float8_e4m3fn
K_TILE = 256  # the "group" the 8-bit tiles see: per channel, one group spans the row (as w8a16_gemm)


def _check(x, weight, scale, strict: bool, split_k=None) -> None:
    """x [M, K] float; weight float8_e4m3fn [N, K]; scale fp32 [N] or []. Every wrong input is a
    TypeError/ValueError here, never a Triton error."""
    check_float_tensor("x", x, FLOAT_DTYPES if strict else None, dims=2, layout="[num_tokens, in_features]",
                       contiguous=strict)
    K = x.shape[1]
    check_tensor("weight", weight)
    if weight.dtype != FP8:
        raise TypeError(f"weight of an fp8 weight-only GEMM must be {FP8}, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"weight must be [out_features, in_features] with in_features = x.shape[1] = {K}, "
                         f"got {tuple(weight.shape)}")
    if strict and weight.shape[1] > 1 and weight.stride(1) != 1:
        raise ValueError(f"weight's last dim must be contiguous (stride 1), got strides {weight.stride()}")
    check_tensor("weight_scale", scale)
    N = weight.shape[0]
    if scale.dtype != torch.float32 or tuple(scale.shape) not in ((N,), ()):
        raise ValueError(f"weight_scale must be float32 of shape [{N}] (per output channel) or [] (per tensor), "
                         f"got {scale.dtype} {tuple(scale.shape)}")
    for name, t in (("weight", weight), ("weight_scale", scale)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    check_int("split_k", split_k, optional=True)
    if strict:
        check_device("x", x)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight the fp8 layout stands for, computed in fp32 and rounded once to `dtype`."""
    s = scale.float()[:, None] if scale.dim() == 1 else scale.float()  # [N, 1] per row, or [] per tensor
    return (weight.float() * s).to(dtype)  # [N, K]


def fp8_w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
                   split_k: int | None = None, cvt: bool | None = None) -> torch.Tensor:
    """x [M, K] @ (e4m3(weight) * scale)^T -> [M, N] in x's dtype. weight float8_e4m3fn [N, K], scale fp32
    [N] or []. Up to DECODE_M rows (or with split_k given) the W8A16 tiles, the weight never dequantized in
    memory; above, the prefill path (the weight dequantized once, then cuBLAS). cvt: decode the codes
    with the GPU's instruction (True) or integer ops (False); None: the instruction where there is one."""
    _check(x, weight, scale, strict=True, split_k=split_k)
    has_cvt = not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (8, 9)  # off a GPU: the interpreter
    if cvt and not has_cvt:  # a clear error, not Triton's failure to lower the conversion
        raise ValueError("cvt=True needs a GPU of compute capability >= 8.9 (FP8 units): use cvt=False or None")
    cvt = x.is_cuda and has_cvt if cvt is None else cvt
    fp8 = FP8_CVT if cvt else FP8_BITS
    codes = weight.view(torch.uint8)  # [N, K]: the bytes, decoded in the kernel (any GPU, and the interpreter)
    scales = scale.reshape(-1).expand(weight.shape[0])  # [N]; a per-tensor scale is read at stride 0
    if split_k is None and x.shape[0] > DECODE_M:
        return dequant_matmul(x, codes, scales, None, K_TILE, 8, fp8=fp8)
    if INTERPRET and x.dtype == torch.bfloat16:
        # The interpreter's bf16 tl.dot is wrong (w4a16._check). A bf16 times an e4m3 value is exact in
        # fp32, so fp32 operands with an IEEE dot are the GPU's bf16 arithmetic (exact products, fp32
        # sums), rounded once to bf16 at the end as the kernel's store does.
        return _launch(x.float(), codes, scales, None, K_TILE, 8, split_k, fp8=fp8).to(x.dtype)
    return _launch(x, codes, scales, None, K_TILE, 8, split_k, fp8=fp8)


def fp8_w8a16_gemm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
                       split_k: int | None = None) -> torch.Tensor:
    """fp8_w8a16_gemm in plain PyTorch: the whole weight dequantized to x's dtype, then one matmul."""
    _check(x, weight, scale, strict=False, split_k=split_k)
    return F.linear(x, dequantize_fp8(weight, scale, x.dtype))
