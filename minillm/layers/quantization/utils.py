"""Round-to-nearest (RTN) quantizers for the weight-only formats, and how to measure what they cost.

A weight matrix W [N, K] (N output channels, K inputs) is cut into pieces that share one scale:

    int8, per output channel, symmetric:  s_n = max_k |W[n, k]| / 127
                                           q = round(W / s_n) in -127..127,         W ~ q * s_n
    int4, per group of G inputs, asymmetric (min-max, llama.cpp's Q4_1 rule):
                                           s = (max - min) / 15 and m = min over the group
                                           q = round((W - m) / s) in 0..15,         W ~ q * s + m

Symmetric int8 spends no bits on an offset: a row's weights straddle 0, and 255 levels are plenty.
Four bits leave 16 levels, so int4 takes the group's own range [min, max] (an asymmetric range wastes
no level on values the group does not have) and small groups (32-128 weights) so that one outlier
widens the steps of few weights. Each rounding moves a weight by at most half a step.

Scales and mins are rounded to the model's dtype *before* q is computed, so q is the nearest level of
the grid the kernel will actually use. The kernel layout (packing, dequantization) is
`minillm.kernels.w4a16`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.w4a16 import pack_int4
from ..linear import LinearBase


def quantize_int8(w: torch.Tensor, dtype: torch.dtype | None = None,
                  amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q int8 [N, K], scales [N] in `dtype`, default W's): symmetric, per output channel.
    amax [N]: each row's largest |w| when W is only part of the rows (a tensor-parallel shard)."""
    wf = w.float()
    scales = ((wf.abs().amax(dim=1) if amax is None else amax.float()) / 127).to(dtype or w.dtype)  # [N]
    s = scales.float().clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero row: any scale, q = 0
    q = torch.round(wf / s[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group_size: int,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (qweight uint8 [N, K/2] packed, scales [N, K/G], mins [N, K/G]): min-max per group."""
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"int4 group_size {group_size} must divide the weight's {K} input features")
    wg = w.float().view(N, K // group_size, group_size)  # [N, groups, G]
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, groups]
    dtype = dtype or w.dtype
    scales, mins = ((hi - lo) / 15).to(dtype), lo.to(dtype)
    s = scales.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # a constant group: q = 0
    q = torch.round((wg - mins.float()[..., None]) / s).clamp_(0, 15)  # [N, groups, G]
    return pack_int4(q.view(N, K)), scales, mins


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|ref|^2 / |ref - approx|^2). Each 6 dB is about
    one bit; torchao asks >= 20 dB of a quantized linear layer's output."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    return float("inf") if noise == 0 else (10 * torch.log10(ref.pow(2).sum() / noise)).item()


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters: {"linear": the linear layers' (weights, scales, biases),
    "other": embeddings, norms, ... , "total"}. A tied tensor counts once."""
    linear = {id(p) for m in model.modules() if isinstance(m, LinearBase) for p in m.parameters()}
    out = {"linear": 0, "other": 0}
    for p in model.parameters():  # yields a shared tensor once
        out["linear" if id(p) in linear else "other"] += p.numel() * p.element_size()
    out["total"] = out["linear"] + out["other"]
    return out


def matmul_rows(x: torch.Tensor, bias: torch.Tensor | None, matmul) -> torch.Tensor:
    """x [..., in] -> [..., out] through matmul(x2 [T, in]) -> [T, out], x2 with a contiguous last dim as the
    kernels take it, plus bias: what every weight-only method's apply does around its product."""
    x2 = x.reshape(-1, x.shape[-1])  # [T, in]
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    y = matmul(x2)  # [T, out]
    y = y if bias is None else y + bias
    return y.view(*x.shape[:-1], y.shape[-1])
