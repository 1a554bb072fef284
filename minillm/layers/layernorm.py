"""RMSNorm (Zhang & Sennrich, 2019): scale each vector to unit root-mean-square, then by a learned gain.

    y = x / sqrt(mean(x^2) + eps) * weight

No mean subtraction and no bias, unlike LayerNorm. The statistics are taken in fp32 even when the
model runs in bf16: a sum of 4096 squares in bf16 loses most of its digits.

Every decoder layer does `residual += x; x = norm(residual)`; passing the residual in fuses the two,
as vLLM does. On a GPU both happen in one pass over memory in chapter 04's Triton kernel
(`minillm.kernels.rms_norm`); the PyTorch reference beside it is what runs on a CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import rms_norm as _kernel
from .backend import use_triton


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
