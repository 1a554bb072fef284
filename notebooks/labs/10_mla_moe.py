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
# # Lab 10 · Routing tokens to experts, and absorbing MLA's up-projection
#
# Two small pieces of chapter 10. A mixture-of-experts layer runs, for each token, only the `top_k`
# experts its router scores highest (Shazeer et al., 2017; Mixtral, Jiang et al., 2024). DeepSeek's
# multi-head latent attention caches one latent vector per token and rebuilds every head's key and
# value from it; the *absorbed* form never rebuilds them at all (DeepSeek-V2, 2024). The checks run
# your functions against minillm's own (`minillm/layers/moe.py`, `minillm/kernels/mla_decode.py`) on
# fresh random inputs.

# %%
import torch

from minillm.labs import ch10

torch.manual_seed(0)

# %% [markdown]
# ## Exercise 1 — `route`
#
# `router_logits` is `[T, E]`: one score per token and expert. Turn each row into probabilities with a
# softmax over all $E$ experts, keep the `top_k` largest, and — when `renormalize` is true (Mixtral,
# Qwen3-MoE) — divide the kept probabilities by their sum so that each token's weights add up to 1.
# Without it (DeepSeek-V2) the weights stay the raw probabilities, summing to less than 1. Return
# `(weights [T, top_k], ids [T, top_k])`; the order within a row does not matter.

# %%
def route(router_logits, top_k, renormalize):
    ### BEGIN SOLUTION
    probs = router_logits.float().softmax(dim=-1)  # over all experts, before choosing
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
    ### END SOLUTION


# %% tags=["check"]
ch10.check_route(route)

# %% [markdown]
# ## Exercise 2 — `absorbed_attention`
#
# One new token's attention in one MLA layer. The cache holds, for each of $n$ earlier tokens, the
# latent $c_j$ (`[n, L]`) and the shared rotary key $k^{pe}_j$ (`[n, R]`). Head $h$'s key and value are
#
# $$k_{h,j} = [\,W^{UK}_h c_j,\; k^{pe}_j\,], \qquad v_{h,j} = W^{UV}_h c_j,$$
#
# with `w_uk [H, P, L]` and `w_uv [H, V, L]`; the query is `q_nope [H, P]` and `q_pe [H, R]`. The naive
# way (below) builds all $n \times H$ keys and values. Use instead
# $q^{nope}_h \cdot (W^{UK}_h c_j) = (W^{UK\top}_h q^{nope}_h) \cdot c_j$: fold $W^{UK}_h$ into the
# query once, score against the latents directly, average the *latents* with the softmax weights, and
# only then apply $W^{UV}_h$ (the sum over $j$ and $W^{UV}_h$ commute). Return `[H, V]`.

# %%
def naive_attention(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    H, n = q_nope.shape[0], c.shape[0]
    k = torch.cat((torch.einsum("hpl,nl->hnp", w_uk, c), k_pe.expand(H, n, -1)), dim=-1)  # [H, n, P + R]
    v = torch.einsum("hvl,nl->hnv", w_uv, c)  # [H, n, V]
    q = torch.cat((q_nope, q_pe), dim=-1)  # [H, P + R]
    p = torch.softmax(torch.einsum("hd,hnd->hn", q, k) * scale, dim=-1)  # [H, n]
    return torch.einsum("hn,hnv->hv", p, v)


def absorbed_attention(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    ### BEGIN SOLUTION
    q_lat = torch.einsum("hp,hpl->hl", q_nope, w_uk)  # [H, L]: W_UK folded into the query
    scores = (q_lat @ c.T + q_pe @ k_pe.T) * scale  # [H, n]: against the cached latents themselves
    o = torch.softmax(scores, dim=-1) @ c  # [H, L]: the latents are the values
    return torch.einsum("hl,hvl->hv", o, w_uv)  # [H, V]
    ### END SOLUTION


# %% tags=["check"]
ch10.check_absorbed_attention(absorbed_attention)

# %% [markdown]
# Why bother: per token and layer, the cache holds $L + R$ numbers for all heads, where the naive
# form's K/V hold $H (P + R + V)$. DeepSeek-V3's sizes:

# %%
H, P, R, L, V = 128, 128, 64, 512, 128
print(f"cached per token and layer: latent {L + R} numbers, naive K/V {H * (P + R + V)} "
      f"({H * (P + R + V) / (L + R):.0f}x more)")  # NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## What you built
#
# `route` is `select_experts` in `minillm/layers/moe.py` for Mixtral and Qwen3-MoE; DeepSeek adds
# group-limited choice, sigmoid scores with a bias for choosing, and a scaling factor. The experts then
# run in two grouped GEMMs (`minillm/kernels/fused_moe.py`). `absorbed_attention` is what
# `MultiHeadLatentAttention._absorbed` does for every token and head at once, with the latents read
# from the paged cache by `minillm/kernels/mla_decode.py`: one latent head shared by all query heads.
