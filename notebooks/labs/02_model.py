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
# # Lab 02 · Inside the forward pass, and choosing a token
#
# Write three pieces of a Llama-family model: the rotary position embedding, grouped-query
# attention, and top-p (nucleus) filtering. Each check compares your function with minillm's own
# (`minillm/layers/`, `minillm/sampling/`) on fresh random tensors.

# %%
import torch

from minillm.labs import ch02


# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch02.hint("rope", 1)`, then 2, then 3. This lists the exercises:

# %%
ch02.hint()

# %% [markdown]
# ## Exercise 1 — rotary position embedding
#
# For head dimension $D$, frequencies $\theta_i = \text{base}^{-2i/D}$ for $i < D/2$. A token at
# position $p$ has angles $p\,\theta_i$; duplicate them to length $D$ (`cat([a, a])`) and take
# `cos` and `sin`. Then, with `rotate_half([x1, x2]) = [-x2, x1]` (the two halves of the last
# dimension),
#
# $$x' = x \cos + \text{rotate_half}(x) \sin$$
#
# for every head of `q` (`[T, Hq, D]`) and `k` (`[T, Hkv, D]`). Return `(q', k')`.

# %%
def rope(q, k, positions, base):
    ### BEGIN SOLUTION
    D = q.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))  # [D/2]
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat([angles, angles], dim=-1)  # [T, D]
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]  # [T, 1, D]

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    ### END SOLUTION


# %% tags=["check"]
ch02.check_rope(rope)

# %% [markdown]
# ## Exercise 2 — grouped-query attention
#
# One sequence of $T$ tokens: `q` is `[T, Hq, D]`, `k` and `v` are `[T, Hkv, D]`, and query head
# $h$ uses KV head $h \,//\, (H_q / H_{kv})$. Compute causal attention,
# $\text{softmax}(q k^\top / \sqrt{D} + \text{mask})\,v$ with token $i$ seeing tokens $j \le i$,
# and return it as `[T, Hq * D]`. (Plain PyTorch: `repeat_interleave`, `@`, `softmax`.)

# %%
def gqa_attention(q, k, v):
    ### BEGIN SOLUTION
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [T, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / D**0.5  # [Hq, T, T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(dim=-1), v)  # [T, Hq, D]
    return out.reshape(T, Hq * D)
    ### END SOLUTION


# %% tags=["check"]
ch02.check_gqa_attention(gqa_attention)

# %% [markdown]
# ## Exercise 3 — top-p filtering
#
# Given one row of logits, return probabilities that keep only the smallest set of most likely
# tokens whose total probability reaches `top_p` (a token stays if the tokens ranked above it add
# up to less than `top_p`), renormalised to sum to 1. (Holtzman et al., *The Curious Case of Neural
# Text Degeneration*, 2020.)

# %%
def top_p_filter(logits, top_p):
    ### BEGIN SOLUTION
    probs = logits.softmax(dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass ranked above each token
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return kept / kept.sum()
    ### END SOLUTION


# %% tags=["check"]
ch02.check_top_p(top_p_filter)
