"""Checks for lab 08: int4 groups, AWQ's scale search, one GPTQ column update.

Each check draws fresh random weights and activations (a few input channels much larger than the
rest, as in a real model) and compares the student's function with minillm's own:
`layers/quantization/utils.quantize_int4` + `kernels/w4a16.dequantize_int4` (the `int4` format),
`layers/quantization/awq.search_scale`, and `layers/quantization/gptq.column_update`.
"""

from __future__ import annotations

import random

import torch

from ..kernels.w4a16 import dequantize_int4, pack_int4, unpack_int4
from ..layers.quantization.awq import ALPHAS, search_scale
from ..layers.quantization.gptq import column_update, hessian, inverse_cholesky
from ..layers.quantization.utils import quantize_int4
from .checker import check
from .hints import Hints


def _close(got, want) -> bool:
    """Tuples of tensors/floats: same structure, same shapes, values within fp32 rounding."""
    if isinstance(want, tuple):
        return isinstance(got, (tuple, list)) and len(got) == len(want) and all(map(_close, got, want))
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.shape == want.shape and \
            torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-5)
    return isinstance(got, (int, float)) and abs(got - want) <= 1e-6


class _Case(tuple):
    """Case arguments, printed by shape (a failing case names the sizes, not thousands of numbers)."""

    def __repr__(self):
        return "(" + ", ".join(f"tensor{list(a.shape)}" if isinstance(a, torch.Tensor) else repr(a) for a in self) + ")"


def _gen(rng: random.Random) -> torch.Generator:
    return torch.Generator().manual_seed(rng.randrange(2**31))


