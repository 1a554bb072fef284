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
# # Lab 03 · The KV cache
#
# Write the three pieces that turn a recompute-everything loop into one token of work per step:
# writing new keys and values into the cache, the inputs of a decode step, and attention of one new
# query over everything cached. Each check compares your function with minillm's own
# (`minillm/cache/`, `minillm/generation.py`, `minillm/kernels/flash_decode.py`) on fresh random
# inputs.
#
# The cache (chapter 03): for every layer, `k_cache` and `v_cache` of shape
# `[num_slots, max_len, Hkv, D]`. The sequence in slot $s$ keeps the key of its token at position
# $p$ in `k_cache[s, p]`, which is flat row $s \cdot \text{max_len} + p$ of
# `k_cache.view(-1, Hkv, D)` (its *slot mapping*).

# %%
import torch

from minillm.labs import ch03


# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch03.hint("append_kv", 1)`, then 2, then 3. This lists the exercises:

# %%
ch03.hint()

# %% [markdown]
# ## Exercise 1 — append to the cache
#
# `k` and `v` are `[T, Hkv, D]`: the new tokens of a step. `slot_mapping[t]` is the flat cache row
# of token `t`. Write them into `k_cache` and `v_cache` **in place** (no new cache: the model holds
# on to these tensors). A view of the cache with its first two dimensions merged helps.

# %%
def append_kv(k_cache, v_cache, k, v, slot_mapping):
    ### BEGIN SOLUTION
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k  # [rows, Hkv, D] view: writes go to the cache
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v
    ### END SOLUTION


# %% tags=["check"]
ch03.check_append_kv(append_kv)

# %% [markdown]
# ## Exercise 2 — a decode step's inputs
#
# After prefill, each step gives every sequence one new token: its last one, at position
# `seq_len - 1`, whose K/V are not in the cache yet. For sequences of lengths `seq_lens` (the new
# token included) in cache slots `slots`, with `max_len` rows per slot, return three int64 tensors of
# length $B$: the new tokens' positions, their flat cache rows (slot mapping), and the number of keys
# each one attends over (`seq_lens`, its own key included).

# %%
def decode_inputs(seq_lens, slots, max_len):
    ### BEGIN SOLUTION
    positions = torch.tensor([n - 1 for n in seq_lens])
    slot_mapping = torch.tensor([s * max_len + n - 1 for s, n in zip(slots, seq_lens)])
    return positions, slot_mapping, torch.tensor(seq_lens)
    ### END SOLUTION


# %% tags=["check"]
ch03.check_decode_inputs(decode_inputs)

# %% [markdown]
# ## Exercise 3 — attention of one query over the cache
#
# `q` is `[B, Hq, D]`: one query per sequence, already rotated, its own K/V already appended.
# Sequence $b$'s keys are `k_cache[slots[b], :seq_lens[b]]` (`[n, Hkv, D]`); query head $h$ uses KV
# head $h \,//\, (H_q / H_{kv})$. Return $\text{softmax}(q K^\top / \sqrt{D})\,V$ for every sequence
# and head, `[B, Hq, D]`. No mask is needed: every cached key is in the past of the new token.

# %%
def cached_decode_attention(q, k_cache, v_cache, slots, seq_lens):
    ### BEGIN SOLUTION
    B, Hq, D = q.shape
    group = Hq // k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        n, s = int(seq_lens[b]), int(slots[b])
        k = k_cache[s, :n].repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache[s, :n].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b], k) / D**0.5  # [Hq, n]
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v)
    return out
    ### END SOLUTION


# %% tags=["check"]
ch03.check_cached_decode_attention(cached_decode_attention)

# %% [markdown]
# These three are what `generation.prepare_inputs`, `layers.attention.store_kv` and the attention layer's
# decode path do for every layer at every step. Chapter 04 replaces the loop of exercise 3 with a
# Triton kernel (FlashDecoding) that reads each KV head once for its whole query group and splits
# long caches across the GPU; chapter 05 replaces the slot with a list of small blocks.
