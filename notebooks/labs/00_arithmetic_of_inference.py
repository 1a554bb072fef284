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
# # Lab 00 · The arithmetic of inference
#
# Three functions that every later chapter leans on. Write each one where it says
# `raise NotImplementedError`, then run the check cell below it: it compares your function with
# minillm's on a few hundred fresh random inputs and prints ✅, or shows the first input where they
# disagree.
#
# (Regenerate a fresh copy of this lab with `make labs`.)

# %%
from minillm.labs import ch00


# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch00.hint("matmul_cost", 1)`, then 2, then 3. This lists the exercises:

# %%
ch00.hint()

# %% [markdown]
# ## Exercise 1 — FLOPs and bytes of a matrix product
#
# $C[m, n] = A[m, k]\,B[k, n]$. Return `(flops, bytes)`: each output element is a dot product of
# length $k$ (a multiply and an add per term), and the fewest bytes moved are reading $A$ and $B$
# once and writing $C$ once, each element `dtype_bytes` wide.

# %%
def matmul_cost(m, n, k, dtype_bytes):
    ### BEGIN SOLUTION
    flops = 2 * m * n * k
    nbytes = (m * k + k * n + m * n) * dtype_bytes
    return flops, nbytes
    ### END SOLUTION


# %% tags=["check"]
ch00.check_matmul_cost(matmul_cost)

# %% [markdown]
# What it tells us: the arithmetic intensity (FLOP/byte) of a decode-time GEMV and a prefill-time
# GEMM on the same $4096 \times 4096$ bf16 weight (computed here with minillm's version, so this cell
# runs before you have solved the exercise). Which side of an H100's ridge (~250 FLOP/byte) is each on?

# %%
from minillm.hw import matmul_cost as reference_matmul_cost

for m in (1, 4096):
    f, b = reference_matmul_cost(m, 4096, 4096, 2)
    print(f"m={m:5}: {f / b:8.1f} FLOP/byte")

# %% [markdown]
# ## Exercise 2 — the KV cache
#
# Return the bytes of keys and values that `batch` sequences of `seq_len` tokens need, for a model
# with `num_layers` layers, `num_kv_heads` KV heads of size `head_dim`, stored `dtype_bytes` wide.

# %%
def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch, dtype_bytes):
    ### BEGIN SOLUTION
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes * seq_len * batch
    ### END SOLUTION


# %% tags=["check"]
ch00.check_kv_cache_bytes(kv_cache_bytes)

# %% [markdown]
# ## Exercise 3 — the roofline
#
# Given an operation's arithmetic intensity (FLOP/byte), the device's matmul rate `peak_tflops`
# (TFLOP/s) and its bandwidth `bandwidth_gbps` (GB/s), return the best TFLOP/s the operation can
# reach. Mind the units.

# %%
def attainable_tflops(intensity, peak_tflops, bandwidth_gbps):
    ### BEGIN SOLUTION
    return min(peak_tflops, intensity * bandwidth_gbps / 1e3)
    ### END SOLUTION


# %% tags=["check"]
ch00.check_attainable(attainable_tflops)
