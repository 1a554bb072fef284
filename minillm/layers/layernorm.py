"""RMSNorm (Zhang & Sennrich, 2019): scale each vector to unit root-mean-square, then by a learned gain.

    y = x / sqrt(mean(x^2) + eps) * weight

No mean subtraction and no bias, unlike LayerNorm. The statistics are taken in fp32 even when the
model runs in bf16: a sum of 4096 squares in bf16 loses most of its digits.

Every decoder layer does `residual += x; x = norm(residual)`; passing the residual in fuses the two,
as vLLM does. On a GPU both happen in one pass over memory in chapter 04's Triton kernel
(`minillm.kernels.rms_norm`); the PyTorch reference beside it is what runs on a CPU.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..kernels import rms_norm as _kernel
from ..kernels import skinny_gemm as _skinny
from .backend import use_triton
from .quantization.base import UnquantizedLinearMethod

# Chapter 13's fused decode layer: RMSNorm inside the next projection's kernel for <= 8 tokens
# (norm_linear below), on with MINILLM_SKINNY_GEMM=1 (or set_skinny_gemm(True)). Off by default until a
# GPU run shows the graphed step faster with it than with cuBLAS (scripts/gpu/fused_decode.sh bench).
_skinny_on = os.environ.get("MINILLM_SKINNY_GEMM", "0") == "1"


def set_skinny_gemm(on: bool) -> None:
    global _skinny_on
    _skinny_on = bool(on)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x: [..., hidden]. With residual: returns (norm(x + residual), x + residual).
        if not use_triton(x):
            return _kernel.rms_norm_ref(x, self.weight, self.eps, residual)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [rows, hidden]: the kernel normalises rows
        if residual is None:
            return _kernel.rms_norm(x2, self.weight, self.eps).view(shape)
        out, residual = _kernel.rms_norm(x2, self.weight, self.eps, residual.reshape(-1, shape[-1]))
        return out.view(shape), residual.view(shape)


def fuses_into(norm: RMSNorm, linear: nn.Module, x: torch.Tensor) -> bool:
    """Whether norm_linear can run norm -> linear as one skinny-GEMM kernel: a few tokens (a decode
    step), the Triton path, an unquantized linear in x's dtype, and no forward pre-hooks (calibration
    reads the linear's input from them)."""
    x2 = x.reshape(-1, x.shape[-1])
    return (_skinny_on and use_triton(x) and 1 <= x2.shape[0] <= _skinny.MAX_M
            and type(getattr(linear, "quant_method", None)) is UnquantizedLinearMethod
            and not getattr(linear, "gather_output", False)
            and linear.weight.dtype == norm.weight.dtype == x.dtype
            and not norm._forward_pre_hooks and not linear._forward_pre_hooks)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, linear: nn.Module,
                silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """linear(norm(x + residual)) [T, out] (silu_mul: SwiGLU's silu(gate) * up of it, [T, out / 2]),
    and the residual stream's next value x + residual (x itself when residual is None); one launch
    (`minillm.kernels.skinny_gemm`). Callers check fuses_into first."""
    x2 = x.reshape(-1, x.shape[-1])  # [T, hidden]
    res2 = None if residual is None else residual.reshape(x2.shape).contiguous()
    result = _skinny.skinny_gemm(x2, linear.weight, linear.bias, norm_weight=norm.weight, eps=norm.eps,
                                 residual=res2, silu_mul=silu_mul)
    return result if residual is not None else (result, x)  # with a residual: (out, x + residual) already
