"""AWQ (Lin et al., 2023): scale up the weights that meet large activations, then round to nearest.

    LLM(quantization={"method": "awq", "group_size": 64})      # calibrates at load on the corpus

A few input channels of a layer carry activations far larger than the rest; the weights that
multiply them matter most, and rounding them costs the output most. Multiplying input channel k of
W by s_k > 1 (and dividing the activation by s_k, so x W^T is unchanged) shrinks that weight's
rounding error relative to its value. With s = mean|x|^alpha (per channel, normalized so that the
largest and smallest scale multiply to 1), alpha is searched on a grid (0, 0.05, ..., 0.95) for the
smallest output error of the rounded layer on calibration inputs:

    err(alpha) = || x W^T - (x / s) Q(W * s)^T ||^2         Q: round-to-nearest int4 groups

alpha = 0 is plain round-to-nearest (s = 1), so the search never does worse on its own data.

The division by s costs nothing at run time when it is folded into what produces x:
  - qkv_proj and gate_up_proj read an RMSNorm's output: the norm's weight is divided by s.
  - o_proj reads attention's output, a mix of v's rows: v's rows of qkv_proj are divided by s. With
    grouped-query attention, one v channel feeds `num_heads / num_kv_heads` query heads' channels of
    o_proj's input, so those channels share one scale (the search averages their mean|x|).
  - down_proj reads silu(gate) * up: up's rows of gate_up_proj are divided by s.
Every fold is exact in full precision; the folds happen before any layer of the block is rounded.

Then each group's range is clipped (`clip=True`): per output row and group, the range is shrunk
toward 0 by a factor from 1.0 down to 0.5 where that lowers the group's share of the output error
on calibration inputs (an outlier weight otherwise stretches every step of its group).
"""

from __future__ import annotations

import torch

from ...kernels.w4a16 import dequantize_int4
from .calibration import (
    CalibratedConfig,
    block_linears,
    check_divides,
    group_range,
    quantize_with_range,
)
from .int4 import become_int4
from .utils import quantize_int4

ALPHAS = tuple(i / 20 for i in range(20))  # 0, 0.05, ..., 0.95
CLIP_RATIOS = tuple(1 - i / 20 for i in range(11))  # 1.0, 0.95, ..., 0.5


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """W [N, K] -> round-to-nearest int4 groups, dequantized (fp32)."""
    return dequantize_int4(*quantize_int4(w.float(), group_size), group_size, torch.float32)


