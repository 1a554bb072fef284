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
# # Lab 13 · The fast path
#
# Two pieces of chapter 13. First a fusion: the residual add and the RMSNorm that every decoder layer
# runs twice, as one Triton kernel that reads each row once — checked against minillm's own `RMSNorm`
# layer called as the model calls it, `norm(x, residual)`. Then the price of overlap scheduling: the
# host launches step N+1 before it has seen step N's tokens, so a request that stops learns it one step
# late — checked against minillm's overlapped engine itself.

# %%
import os

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from minillm.labs import ch13
from minillm.labs.ch13 import Request

# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch13.hint("add_rms_norm", 1)`, then 2, then 3. This lists the exercises:

# %%
ch13.hint()

# %% [markdown]
# ## Exercise 1 — residual add + RMSNorm in one kernel
#
# For each row of `x` and `residual` (`[T, H]`, contiguous) compute
#
# $$r' = x + r, \qquad \text{out} = w \odot \frac{r'}{\sqrt{\tfrac{1}{H}\sum_j r_j'^2 + \varepsilon}}$$
#
# and store both: `out` is what the next projection reads, $r'$ the residual the layer carries on.
# One program per row, the whole row in one tile of `BLOCK` lanes (the next power of two $\ge H$, so
# mask the lanes past `H`). Round as the layer does: the sum $r'$ in `x`'s dtype (add in fp32, round
# once) — it is both the new residual and what you normalise; the statistics in fp32; the normalised
# row rounded to `x`'s dtype before the weight multiplies it. The check launches your kernel as
# `kernel[(T,)](x, residual, weight, out, new_residual, H, eps, BLOCK=...)` on random rows of odd
# widths (1, 7, 33, 129, 576, ...): fp32 in the interpreter on a CPU, bf16 natively on a GPU.

# %%
@triton.jit
def add_rms_norm(X, R, W, OUT, NEW_RES, H, eps, BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < H
    base = row.to(tl.int64) * H
    x = tl.load(X + base + cols, mask=mask, other=0.0)
    r = tl.load(R + base + cols, mask=mask, other=0.0)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the new residual, rounded once
    tl.store(NEW_RES + base + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / H  # masked lanes are 0: divide by H, not BLOCK
    y = (xf * tl.rsqrt(mean_sq + eps)).to(x.dtype)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(OUT + base + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)
    ### END SOLUTION


# %% tags=["check"]
ch13.check_add_rms_norm(add_rms_norm)

# %% [markdown]
# ## Exercise 2 — the one-step-late finish rule
#
# With overlap scheduling (`async_scheduling=True`) the engine runs, in one `step()`: schedule and
# launch step N+1, *then* wait for step N's tokens and do N's bookkeeping. A request's token of step N
# is still on the GPU when step N+1 is scheduled, so:
#
# - if that token is a **stop token**, the request was already given step N+1: that row is computed
#   and thrown away;
# - but the host can *count*: when step N's token is certainly the last one (the request reaches
#   `max_tokens` with it), the request gets no step N+1, and nothing is wasted.
#
# Which token a request samples at its $j$-th step never depends on the batch or on overlap (chapters
# 07 and 13 prove it), so a request is described by its stream: `Request(tokens, max_tokens,
# stop_token_ids)`, `tokens` being what it samples at output positions 0, 1, 2, ... (longer than it
# will keep). Return `(kept, wasted)`: `kept[i]`, the tokens request `i` ends with (a stop token is
# kept, as in vLLM), and `wasted[i]`, how many rows the engine sampled for it and threw away. The check
# runs the same requests through minillm's `LLMEngine` with overlap on, on a tiny random model, and
# counts the rows each step in flight sampled.

# %%
def finish_one_step_late(requests: list[Request]) -> tuple[list[list[int]], list[int]]:
    ### BEGIN SOLUTION
    kept, wasted = [], []
    for r in requests:
        out = []
        for t in r.tokens:
            out.append(t)
            if t in r.stop_token_ids or len(out) == r.max_tokens:
                break
        kept.append(out)
        # a stop token is seen one step late, unless max_tokens had already ruled the next step out
        wasted.append(1 if len(out) < r.max_tokens else 0)
    return kept, wasted
    ### END SOLUTION


# %% tags=["check"]
ch13.check_finish_one_step_late(finish_one_step_late)

# %% [markdown]
# ## What you built
#
# Exercise 1 is chapter 04's `kernels/rms_norm.py` with its strides and dtype checks taken out: one
# launch and one pass over memory where PyTorch runs about eight kernels. The fused decode layer goes
# further and folds it into the next projection's prologue. Exercise 2 is the cost side of
# `minillm/engine/overlap_steps.py`: at most one thrown-away row per request that ends on a stop token
# (EOS, a stop token or a stop string) and none for one that ends on `max_tokens`, bought with a step
# whose host work runs while the GPU computes. TensorRT-LLM documents the same trade for its overlap
# scheduler.
