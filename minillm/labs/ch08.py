"""Checks for lab 08: int4 groups, AWQ's scale search, one GPTQ column update, the W4A16 GEMV's loop.

Each check draws fresh random weights and activations (a few input channels much larger than the
rest, as in a real model) and compares the student's function with minillm's own:
`layers/quantization/utils.quantize_int4` + `kernels/w4a16.dequantize_int4` (the `int4` format),
`layers/quantization/awq.search_scale`, `layers/quantization/gptq.column_update`, and the decode
GEMV `kernels/w4a16_gemv.w4a16_gemv` (with the fp32 product `w4a16_gemv_ref`). The GEMV check runs
the student's Triton kernel natively on a CUDA GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1,
set before triton is imported) elsewhere.
"""

from __future__ import annotations

import os
import random
from typing import NamedTuple

import torch

from ..kernels.w4a16 import dequantize_int4, pack_int4, unpack_int4
from ..kernels.w4a16_gemv import MAX_ROWS, w4a16_gemv, w4a16_gemv_ref
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


# ---- 4. the W4A16 GEMV's inner loop, in Triton -------------------------------------------------------


def launch_w4a16_gemv(kernel, x, qweight, scales, mins, group_size: int, BLOCK_N: int = 16):
    """Run kernel over x [M, K] (M <= 4) and the int4 weight -> y [M, N] in x's dtype, one program per
    row of x and BLOCK_N output channels.

    The kernel's arguments: X, QW (uint8 [N, K/2], pack_int4's layout), S, Mins ([N, K/G]), Y pointers,
    N, K, the row strides of x, qweight, scales (mins share them) and y, then GROUP (the group size)
    and BLOCK_N as constexprs."""
    import triton

    M, K = x.shape
    N = qweight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    kernel[(M, triton.cdiv(N, BLOCK_N))](x, qweight, scales, mins, y, N, K, x.stride(0), qweight.stride(0),
                                         scales.stride(0), y.stride(0), GROUP=group_size, BLOCK_N=BLOCK_N)
    return y


UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


class _Expected(NamedTuple):
    """minillm's kernel's y (what a failing case prints), the fp32 reference, and how far from each a
    correct kernel may land, element by element."""

    y: torch.Tensor  # [M, N] minillm's w4a16_gemv, in x's dtype
    ref: torch.Tensor  # [M, N] the fp32 product with the fp32-dequantized weight
    tol_ref: torch.Tensor  # [M, N] allowed |y - ref|
    tol_y: torch.Tensor  # [M, N] allowed |y_student - y|

    def __repr__(self):
        return repr(self.y)


def gemv_tolerance(x, scales, mins, group_size: int, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) [M, N]: a correct kernel lands within T of the exact product, the fp32 reference within E.

    Every term of sum_k x_k W_k, in any form a kernel computes it (q s + m per weight; s and m applied
    to a group's sums of x q and of x; minillm's 16 s f + (m - 16 s) with f < 2), is at most
    |x_k| (48 |s| + |m|) in size, and a few fp32 roundings make it; a sum of such terms in any order,
    along a path of at most K + 16 roundings, errs by at most (K + 16) 2^-24 times the sum of their
    sizes: E. The kernel's fp32 sum is then rounded once to x's dtype (half an ulp, u, of |y| <=
    |ref| + 2 E): T = E + u (|ref| + 2 E)."""
    K = x.shape[1]
    size = (48 * scales.float().abs() + mins.float().abs()).repeat_interleave(group_size, dim=1)  # [N, K]
    E = (K + 16) * 2.0**-24 * (x.float().abs() @ size.t())  # [M, N]
    return E + UNIT_ROUNDOFF[x.dtype] * (ref.abs() + 2 * E), E


def _triton_device(name: str) -> str:
    """'cuda', or 'cpu' where Triton's interpreter was chosen before triton was imported."""
    if torch.cuda.is_available():
        print("running the kernel natively on the GPU")
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{name}: no CUDA GPU: set TRITON_INTERPRET=1 before importing triton (the lab's first "
                           "cell does) so the kernel runs in Triton's CPU interpreter, then restart the kernel")
    print("running the kernel in Triton's CPU interpreter")
    return "cpu"


def check_w4a16_gemv(kernel, cases: int | None = None):
    """kernel: the lab's @triton.jit W4A16 GEMV (see launch_w4a16_gemv), against minillm's w4a16_gemv and
    the fp32 product with the dequantized weight, on random M <= 4, odd N and several groups."""
    device = _triton_device("w4a16_gemv")
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    cases = cases or (40 if device == "cuda" else 10)

    def case(rng: random.Random):
        g = _gen(rng)
        G = rng.choice([32, 64, 128])
        M, N, K = rng.randint(1, MAX_ROWS), 2 * rng.randint(0, 24) + 1, G * rng.randint(2, 4)
        dtype = rng.choice(dtypes)
        q = torch.randint(0, 16, (N, K), generator=g)
        scales = torch.rand(N, K // G, generator=g) * 0.02 + 0.002  # a trained layer's sizes
        mins = -scales * torch.rand(N, K // G, generator=g) * 15  # the group's range [m, m + 15 s] holds 0
        return _Case((_activations(g, M, K).to(device, dtype), pack_int4(q).to(device),
                      scales.to(device, dtype), mins.to(device, dtype), G))

    def student(x, qweight, scales, mins, G):
        return launch_w4a16_gemv(kernel, x, qweight, scales, mins, G)

    def reference(x, qweight, scales, mins, G):
        y = w4a16_gemv(x, qweight, scales, mins, G)
        ref = w4a16_gemv_ref(x.float(), qweight, scales, mins, G)
        T, E = gemv_tolerance(x, scales, mins, G, ref)
        if not bool(((y.float() - ref).abs() <= T + E).all()):  # the bound, held to minillm's kernel first
            raise RuntimeError("minillm's w4a16_gemv is outside the check's rounding bound: a bug in minillm")
        return _Expected(y, ref, T + E, 2 * T)

    def close(got, want: _Expected):
        if not (isinstance(got, torch.Tensor) and got.shape == want.y.shape and got.dtype == want.y.dtype):
            return False
        got = got.float()
        return bool(((got - want.ref).abs() <= want.tol_ref).all() and
                    ((got - want.y.float()).abs() <= want.tol_y).all())

    return check("w4a16_gemv", student, reference, case, cases=cases, equal=close)


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
    "w4a16_gemv": (
        "One step of the loop is one group: GROUP weights of BLOCK_N rows of W, stored in GROUP / 2 bytes a row, "
        "and one scale and one min per row. Byte b of a row holds k = 2b in its low 4 bits and k = 2b + 1 in its high 4.",
        "Load the [BLOCK_N, GROUP / 2] bytes at w_rows + cols[None, :] (mask the rows past N), split them with "
        "packed & 0xF (even k) and packed >> 4 (odd k), and load x at 2 * cols and 2 * cols + 1. Load the group's "
        "scale and min per row (S + offs_n * stride_sn + g), make W = q * s + m in fp32, and add "
        "tl.sum(W * x, axis=1) over both halves to acc.",
        "packed = tl.load(w_rows + cols[None, :], mask=n_ok[:, None], other=0)\n"
        "s = tl.load(S + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]  # Mins alike: m\n"
        "x_even = tl.load(x_row + 2 * cols).to(tl.float32)[None, :]  # x_odd: 2 * cols + 1\n"
        "w_even = (packed & 0xF).to(tl.float32) * s + m  # w_odd: packed >> 4\n"
        "acc += tl.sum(w_even * x_even + w_odd * x_odd, axis=1)",
    ),
})
