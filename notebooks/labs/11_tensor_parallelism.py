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
# # Lab 11 · Tensor parallelism
#
# You split a model's weights across $p$ ranks the way chapter 11's layers do, in one process: each
# function below returns what **rank r of p** holds or computes, and the sum or concatenation over ranks
# is the collective the real group would run. Every check builds minillm's own layer as rank r
# (`simulate_tensor_parallel`), fills it from the one full tensor through its `weight_loader`, and
# compares on fresh random shapes and values.

# %%
import torch

from minillm.labs import ch11

# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch11.hint("column_shard", 1)`, then 2, then 3. This lists the exercises:

# %%
ch11.hint()

# %% [markdown]
# ## Exercise 1 — two ways to cut a weight
#
# A linear layer computes $y = x W^\top$ with $W$ of shape `[N, K]` (N output features, K input
# features). **Column-parallel** (`ColumnParallelLinear`): rank $r$ keeps $N/p$ output features — its own
# columns of $y$, no communication. **Row-parallel** (`RowParallelLinear`): rank $r$ keeps $K/p$ input
# features and sees only those features of $x$; it makes a full-size partial sum of $y$. $p$ divides
# the split dimension. Return the rank's block of `weight`.

# %%
def column_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    ### BEGIN SOLUTION
    n = weight.shape[0] // world_size
    return weight[rank * n : (rank + 1) * n]
    ### END SOLUTION


def row_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    ### BEGIN SOLUTION
    k = weight.shape[1] // world_size
    return weight[:, rank * k : (rank + 1) * k]
    ### END SOLUTION


# %% tags=["check"]
ch11.check_column_shard(column_shard)
ch11.check_row_shard(row_shard)

# %% [markdown]
# ## Exercise 2 — column, then row: one sum per MLP
#
# The MLP is $\big(\operatorname{SiLU}(x W_\text{gate}^\top) \odot x W_\text{up}^\top\big) W_\text{down}^\top$
# with `gate`, `up` of shape `[I, H]` and `down` of shape `[H, I]`. Split the $I$ intermediate features:
# rank $r$ holds its rows of `gate` and `up` (column-parallel `gate_up_proj`) and the matching columns of
# `down` (row-parallel `down_proj`). Return the list of the $p$ ranks' **partial outputs** `[T, H]`, each
# computed from that rank's shards alone. The check compares each with minillm's rank layers and
# asserts that they sum to the unsharded MLP — the one all-reduce the block needs.

# %%
def mlp_partial_sums(x, gate, up, down, world_size: int) -> list[torch.Tensor]:
    ### BEGIN SOLUTION
    n = gate.shape[0] // world_size
    parts = []
    for r in range(world_size):
        s = slice(r * n, (r + 1) * n)
        h = torch.nn.functional.silu(x @ gate[s].T) * (x @ up[s].T)  # [T, I/p]: nothing crosses ranks
        parts.append(h @ down[:, s].T)  # [T, H]: a partial sum
    return parts
    ### END SOLUTION


# %% tags=["check"]
ch11.check_mlp_partial_sums(mlp_partial_sums)

# %% [markdown]
# ## Exercise 3 — the vocabulary-parallel embedding
#
# The `[V, H]` table is split by rows: rank $r$ owns token ids
# $[r\lceil V/p\rceil, \min((r+1)\lceil V/p\rceil, V))$ (the last slice may be shorter, or empty). For
# each id in `ids` (`[T]`) return the rank's contribution, `[T, H]`: the table's row for an id it owns,
# a row of zeros for any other. Summed over ranks (the all-reduce), that is `table[ids]`, exactly.

# %%
def embedding_shard(table: torch.Tensor, ids: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    ### BEGIN SOLUTION
    V = table.shape[0]
    per = -(-V // world_size)  # ceil(V / p)
    start, end = rank * per, min((rank + 1) * per, V)
    mine = (ids >= start) & (ids < end)  # [T]
    rows = table[torch.where(mine, ids, 0)]  # [T, H]: any valid row for the ids masked out
    return rows * mine[:, None]
    ### END SOLUTION


# %% tags=["check"]
ch11.check_embedding_shard(embedding_shard)

# %% [markdown]
# ## Exercise 4 (optional) — fit α and β
#
# A ring all-reduce of $n$ bytes over $p$ ranks takes $T(n) = 2(p-1)\,\alpha + \frac{2(p-1)}{p}\frac{n}{\beta}$.
# Given measured `times` (seconds) at message `sizes` (bytes), return `(alpha, beta)` by least squares
# on **relative** errors: minimise $\sum_i \big((T(n_i) - t_i)/t_i\big)^2$, so the small messages, where
# α shows, count as much as the large ones. The check feeds noisy times from a random α and β.

# %%
def fit_alpha_beta(sizes: list[int], times: list[float], world_size: int) -> tuple[float, float]:
    ### BEGIN SOLUTION
    p = world_size
    A = torch.tensor([[2 * (p - 1) / t, 2 * (p - 1) / p * n / t] for n, t in zip(sizes, times)],
                     dtype=torch.float64)  # [len, 2]: each row divided by its time
    sol = torch.linalg.lstsq(A, torch.ones(len(sizes), 1, dtype=torch.float64)).solution  # [2, 1]: alpha, 1/beta
    return sol[0, 0].item(), 1.0 / sol[1, 0].item()
    ### END SOLUTION


# %% tags=["check"]
ch11.check_fit_alpha_beta(fit_alpha_beta)

# %% [markdown]
# ## What you built
#
# Exercises 1 and 2 are `minillm/layers/linear.py`'s split: a column-parallel layer feeding a
# row-parallel one needs one all-reduce, after the second, whatever lies element-wise between them;
# attention does the same along heads. Exercise 3 is `VocabParallelEmbedding`: a mask, a lookup and an
# exact all-reduce. Exercise 4 is `fit_alpha_beta` in `minillm/distributed/cost_model.py`, which
# notebook 11 fits to the all-reduces it measures.