def awq_scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """mean|x| per input channel [K] -> s [K] = mean|x|^alpha, normalized to max(s) * min(s) = 1."""
    s = x_mean.float().clamp_min(1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def search_scale(x: torch.Tensor, w: torch.Tensor, group_size: int, tie=None,
                 alphas=ALPHAS) -> tuple[torch.Tensor, float, list[float]]:
    """Inputs x [T, K], weight W [N, K] -> (best s [K], its alpha, the error for every alpha).

    tie: a function [K] -> [K] that averages mean|x| over channels that must share one scale."""
    x, w = x.float(), w.float()
    x_mean = x.abs().mean(dim=0)  # [K]
    if tie is not None:
        x_mean = tie(x_mean)
    y = x @ w.T  # [T, N] the full-precision output
    errors = []
    for alpha in alphas:
        s = awq_scales(x_mean, alpha)  # [K]
        wq = fake_quantize(w * s, group_size) / s  # [N, K] the weight the rounded, scaled layer stands for
        errors.append((x @ wq.T - y).pow(2).mean().item())
    best = min(range(len(alphas)), key=errors.__getitem__)
    return awq_scales(x_mean, alphas[best]), alphas[best], errors


def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int, ratios=CLIP_RATIOS,
                row_chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row and group of W [N, K], the shrink of its range (lo, hi) toward 0 that gives the
    smallest output error sum_t (x_t,g . (w_g - Q(w_g)))^2 on inputs x [T, K]. -> (lo, hi) [N, K/G]."""
    N, K = w.shape
    G = K // group_size
    xg = x.float().view(-1, G, group_size)  # [T, G, gs]
    lo0, hi0 = group_range(w, group_size)  # [N, G]
    best_lo, best_hi = lo0.clone(), hi0.clone()
    for r0 in range(0, N, row_chunk):  # rows in chunks: the [T, rows, G] error tensor stays small
        r1 = min(r0 + row_chunk, N)
        wg = w[r0:r1].float().view(r1 - r0, G, group_size)  # [n, G, gs]
        best_err = torch.full((r1 - r0, G), float("inf"), device=w.device)
        for ratio in ratios:
            lo = torch.where(lo0[r0:r1] < 0, lo0[r0:r1] * ratio, lo0[r0:r1])  # only toward 0: 0 stays in range
            hi = torch.where(hi0[r0:r1] > 0, hi0[r0:r1] * ratio, hi0[r0:r1])
            s = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)[..., None]
            dq = torch.round((wg.clamp(lo[..., None], hi[..., None]) - lo[..., None]) / s).clamp(0, 15) * s + lo[..., None]
            err = torch.einsum("tgk,ngk->tng", xg, wg - dq).pow(2).sum(dim=0)  # [n, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo[r0:r1] = torch.where(better, lo, best_lo[r0:r1])
            best_hi[r0:r1] = torch.where(better, hi, best_hi[r0:r1])
    return best_lo, best_hi


def _gqa_tie(num_heads: int, num_kv_heads: int, head_dim: int):
    """o_proj's input channels (head h, dim d) that read the same v channel (h // rep, d) share a scale."""
    rep = num_heads // num_kv_heads

    def tie(v: torch.Tensor) -> torch.Tensor:  # [num_heads * head_dim]
        per_kv = v.view(num_kv_heads, rep, head_dim).mean(dim=1)  # [Hkv, D]
        return per_kv[:, None, :].expand(num_kv_heads, rep, head_dim).reshape(-1)

    return tie, rep


class AWQConfig(CalibratedConfig):
    """int4 groups after AWQ's activation-aware scaling. Options: group_size (32, 64, 128), clip,
    max_rows (calibration rows the searches use), and num_sequences x seq_len (None: 16 x 256 on
    a CPU, 64 x 512 on a GPU) or path (a result saved by `minillm quantize`)."""

    name = "awq"
    options = ("group_size", "clip", "max_rows", "num_sequences", "seq_len", "path")

    def __init__(self, group_size: int = 128, clip: bool = True, max_rows: int = 512,
                 num_sequences: int | None = None, seq_len: int | None = None, path=None):
        if not isinstance(clip, bool):
            raise ValueError(f"quantization 'awq' clip must be True or False, not {clip!r}")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"quantization 'awq' max_rows must be a positive int, not {max_rows!r}")
        self.clip, self.max_rows = clip, max_rows
        super().__init__(group_size, num_sequences, seq_len, path)

    def quantize_block(self, block, inputs):
        layers = block_linears(block)
        for layer in layers.values():
            check_divides(self.name, layer, layer.weight.shape[1], self.group_size)
        # the searches look at an even subsample of the calibration tokens: their cost is rows x N x K
        rows = {n: x[torch.linspace(0, len(x) - 1, min(len(x), self.max_rows)).long()] for n, x in inputs.items()}
        attn = block.self_attn
        tie, _ = _gqa_tie(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        scales = {name: search_scale(rows[name], layer.weight, self.group_size,
                                     tie=tie if name == "o_proj" else None)[0] for name, layer in layers.items()}
        fold_scales(block, scales)
        for name, layer in layers.items():
            w = layer.weight.data.float()  # [N, K], already multiplied by s
            x = rows[name] / scales[name]  # [T, K]: what the layer reads after the folds
            lo, hi = search_clip(x, w, self.group_size) if self.clip else group_range(w, self.group_size)
            become_int4(layer, quantize_with_range(w, self.group_size, lo, hi, layer.weight.dtype), self.group_size)


def fold_scales(block, scales: dict[str, torch.Tensor]) -> None:
    """Multiply each linear layer's input channels by its s [K] and divide what produces its input by
    the same s: the block computes the same function (in full precision), with the salient weights
    larger. scales: {"qkv_proj", "o_proj" (GQA-tied), "gate_up_proj", "down_proj"}."""
    layers = block_linears(block)
    attn = block.self_attn
    qkv, gate_up, down = layers["qkv_proj"], layers["gate_up_proj"], layers["down_proj"]
    v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
    s_v = scales["o_proj"].view(attn.num_kv_heads, -1, attn.head_dim)[:, 0, :].reshape(-1)  # [Hkv * D]
    inter = down.weight.shape[1]
    up_rows = slice(inter, 2 * inter)
    block.input_layernorm.weight.data /= scales["qkv_proj"].to(block.input_layernorm.weight.dtype)
    block.post_attention_layernorm.weight.data /= scales["gate_up_proj"].to(block.post_attention_layernorm.weight.dtype)
    for layer, rows, s in ((qkv, v_rows, s_v), (gate_up, up_rows, scales["down_proj"])):
        layer.weight.data[rows] /= s.to(layer.weight.dtype)[:, None]  # these rows produce the next layer's input
        if layer.bias is not None:
            layer.bias.data[rows] /= s.to(layer.bias.dtype)
    for name, layer in layers.items():
        layer.weight.data *= scales[name].to(layer.weight.dtype)[None, :]
