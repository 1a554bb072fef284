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
# # Lab 15 · KV eviction
#
# When a sequence's KV cache outgrows its budget, an eviction policy names the table entries whose
# blocks go back to the pool. The block manager asks the policy before every step; an evicted entry
# then points at block 0 (`NULL_BLOCK`, never written), and the worker compacts each table so the
# attention kernels read only the kept blocks. You write the decision of two policies:
#
# 1. **StreamingLLM** (Xiao et al., 2023): keep the first blocks (the *attention sinks*) and a recent
#    window; everything between goes.
# 2. **H2O** (Zhang et al., 2023): keep a recent window and the *heavy hitters*, the blocks that got
#    the most attention so far; the lightest go.
#
# Each check compares your function with the engine's policy on fresh random inputs, then puts it
# **inside a live engine** in the policy's place (a tiny random Llama on the CPU) and runs random
# prompts: the greedy tokens and, after every step, which table entries still hold a block must be
# those of the engine running its own policy.

# %%
from minillm.engine.kv_eviction import NULL_BLOCK
from minillm.labs import ch15

print("an evicted table entry points at block", NULL_BLOCK)

# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch15.hint("streaming_evictable", 1)`, then 2, then 3. This lists the exercises:

# %%
ch15.hint()

# %% [markdown]
# ## Exercise 1 — StreamingLLM's keep-set
#
# Write `streaming_evictable(start, block_size, sink_tokens, kv_budget)`. Table entry `i` holds
# positions `[i * block_size, (i + 1) * block_size)`; the next step's first new token is at position
# `start`. Keep:
#
# - the **sink blocks**: every block holding one of the first `sink_tokens` positions (whole blocks);
# - the **recent blocks**: as many whole blocks as the budget has left, `kv_budget // block_size`
#   minus the sink blocks, *ending with the block that holds `start`* (it is being written).
#
# Return `(lo, hi)`: entries `lo .. hi - 1` are evicted (`hi <= lo`: none yet). The block manager
# evicts each entry once, so returning the whole range every step is right.

# %%
def streaming_evictable(start: int, block_size: int, sink_tokens: int, kv_budget: int) -> tuple[int, int]:
    ### BEGIN SOLUTION
    sink_blocks = -(-sink_tokens // block_size)  # a partly used sink block is still a block
    recent_blocks = kv_budget // block_size - sink_blocks  # start's own block among them
    return sink_blocks, start // block_size - recent_blocks + 1
    ### END SOLUTION


# %% tags=["check"]
ch15.check_streaming_evictable(streaming_evictable)

# %% [markdown]
# ## Exercise 2 — H2O's victims
#
# Write `h2o_victims(table, start, block_size, budget_blocks, mass)`:
#
# - `table`: the sequence's block table (an entry equal to `NULL_BLOCK` was evicted earlier);
# - `start`: the next step's first position; its block, `start // block_size`, is being written and stays;
# - `budget_blocks`: how many blocks the sequence may hold *with* the step's own block;
# - `mass[i]`: the attention table entry `i` has received so far, summed over layers, heads, queries and
#   steps (from `kernels/attn_mass.py`; an entry not in the dict has 0).
#
# Among the held entries before the step's block: if they and the step's block exceed the budget, the
# excess go, the lightest first (ties: the older entry first), except the **recent window**: the last
# `max(1, budget_blocks // 2) - 1` held entries never go (with the step's block they are H2O's recent
# half). Return the victims sorted.

# %%
def h2o_victims(table: list[int], start: int, block_size: int, budget_blocks: int,
                mass: dict[int, float]) -> list[int]:
    ### BEGIN SOLUTION
    cur = start // block_size
    held = [i for i in range(min(cur, len(table))) if table[i] != NULL_BLOCK]  # full blocks still held
    excess = len(held) + 1 - budget_blocks  # + 1: the step's own block
    if excess <= 0:
        return []
    recent = max(1, budget_blocks // 2)
    candidates = held[: len(held) - (recent - 1)]  # the recent window stays
    return sorted(sorted(candidates, key=lambda i: mass.get(i, 0.0))[:excess])  # stable: ties go oldest first
    ### END SOLUTION


# %% tags=["check"]
ch15.check_h2o_victims(h2o_victims)

# %% [markdown]
# ## What you built
#
# Exercise 1 is `StreamingLLM.evictable` in `minillm/engine/kv_eviction.py`: constant memory for
# unbounded generation, because the kept set depends only on `start`. Exercise 2 is `H2O.victims`: it
# needs the attention each key received, which FlashAttention never writes, so `kernels/attn_mass.py`
# recomputes the probabilities after each layer (a log-sum-exp pass, then a column sum per block). Both
# are block-granular: the pool, the tables and the kernels are shared by every layer and head, so a
# whole block is what can be given back. The paper's H2O is per token and per head; chapter 15 says
# what that would cost.
