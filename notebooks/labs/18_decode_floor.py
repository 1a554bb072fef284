# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 18 · The split-K GEMV and its RMSNorm prologue
#
# At batch 1 a decode projection $y = \text{norm}(x)\,W^\top$ is a read of $W$, and to read it at the
# copy bandwidth the work is cut into many small tiles, over the output columns *and* over K (split-K),
# so that every SM has bytes in flight from the first microsecond. Here you write the part of chapter
# 18's GEMV (`kernels/gemv.py`) that every program runs: one tile of $W$ times one row of $x$, with the
# RMSNorm folded in by linearity,
#
# $$\text{norm}(x)\,W^\top = r \cdot \big((x \odot g)\,W^\top\big), \qquad r = \Big(\tfrac{1}{K}\textstyle\sum_k x_k^2 + \varepsilon\Big)^{-1/2},$$
#
# so each program also adds up its slice's $x_k^2$. The lab's `ch18.split_k_gemv` launches your kernel
# and finishes as the GEMV's last-arriving program does: the partial sums added in split order
# $s = 0, 1, \dots$, times $r$, then the bias, SiLU·mul and residual epilogues. The check compares it
# with the unfused PyTorch ops on fresh random shapes, checks that a row gives the same bits alone and
# in a batch, and then runs a tiny model's decode steps through your kernel inside the engine.

# %%
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from minillm.labs import ch18

# %% [markdown]
# Stuck? The exercise has three hints, from a nudge to a near-solution: run `ch18.hint("gemv_partials", 1)`,
# then 2, then 3. This lists the exercises:

# %%
ch18.hint()

# %% [markdown]
# ## Exercise — `gemv_partials`
#
# The grid is `(cdiv(N, BLOCK_N), cdiv(K, BLOCK_K), M)`: program `(n, s, m)` owns columns
# `n*BLOCK_N ...` of the output, the K slice `s*BLOCK_K ...` and row `m` of `x` (`M` rows in all,
# `tl.num_programs(2)`). It must
#
# 1. load its `[BLOCK_N, BLOCK_K]` tile of `W` (`[N, K]`, rows `stride_wn` apart) and its `[BLOCK_K]`
#    slice of row `m` of `X` (rows `stride_xm` apart), masked past `N` and `K` (with `other=0.0`: a
#    masked lane must add nothing), in fp32;
# 2. add up the slice's squares of `x` (the RMSNorm's statistics are of `x`, not of `x * g`);
# 3. with `NORM`, multiply the slice by the gain `G[offs_k]`;
# 4. store the tile's `[BLOCK_N]` partial sums $\sum_k W_{nk} x_k$ at `PART + (s * M + m) * N + offs_n`
#    (`PART` is `[SPLIT, M, N]` fp32), and, from the programs with `n == 0` only, the sum of squares at
#    `SQ + s * M + m` (`SQ` is `[SPLIT, M]`).
#
# A row's numbers must never depend on the other rows: that, and the fixed order of the finish, is what
# makes the result the same alone and in a batch.

# %%
@triton.jit
def gemv_partials(X, W, G, PART, SQ, N, K, stride_xm, stride_wn,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    ### BEGIN SOLUTION
    pid_n, pid_s, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    M = tl.num_programs(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = pid_s * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    n_ok, k_ok = offs_n < N, offs_k < K
    w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
    x = tl.load(X + m * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
    ss = tl.sum(x * x, axis=0)  # the norm's statistics: of x itself
    if NORM:
        x = x * tl.load(G + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    acc = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N]
    tl.store(PART + (pid_s * M + m) * N + offs_n, acc, mask=n_ok)
    if pid_n == 0:
        tl.store(SQ + pid_s * M + m, ss)
    ### END SOLUTION


# %% tags=["check"]
ch18.check_gemv_partials(gemv_partials)

# %% [markdown]
# **Going further.** `kernels/gemv.py` does the finish on the GPU, in the same launch: each program
# counts itself in on a per-column-tile counter (`tl.atomic_add`, `sem="acq_rel"`), and the one that
# arrives last adds the partials in split order. Why must it read them with `cache_modifier=".cg"`?
# And why may it load its tile of `W` *before* `gdc_wait()` under PDL, but not read `x`?
