# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 08 · Four bits per weight: groups, AWQ's scales, GPTQ's error feedback
#
# Decode reads every weight once per step, so fewer bits per weight is a faster step. Here you write
# the pieces chapter 08 builds on: the int4 group format itself, the scale search with which AWQ
# protects the weights that meet large activations, the column update with which GPTQ lets the
# weights not yet rounded make up for the ones that were, and the inner loop of a Triton kernel that
# multiplies by the packed int4 weight without ever writing it out dequantized. The checks run your
# functions and minillm's (`layers/quantization/utils.py`, `kernels/w4a16.py`, `awq.py`, `gptq.py`,
# `kernels/w4a16_gemv.py`) on fresh random inputs.

# %%
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from minillm.kernels.w4a16 import dequantize_int4
from minillm.labs import ch08
from minillm.layers.quantization.utils import quantize_int4, sqnr


# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch08.hint("group_quantize", 1)`, then 2, then 3. This lists the exercises:

# %%
ch08.hint()

# %% [markdown]
# ## Exercise 1 — `group_quantize` and `group_dequantize`
#
# Cut each row of $W$ `[N, K]` into groups of $G$ consecutive inputs. Each group gets its own range:
# `mins` $= m = \min$ of the group, `scales` $= s = (\max - \min) / 15$. A weight becomes the nearest
# of the 16 levels $m, m + s, \dots, m + 15 s$:
# $q = \operatorname{round}((w - m) / s)$, clamped to 0..15 (when $s = 0$, divide by the smallest
# positive float instead: every $q$ is then 0). Return `(q, scales, mins)` with `scales` and `mins` of
# shape `[N, K / G]`. Dequantizing is $w \approx q \cdot s + m$, back to `[N, K]`.