def _activations(g, T: int, K: int) -> torch.Tensor:
    x = torch.randn(T, K, generator=g)
    x[:, torch.randperm(K, generator=g)[:max(1, K // 16)]] *= 10  # salient channels
    return x


# ---- 1. group quantize / dequantize ------------------------------------------------------------


def _weights(rng):
    g = _gen(rng)
    G = rng.choice([32, 64, 128])
    N, K = rng.randint(1, 12), G * rng.randint(1, 4)
    return _Case((torch.randn(N, K, generator=g) * rng.choice([0.02, 1.0, 30.0]), G))


def reference_group_quantize(w, group_size):
    qweight, scales, mins = quantize_int4(w, group_size, torch.float32)
    return unpack_int4(qweight).to(torch.int64), scales, mins


def check_group_quantize(fn, cases: int = 100):
    """fn(w [N, K] fp32, group_size) -> (q [N, K] integers 0..15, scales [N, K/G], mins [N, K/G])."""

    def student(w, group_size):
        out = fn(w.clone(), group_size)
        if isinstance(out, (tuple, list)) and len(out) == 3 and isinstance(out[0], torch.Tensor):
            return (out[0].to(torch.int64), *out[1:])
        return out

    return check("group_quantize", student, reference_group_quantize, _weights, cases=cases, equal=_close)


def _quantized(rng):
    w, G = _weights(rng)
    q, scales, mins = reference_group_quantize(w, G)
    return _Case((q, scales, mins, G))


def reference_group_dequantize(q, scales, mins, group_size):
    return dequantize_int4(pack_int4(q), scales, mins, group_size, torch.float32)


def check_group_dequantize(fn, cases: int = 100):
    """fn(q [N, K] int64 in 0..15, scales [N, K/G], mins [N, K/G], group_size) -> W [N, K] fp32."""
    return check("group_dequantize", lambda *a: fn(*(t.clone() if isinstance(t, torch.Tensor) else t for t in a)),
                 reference_group_dequantize, _quantized, cases=cases, equal=_close)


# ---- 2. AWQ's scale search on one layer --------------------------------------------------------


def _layer(rng):
    g = _gen(rng)
    G = rng.choice([32, 64])
    K, N = G * rng.randint(1, 3), rng.randint(4, 24)
    return _Case((_activations(g, rng.randint(16, 64), K), torch.randn(N, K, generator=g) * 0.1, G))


def reference_awq_scale(x, w, group_size):
    s, alpha, _ = search_scale(x, w, group_size, alphas=ALPHAS)
    return s, float(alpha)


def check_awq_scale(fn, cases: int = 20):
    """fn(x [T, K], w [N, K], group_size) -> (s [K], alpha): the best of ALPHAS = 0, 0.05, ..., 0.95."""

    def student(x, w, group_size):
        out = fn(x.clone(), w.clone(), group_size)
        return (out[0], float(out[1])) if isinstance(out, (tuple, list)) and len(out) == 2 else out

    return check("awq_scale", student, reference_awq_scale, _layer, cases=cases, equal=_close)


# ---- 3. one GPTQ column update -----------------------------------------------------------------


def _block(rng):
    g = _gen(rng)
    N, B = rng.randint(1, 16), rng.randint(2, 24)
    U = inverse_cholesky(hessian(_activations(g, 4 * B, B)), 0.01)  # [B, B] upper triangular
    W = torch.randn(N, B, generator=g)
    i = rng.randrange(B)
    wq = torch.round(W[:, i] * 4) / 4  # some rounded value of column i
    return _Case((W, U, i, wq))


def reference_gptq_update(W, U, i, wq):
    W = W.clone()
    err = column_update(W, U, i, wq)
    return W, err


def check_gptq_update(fn, cases: int = 100):
    """fn(W [N, B], U [B, B], i, wq [N]) -> (W after the update [N, B], err [N])."""
    return check("gptq_update", lambda W, U, i, wq: fn(W.clone(), U.clone(), i, wq.clone()),
                 reference_gptq_update, _block, cases=cases, equal=_close)


hint = Hints("08", {
    "group_quantize": (
        'Each group of group_size weights in a row gets its own scale and minimum; 4 bits give the values 0..15.',
        "View w as [N, K/G, G]. min = the group's minimum, scale = (max - min) / 15 (never 0: clamp it to a tiny positive number), q = round((w - min) / scale) clamped to 0..15.",
        'wg = w.view(N, K // G, G); mins = wg.amin(-1); scales = (wg.amax(-1) - mins) / 15\nq = torch.round((wg - mins[..., None]) / scales.clamp_min(tiny)[..., None]).clamp(0, 15)\nreturn q.view(N, K).long(), scales, mins',
    ),
    "group_dequantize": (
        "Undo exercise 1 group by group: the stored integer times the group's scale plus its minimum.",
        'View q as [N, K/G, G] so that scales[..., None] and mins[..., None] broadcast over each group.',
        'w = q.view(N, K // G, G).float() * scales[..., None] + mins[..., None]\nreturn w.view(N, K)',
    ),
    "awq_scale": (
        'AWQ scales each input channel by s before quantizing and divides it back after, so channels that carry large activations keep more precision.',
        'For each alpha in ALPHAS: s = mean|x|^alpha per input channel, normalized by sqrt(max(s) * min(s)); quantize and dequantize w * s, divide by s, and measure the mean squared error of x @ wq.T against x @ w.T. Keep the best (s, alpha); the first on a tie.',
        'for alpha in ALPHAS:\n    s = x_mean ** alpha; s = s / (s.max() * s.min()).sqrt()\n    wq = group_dequantize(*group_quantize(w * s, G), G) / s\n    err = ((x @ wq.T - y) ** 2).mean().item()',
    ),
    "gptq_update": (
        'GPTQ quantizes column i, then spreads its error over the columns not yet quantized.',
        "err = (W[:, i] - wq) / U[i, i] with U the upper Cholesky factor of the inverse Hessian; every later column j >= i moves by -err * U[i, j]. Do not modify the caller's W in place.",
        'err = (W[:, i] - wq) / U[i, i]\nW = W.clone(); W[:, i:] -= err[:, None] * U[i, i:][None, :]\nreturn W, err',
    ),
})
