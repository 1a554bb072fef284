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
# Four pieces of chapter 10. A mixture-of-experts layer runs, for each token, only the `top_k`
# experts its router scores highest (Shazeer et al., 2017; Mixtral, Jiang et al., 2024). DeepSeek's
# multi-head latent attention caches one latent vector per token and rebuilds every head's key and
# value from it; the *absorbed* form never rebuilds them at all (DeepSeek-V2, 2024). You write Mixtral's
# router, DeepSeek-V3's group-limited router, the alignment step that lets one grouped-GEMM kernel run
# every expert, and absorbed MLA attention. The checks run your functions against minillm's own
# (`minillm/layers/moe.py`, `kernels/fused_moe.py`, `kernels/mla_decode.py`) on fresh random inputs.

# Stuck? Every exercise has three hints, from a nudge to a near-solution: `ch10.hint("route_v3", 1)`, then
# 2, then 3.

# %%
import torch

from minillm.labs import ch10

torch.manual_seed(0)
ch10.hint()

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
# ## Exercise 2 — `route_v3`: DeepSeek-V3's router
#
# DeepSeek-V3 (256 experts in 8 groups) routes differently in three ways:
#
# 1. each expert's score is a **sigmoid** of its logit, not a softmax over all experts;
# 2. a learned **score-correction bias** `bias [E]` is added for *choosing* only (it balances the load
#    without an auxiliary loss); the weights are the scores without it;
# 3. the choice is **group-limited**: view the $E$ biased scores as `n_group` groups; a group's score is
#    the sum of its best two; only the `topk_group` best groups may be chosen from (the others count as
#    $-\infty$), and the `top_k` experts are the best biased scores among them.
#
# The weights (unbiased scores of the chosen experts) are divided by their sum and multiplied by
# `scaling` (V3's `routed_scaling_factor`). Return `(weights [T, top_k], ids [T, top_k])`.

# %%
def route_v3(router_logits, bias, top_k, n_group, topk_group, scaling):
    ### BEGIN SOLUTION
    T, E = router_logits.shape
    scores = router_logits.float().sigmoid()  # [T, E]
    choice = scores + bias.float()  # [T, E]: the bias steers the choice only
    groups = choice.view(T, n_group, E // n_group)  # [T, G, E/G]
    group_scores = groups.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)  # [T, G]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices  # [T, top_k]
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True) * scaling, ids
    ### END SOLUTION


# %% tags=["check"]
ch10.check_route_v3(route_v3)

# %% [markdown]
# ## Exercise 3 — `moe_align`: one kernel for every expert
#
# The fused MoE kernel multiplies tiles of `block_m` rows, and every tile must belong to one expert.
# Number the (token, expert) pairs $i = t K + j$, with $K$ = `top_k` (row-major in `topk_ids [T, top_k]`).
# Return
#
# - `sorted_ids`: the pair ids grouped by expert (expert 0 first; inside an expert, in pair order), each
#   expert's run padded with the pad id $T K$ to a multiple of `block_m`; an expert
#   with no pair takes no rows;
# - `expert_ids`: for each tile of `block_m` rows of `sorted_ids`, its expert.
#
# Example: `topk_ids = [[1, 0], [1, 2]]`, `block_m = 2`: expert 0 has pair 1, expert 1 pairs 0 and 2,
# expert 2 pair 3, so `sorted_ids = [1, 4, 0, 2, 3, 4]` and `expert_ids = [0, 1, 2]`. Try it with tensor
# operations (counts, a cumulative sum, a stable sort) — the kernel's version must not sync with the host.

# %%
def moe_align(topk_ids, block_m, num_experts):
    ### BEGIN SOLUTION
    flat = topk_ids.reshape(-1).long()  # [n] pair i's expert
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E] rows each expert takes
    ends = torch.cumsum(padded, 0)  # [E]
    order = torch.argsort(flat, stable=True)  # [n] pairs grouped by expert, pair order inside
    expert = flat[order]
    rank = torch.arange(n) - (torch.cumsum(counts, 0) - counts)[expert]  # index inside its expert
    sorted_ids = torch.full((int(ends[-1]),), n, dtype=torch.long)
    sorted_ids[(ends - padded)[expert] + rank] = order
    expert_ids = torch.searchsorted(ends, torch.arange(0, int(ends[-1]), block_m), right=True)
    return sorted_ids, expert_ids
    ### END SOLUTION


# %% tags=["check"]
ch10.check_moe_align(moe_align)

# %% [markdown]
# ## Exercise 4 — `absorbed_attention`
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
# `route` is `select_experts` in `minillm/layers/moe.py` for Mixtral and Qwen3-MoE, and `route_v3` its
# `noaux_tc` path for DeepSeek-V3. `moe_align` is `moe_align_block_size` in `kernels/fused_moe.py`: with
# it, the experts run in two grouped GEMM launches, whatever the routing. `absorbed_attention` is what
# `MultiHeadLatentAttention._absorbed` does for every token and head at once, with the latents read
# from the paged cache by `minillm/kernels/mla_decode.py`: one latent head shared by all query heads.
