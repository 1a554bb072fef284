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
# # Lab 04 · The online softmax and a FlashAttention tile
#
# FlashAttention never holds a full row of attention scores. It walks the keys tile by tile and keeps,
# per query row, three running numbers: the largest score so far $m$, the sum $\ell$ of
# $e^{s - m}$ so far, and the output so far, $\text{acc} = \sum e^{s - m} v$. When a tile raises the
# maximum from $m$ to $m'$, everything accumulated is rescaled by $e^{m - m'}$:
#
# $$m' = \max(m, \max_j s_j), \qquad \ell' = \ell\, e^{m - m'} + \sum_j e^{s_j - m'}, \qquad
# \text{acc}' = \text{acc}\, e^{m - m'} + \sum_j e^{s_j - m'} v_j$$
#
# and at the end the output is $\text{acc} / \ell$ (Milakov & Gimelshein, 2018; Dao et al., 2022).
# Exercise 1 writes that update in PyTorch; exercise 2 writes it as the inner loop of a Triton
# kernel, which runs natively on a GPU or in Triton's interpreter on a CPU.

# %%
import math
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from minillm.labs import ch04


# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch04.hint("online_softmax_step", 1)`, then 2, then 3. This lists the exercises:

# %%
ch04.hint()

# %% [markdown]
# ## Exercise 1 — the online-softmax update
#
# `m` and `l` are `[M]`, `acc` is `[M, D]`; `s` is the new tile's scores `[M, N]` and `v` its values
# `[N, D]`. Return the new `(m, l, acc)`. Careful with the first tile, where `m` is $-\infty$:
# $e^{-\infty - m'} = 0$ is what you want, and it is what `torch.exp` gives.

# %%
def online_softmax_step(m, l, acc, s, v):
    ### BEGIN SOLUTION
    m_new = torch.maximum(m, s.amax(dim=1))  # [M]
    alpha = torch.exp(m - m_new)  # [M]: how much the old state shrinks
    p = torch.exp(s - m_new[:, None])  # [M, N]
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v
    ### END SOLUTION


# %% tags=["check"]
ch04.check_online_softmax(online_softmax_step)

# %% [markdown]
# ## Exercise 2 — the inner loop of a FlashAttention tile, in Triton
#
# One program computes `BLOCK_M` query rows of one head against all `seqlen_k` keys (no causal mask
# here). The kernel below loads its queries and sets up the state; write the loop over key tiles of
# `BLOCK_N` rows:
#
# 1. load the tile's K and V (`[BLOCK_N, HEAD_DIM]`, rows `start + offs_n`, masked past `seqlen_k`);
# 2. scores `s = tl.dot(q, tl.trans(k)) * qk_scale` — `qk_scale` already holds
#    $\log_2 e / \sqrt{D}$, so use `tl.exp2` instead of `exp`; set the scores of keys past `seqlen_k`
#    to `-inf`;
# 3. the update of exercise 1 on `m_i`, `l_i`, `acc` (`tl.maximum`, `tl.max(s, 1)`, `tl.sum(p, 1)`,
#    and `tl.dot(p.to(v.dtype), v)`).
#
# Every block dimension is at least 16: on a GPU, `tl.dot` needs that.

# %%
@triton.jit
def attention_tile(Q, K, V, Out, seqlen_q, seqlen_k, qk_scale, stride_q, stride_k, stride_v, stride_o,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's query rows
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * stride_q + offs_d[None, :], mask=offs_m[:, None] < seqlen_q, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    ### BEGIN SOLUTION
    for start in range(0, seqlen_k, BLOCK_N):
        rows = start + offs_n  # [BLOCK_N] key positions of this tile
        inside = rows[:, None] < seqlen_k
        k = tl.load(K + rows[:, None] * stride_k + offs_d[None, :], mask=inside, other=0.0)  # [BLOCK_N, D]
        v = tl.load(V + rows[:, None] * stride_v + offs_d[None, :], mask=inside, other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_M, BLOCK_N], in log2 units
        s = tl.where(rows[None, :] < seqlen_k, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    ### END SOLUTION
    out = acc / l_i[:, None]
    tl.store(Out + offs_m[:, None] * stride_o + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=offs_m[:, None] < seqlen_q)


# %% tags=["check"]
ch04.check_attention_tile(attention_tile)

# %% [markdown]
# minillm's kernel (`minillm/kernels/flash_attn.py`) is this loop plus what an engine needs: many
# heads and sequences in one launch (a grid over query tiles × heads), GQA (a query head reads its
# group's KV head), the causal mask (tiles entirely in the future are skipped, only the diagonal tile
# is masked), queries that start after a cached prefix, and K/V read through a block table.