# %%
def group_quantize(w, group_size):
    ### BEGIN SOLUTION
    N, K = w.shape
    wg = w.view(N, K // group_size, group_size)  # [N, groups, G]
    mins = wg.amin(dim=-1)
    scales = (wg.amax(dim=-1) - mins) / 15
    s = scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    q = torch.round((wg - mins[..., None]) / s).clamp(0, 15)
    return q.view(N, K).long(), scales, mins
    ### END SOLUTION


def group_dequantize(q, scales, mins, group_size):
    ### BEGIN SOLUTION
    N, K = q.shape
    w = q.view(N, K // group_size, group_size).float() * scales[..., None] + mins[..., None]
    return w.view(N, K)
    ### END SOLUTION


# %% tags=["check"]
ch08.check_group_quantize(group_quantize)
ch08.check_group_dequantize(group_dequantize)

# %% [markdown]
# How much does it cost? The error of a layer's output, in dB of signal over noise (about 6 dB a bit),
# with minillm's own functions (so this cell runs before your exercise does):

# %%
g = torch.Generator().manual_seed(0)
w, x = torch.randn(256, 512, generator=g) * 0.05, torch.randn(64, 512, generator=g)
for G in (32, 64, 128):
    wq = dequantize_int4(*quantize_int4(w, G), G)
    print(f"group {G:3}: {4 + 32 / G:.2f} bits per weight (bf16 scale and min), SQNR {sqnr(x @ w.T, x @ wq.T):.1f} dB")

# %% [markdown]
# ## Exercise 2 — AWQ's scale search on one layer
#
# A few input channels carry activations far larger than the rest. Multiply input channel $k$ of $W$ by
# $s_k$ (and divide the input by $s_k$: $x W^\top$ is unchanged) and the weights that meet large
# activations are rounded on a finer grid relative to their size. AWQ takes
# $s = \overline{|x|}^{\,\alpha}$ (the mean of $|x|$ over the tokens, per channel), divided by
# $\sqrt{\max(s) \min(s)}$, and tries $\alpha = 0, 0.05, \dots, 0.95$ (`ch08.ALPHAS`). For each it
# rounds $W s$ with your `group_quantize`, dequantizes, divides by $s$ again and measures the mean
# squared error of the layer's output, $\operatorname{mean}((x \hat W^\top - x W^\top)^2)$, on the
# inputs `x` `[T, K]`. Return the best `(s, alpha)` (clamp $\overline{|x|}$ to at least $10^{-4}$ before
# the power; on a tie the smaller $\alpha$ wins).

# %%
ALPHAS = [i / 20 for i in range(20)]


def awq_scale(x, w, group_size):
    ### BEGIN SOLUTION
    x_mean = x.abs().mean(dim=0).clamp_min(1e-4)
    y = x @ w.T
    best = None
    for alpha in ALPHAS:
        s = x_mean ** alpha
        s = s / (s.max() * s.min()).sqrt()
        wq = group_dequantize(*group_quantize(w * s, group_size), group_size) / s
        err = ((x @ wq.T - y) ** 2).mean().item()
        if best is None or err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]
    ### END SOLUTION


# %% tags=["check"]
ch08.check_awq_scale(awq_scale)

# %% [markdown]
# ## Exercise 3 — one GPTQ column update
#
# GPTQ rounds the columns of $W$ one at a time, and moves the columns not rounded yet so that the
# layer's output on the calibration inputs changes as little as possible. With $H = 2 X^\top X$ and
# $U$ the upper Cholesky factor of $H^{-1}$ ($H^{-1} = U^\top U$), rounding column $i$ to `wq` gives
#
# $$\text{err} = \frac{W_{:,i} - \text{wq}}{U_{ii}}, \qquad W_{:,j} \mathrel{-}= \text{err} \cdot U_{ij}
# \quad \text{for } j \ge i,$$
#
# which leaves column $i$ exactly at `wq` and spreads its error over the later columns (the earlier
# ones are already rounded: $U$ is upper triangular). Return `(W_new, err)` for a block `W` `[N, B]`,
# its `U` `[B, B]`, the column `i` and its rounded value `wq` `[N]`.

# %%
def gptq_update(W, U, i, wq):
    ### BEGIN SOLUTION
    err = (W[:, i] - wq) / U[i, i]
    W = W.clone()
    W[:, i:] -= err[:, None] * U[i, i:][None, :]
    return W, err
    ### END SOLUTION


# %% tags=["check"]
ch08.check_gptq_update(gptq_update)

# %% [markdown]
# ## Exercise 4 — the W4A16 GEMV's inner loop, in Triton
#
# A decode step multiplies one row of activations $x$ `[K]` by every weight: $y_n = \sum_k x_k W_{nk}$,
# with $W$ stored as exercise 1's groups, packed two weights a byte (`kernels/w4a16.pack_int4`):
# `qweight` is `uint8` `[N, K / 2]`, and byte $b$ of a row holds $q$ of $k = 2b$ in its low 4 bits
# and of $k = 2b + 1$ in its high 4; `scales` and `mins` are `[N, K / G]`, and $W = q s + m$. The
# kernel below runs one program per row of `x` (up to 4 rows) and `BLOCK_N` rows of $W$, and its loop
# takes one group (`GROUP` $= G$ weights, `GROUP // 2` bytes a row) a step. Write the loop's body:
#
# 1. load the group's bytes, a `[BLOCK_N, GROUP // 2]` `uint8` tile at `w_rows + cols[None, :]`
#    (mask the rows past `N`: `n_ok`), and split them: `packed & 0xF` is $q$ of the even $k$,
#    `packed >> 4` of the odd ones;
# 2. load the `x` they meet, at `x_row + 2 * cols` (even $k$) and `+ 1` (odd), and the group's scale
#    and min of each row (`S + offs_n * stride_sn + g`, `Mins` alike);
# 3. dequantize, $q s + m$ (or apply $s$ and $m$ to the group's sums: $\sum x (q s + m) =
#    s \sum x q + m \sum x$), multiply by `x` and add the row sums (`tl.sum(..., axis=1)`) to `acc`.
#
# Compute in fp32 (`.to(tl.float32)` on what you load): the weight is never rounded to `x`'s dtype,
# and `y` is rounded once, at the store. The check compares your kernel with minillm's own GEMV
# (`kernels/w4a16_gemv.py`) and with the fp32 product, within what fp32 rounding allows
# (`ch08.gemv_tolerance`), on random $M \le 4$, odd $N$ and 2 to 4 groups of 32, 64 or 128.

# %%
@triton.jit
def w4a16_gemv(X, QW, S, Mins, Y, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
               GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)  # this program's row of x and of y
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output channels = rows of W
    n_ok = offs_n < N
    offs_b = tl.arange(0, GROUP // 2)  # [GROUP / 2] a group's bytes in a row of qweight
    x_row = X + row * stride_xm
    w_rows = QW + offs_n[:, None] * stride_qn  # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(0, K // GROUP):  # one group a step
        cols = g * (GROUP // 2) + offs_b  # [GROUP / 2] its byte columns: k = 2 * cols and 2 * cols + 1
        ### BEGIN SOLUTION
        packed = tl.load(w_rows + cols[None, :], mask=n_ok[:, None], other=0)  # [BLOCK_N, GROUP / 2] uint8
        s = tl.load(S + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]  # [BLOCK_N, 1]
        m = tl.load(Mins + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        x_even = tl.load(x_row + 2 * cols).to(tl.float32)[None, :]  # [1, GROUP / 2]
        x_odd = tl.load(x_row + 2 * cols + 1).to(tl.float32)[None, :]
        w_even = (packed & 0xF).to(tl.float32) * s + m  # [BLOCK_N, GROUP / 2], fp32
        w_odd = (packed >> 4).to(tl.float32) * s + m
        acc += tl.sum(w_even * x_even + w_odd * x_odd, axis=1)  # [BLOCK_N]
        ### END SOLUTION
    tl.store(Y + row * stride_ym + offs_n, acc.to(Y.dtype.element_ty), mask=n_ok)


# %% tags=["check"]
ch08.check_w4a16_gemv(w4a16_gemv)

# %% [markdown]
# ## What you built
#
# `group_quantize` is minillm's `int4` method (`utils.quantize_int4`), the format the W4A16 kernel
# (`kernels/w4a16.py`) dequantizes in registers. `awq_scale` is `awq.search_scale`; AWQ then folds
# $1/s$ into the RMSNorm before `qkv_proj` and `gate_up_proj`, into v's rows for `o_proj` and into
# up's rows for `down_proj`, so the division costs nothing at run time. `gptq_update` is the inner
# step of `gptq.gptq_quantize`, which runs it for every column, in blocks of 128 with one matrix
# product per block for the columns beyond it. Both methods write the same int4 groups as
# round-to-nearest: they change which levels the weights land on, not how they are stored.
# `minillm quantize --method awq --out DIR` runs them on the whole model. `w4a16_gemv` is
# `kernels/w4a16_gemv.py` without its tricks: that kernel reads the bytes as int32 (8 weights at a
# time), makes $1 + q/16$ from the bits instead of converting $q$, folds the min into one term per 8
# weights, and splits $K$ over several programs when $N$ alone gives too few to fill the GPU. The
# engine runs tensor-core kernels at decode by default (`kernels/w4a16_swap.py`; `w4a16.GEMV_M`
# switches the GEMV on): chapter 08 measures why.
