"""RMSNorm (Zhang & Sennrich, 2019): scale each vector to unit root-mean-square, then by a learned gain.

    y = x / sqrt(mean(x^2) + eps) * weight

No mean subtraction and no bias, unlike LayerNorm. The statistics are taken in fp32 even when the
model runs in bf16: a sum of 4096 squares in bf16 loses most of its digits.

Every decoder layer does `residual += x; x = norm(residual)`; passing the residual in fuses the two,
as vLLM does (and as the Triton kernel of chapter 04 will, in one pass over memory).
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x: [..., hidden]. With residual: returns (norm(x + residual), x + residual).
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)
