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
# # Lab 16 · Multi-LoRA: one batch, many adapters
#
# A LoRA layer computes $y = xW^T + s\,(xA^T)B^T$. Serving many adapters at once, minillm keeps every
# adapter's $A$ and $B$ stacked in GPU slots and gives each token the slot of its request's adapter:
# Punica's BGMV. You write the two pieces that make an adapter's update right: the per-token gather with
# its shrink and expand (exercise 1), and the scale PEFT puts on $BA$ (exercise 2).
#
# The checks run your functions **inside the engine**: a tiny random Llama serves one batch that mixes
# fresh random PEFT adapters and requests with none, your function in place of minillm's, and every token
# the engine picks must be HF + PEFT's greedy choice with that request's adapter alone.

# %%
import math

import torch

from minillm.kernels.lora_bgmv import add_lora_ref
from minillm.labs import ch16

# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run `ch16.hint("bgmv", 1)`,
# then 2, then 3. This lists the exercises:

# %%
ch16.hint()

# %% [markdown]
# ## The layout
#
# A layer with `S` stacked parts (q, k, v of `qkv_proj`: S = 3; gate, up: 2; the others: 1) and
# `L = max_loras` slots of rank up to `R` holds
#
# - `a` `[L, S * R, in]`: rows `i*R .. (i+1)*R` of slot `l` are part `i`'s $A$ (all parts read the same $x$);
# - `b` `[L, out, R]`: part `i`'s $B$ in the columns `slice_offsets[i]` up to the next offset (or `out`),
#   the scaling already folded in at load time;
# - `slots` `[T]`: one slot per token, **−1 for a token without an adapter**.
#
# Below, minillm's reference on a batch of four tokens: the token with slot −1 keeps its row.

# %%
g = torch.Generator().manual_seed(0)
x, a, b = torch.randn(4, 8, generator=g), torch.randn(2, 2 * 3, 8, generator=g), torch.randn(2, 10, 3, generator=g)
y = torch.zeros(4, 10)
add_lora_ref(y, x, a, b, torch.tensor([1, -1, 0, 1]), slice_offsets=(0, 6))  # two parts: columns 0-5 and 6-9
print(y[:, :4])

# %% [markdown]
# ## Exercise 1 — BGMV: each token gathers its own adapter
#
# Write `bgmv(y, x, a, b, slots, slice_offsets)`, adding in place, for every token `t` with `slots[t] >= 0`
# and every part `i`:
#
# $$y[t,\ \text{part } i] \mathrel{+}= \big(x_t\, A[\text{slot}_t]_{\,iR:(i+1)R}^T\big)\; B[\text{slot}_t,\ \text{part } i]^T$$
#
# (shrink to `S * R` numbers, then expand each part's chunk into its columns). Compute in fp32 and add
# into `y` in its own dtype. A loop over tokens is fine; the Triton kernel (`kernels/lora_bgmv.py`)
# runs one program per token the same way. Mind Python's `a[-1]`.

# %%
def bgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
         slice_offsets=(0,)) -> None:
    ### BEGIN SOLUTION
    R = b.shape[2]
    ends = list(slice_offsets[1:]) + [y.shape[1]]
    for t in range(y.shape[0]):
        s = int(slots[t])
        if s < 0:  # no adapter: the row stays as the base GEMM wrote it
            continue
        h = x[t].float() @ a[s].float().T  # shrink: [S * R]
        for i, (lo, hi) in enumerate(zip(slice_offsets, ends)):
            y[t, lo:hi] += (h[i * R : (i + 1) * R] @ b[s, lo:hi].float().T).to(y.dtype)  # expand: [hi - lo]
    ### END SOLUTION


# %% tags=["check"]
ch16.check_bgmv(bgmv)

# %% [markdown]
# ## Exercise 2 — the scale on $BA$
#
# Write `lora_scaling(r, lora_alpha, use_rslora)`: the factor PEFT multiplies $BA$ by. The adapter
# loader (`minillm/lora/adapter.py`) calls it once per adapter and folds it into $B$. The check runs a
# plain and an rsLoRA adapter side by side in the engine.

# %%
def lora_scaling(r: int, lora_alpha: float, use_rslora: bool) -> float:
    ### BEGIN SOLUTION
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
    ### END SOLUTION


# %% tags=["check"]
ch16.check_lora_scaling(lora_scaling)

# %% [markdown]
# ## What you built
#
# Exercise 1 is what `add_lora_ref` and the Triton `add_lora` compute: the reference groups each slot's
# tokens into one GEMM (the host reads which slots occur, so it cannot live in a CUDA graph), the kernel
# gives each token a program and reads its slot from a device buffer (so it can). Prefill tokens of one
# request share an adapter: Punica's SGMV turns such a segment into one GEMM, which minillm does not do
# yet. Exercise 2 is why an rsLoRA adapter of rank 64 and one of rank 4 with the same `lora_alpha` change
# the model by similar amounts: $\alpha/\sqrt r$ shrinks slower than $\alpha/r$.
