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
# # 00 · Why inference is different
#
# Training pushes big batches of known text through the model; arithmetic dominates. Inference
# answers one request at a time and produces one token per step, and each step must read **every
# weight** of the model plus **every cached key and value** of the conversation so far. This
# notebook measures the two ceilings of the machine it runs on and shows where prefill and decode
# land between them.
#
# It runs anywhere: on a CPU the shapes are small; on a CUDA GPU they are real. The stored outputs
# come from a GPU run (see the first line below).

# %%
import torch

from minillm import hw
from minillm import notebook as nb

nb.header("00")
dev = nb.device()

# %% [markdown]
# ## 1. The two ceilings
#
# * **Copy bandwidth** $B$: one large device-to-device copy, counting the bytes read *and* written.
# * **Matmul rate** $P$: one large square matrix product on random data, in bf16 on a GPU.
#
# Datasheets promise more than any kernel gets (an H100 SXM lists 3.35 TB/s and 989 dense bf16
# TFLOP/s); we use what we measure.

# %%
ceil = hw.ceilings(dev)
print(f"device:        {ceil.device}")
print(f"copy:          {ceil.copy_gbps:,.0f} GB/s   (read + write)")
print(f"matmul ({ceil.dtype}): {ceil.matmul_tflops:,.1f} TFLOP/s")
print(f"ridge point:   {ceil.ridge:,.0f} FLOP per byte")

# %% [markdown]
# The **ridge point** $P/B$ is the arithmetic intensity (FLOPs per byte moved) at which an operation
# stops being limited by memory and starts being limited by arithmetic. On an H100 it is in the
# hundreds: an operation must do hundreds of FLOPs for every byte it touches to keep the tensor cores busy.
#
# ## 2. The same weights, more rows: GEMV → GEMM
#
# A linear layer multiplies activations $X[b, k]$ by a weight $W[n, k]$ (as $XW^\top$). It does $2bkn$ FLOPs and must
# read $W$ once ($2kn$ bytes in bf16) — whatever $b$ is. During **decode** each request contributes
# one row ($b$ = batch size, often 1–64); during **prefill** every prompt token is a row ($b$ in the
# thousands). So the intensity is roughly $b$ FLOP/byte: decode sits far left of the ridge.
#
# Below: Llama-3-8B's MLP up-projection ($4096 \to 14336$, 117 MB in bf16) for growing $b$.

# %%
from minillm.bench import ceilings as bench_ceilings

result = bench_ceilings.run(dev)
sweep = result["sweep"]

# %%
import matplotlib.pyplot as plt

fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
batches = [r["batch"] for r in sweep]
nb.plot_lines(batches, {"time per call (µs)": [r["seconds"] * 1e6 for r in sweep]}, xlabel="rows b (tokens)",
              ylabel="µs", title="Time barely moves until b is large", logx=True, logy=True, ax=a1)
nb.plot_lines(batches, {"measured": [r["tflops"] for r in sweep],
                        "roofline": [r["roofline_tflops"] for r in sweep]},
              xlabel="rows b (tokens)", ylabel="TFLOP/s", title="…so useful work grows with b", logx=True, logy=True, ax=a2)
plt.tight_layout()
plt.show()
one, big = sweep[0], sweep[-1]
print(f"b={one['batch']}: {one['seconds'] * 1e6:.1f} µs, {one['gbps']:,.0f} GB/s = {100 * one['gbps'] / ceil.copy_gbps:.0f}% of copy bandwidth")
print(f"b={big['batch']}: {big['seconds'] * 1e6:.1f} µs, {big['tflops']:,.1f} TFLOP/s = {100 * big['tflops'] / ceil.matmul_tflops:.0f}% of the matmul rate")
print(f"{big['batch']}x the rows cost {big['seconds'] / one['seconds']:.1f}x the time")

# %% [markdown]
# ## 3. The roofline
#
# Each measured point placed by its intensity; the black line is the best any kernel could do at
# that intensity on this device. Decode-like shapes (small $b$) hug the sloped memory roof;
# prefill-like shapes reach the flat compute roof.

# %%
pts = [(f"b={r['batch']} ({'decode' if r['batch'] <= 64 else 'prefill'}-like)", r["intensity"], r["tflops"])
       for r in sweep if r["batch"] in (1, 8, 64, 512, 4096) or (not nb.on_gpu() and r["batch"] in (1, 16, 256))]
nb.plot_roofline(ceil, pts)
plt.show()

# %% [markdown]
# ## 4. What one decode step costs
#
# At batch 1, a decode step reads every weight once. The fastest possible step is therefore
# (weight bytes) / (copy bandwidth) — no kernel, scheduler or language changes that. It is the number
# every later chapter is measured against.

# %%
models = {"SmolLM2-135M": 134.5e6, "Llama-3-8B": 8.03e9, "Llama-3-70B": 70.6e9}
print(f"{'model':>14} {'bf16 weights':>13} {'floor per token':>16} {'max tok/s (batch 1)':>20}")
for name, params in models.items():
    nbytes = 2 * params
    floor = nbytes / (ceil.copy_gbps * 1e9)  # every weight byte crosses the memory bus once
    print(f"{name:>14} {nbytes / 1e9:>11.2f} GB {floor * 1e3:>13.3f} ms {1 / floor:>20,.0f}")

# %% [markdown]
# (Memory bandwidth is shared by reads and writes, so the copy's read-plus-write rate is also about
# the rate of a pass that only reads. Llama-3-70B does not fit in one GPU; its line is what the
# arithmetic would say. Chapter 07 measures how close the engine gets to this floor.)
#
# ## 5. The KV cache: the other thing every step reads
#
# For every past token, every layer keeps a key and a value vector per KV head:
#
# $$\text{bytes per token} = 2 \times n_\text{layers} \times n_\text{kv heads} \times d_\text{head} \times \text{bytes per element}$$
#
# and the cache of a batch is that times the context length times the number of sequences. The
# figures below are the ones the source articles quote; the `assert`s hold our formula to them.

# %%
# NBVAL_CHECK_OUTPUT
from minillm.kv_memory import GiB, MODELS, kv_bytes_per_token, model_kv_bytes

assert kv_bytes_per_token(80, 8, 128, 2) == 327_680  # a 70B model: ~327 KB per token
assert model_kv_bytes("Llama-3-70B", 4096) / GiB == 1.25
assert model_kv_bytes("Llama-3.1-70B", 131072) / GiB == 40
assert model_kv_bytes("Llama-3-8B", 4096) / GiB == 0.5
assert model_kv_bytes("Llama-3.1-8B", 131072) / GiB == 16
print(f"{'model':>15} {'layers':>6} {'q/kv heads':>10} {'KB/token':>9} {'4K ctx':>9} {'128K ctx':>9}")
for name in ["SmolLM2-135M", "Llama-3-8B", "Llama-3-70B", "Llama-3.1-405B"]:
    m = MODELS[name]
    print(f"{name:>15} {m.num_layers:>6} {m.num_heads:>5}/{m.num_kv_heads:<4} "
          f"{kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim) / 1024:>9.1f} "
          f"{model_kv_bytes(m, 4096) / GiB:>7.2f} GiB {model_kv_bytes(m, 131072) / GiB:>7.1f} GiB")

# %% [markdown]
# Grouped-query attention is why these numbers are survivable: Llama-3-70B has 64 query heads but
# only 8 KV heads. With one KV head per query head the 128K cache would be 8× larger — 320 GiB for a
# single sequence.
#
# The plot shows how the cache grows with context and batch, against the memory of the GPU in this
# machine (on a CPU run, against 80 GiB).

# %%
import numpy as np

gpu_mem = torch.cuda.get_device_properties(dev).total_memory / GiB if nb.on_gpu() else 80.0


def plot_kv(model="Llama-3-8B", batch=8, dtype="bf16", ax=None):
    ctx = np.logspace(np.log2(512), np.log2(131072), 12, base=2).astype(int)
    ax = nb.plot_lines(ctx, {f"{model}, batch {b}, {dtype}": [model_kv_bytes(model, int(t), b, dtype) / GiB for t in ctx]
                             for b in sorted({1, batch})},
                       xlabel="context length (tokens)", ylabel="KV cache (GiB)", logx=True, logy=True, ax=ax,
                       title=f"KV cache of {model}")
    ax.axhline(gpu_mem, color="red", ls="--", lw=1)
    ax.annotate(f"this GPU: {gpu_mem:.0f} GiB", (ctx[0], gpu_mem * 1.1), color="red")
    return ax


fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=100)
for ax, model in zip(axes, ["SmolLM2-135M", "Llama-3-8B", "Llama-3-70B"]):
    plot_kv(model, batch=32, ax=ax)
plt.tight_layout()
plt.show()

# %% [markdown]
# Turn the knobs (in JupyterLab; the site shows the static plot above):

# %% tags=["widget"]
import ipywidgets as W


def kv_calculator(model="Llama-3-8B", context=8192, batch=8, dtype="bf16"):
    total = model_kv_bytes(model, context, batch, dtype)
    print(f"{model}: {batch} x {context:,} tokens in {dtype} -> {total / GiB:,.2f} GiB of KV cache "
          f"({100 * total / (gpu_mem * GiB):.0f}% of {gpu_mem:.0f} GiB)")
    plot_kv(model, batch, dtype)
    plt.show()


nb.widget(kv_calculator, model=W.Dropdown(options=list(MODELS), value="Llama-3-8B"),
          context=W.IntSlider(value=8192, min=512, max=131072, step=512),
          batch=W.IntSlider(value=8, min=1, max=256), dtype=W.Dropdown(options=["bf16", "fp8", "int4"], value="bf16"));

# %% [markdown]
# ## 6. What this means for the engine
#
# * **Decode is a memory problem.** At small batch a step costs the time to read the weights and the
#   KV cache; FLOPs are nearly free. Serving many requests *in the same step* (continuous batching,
#   chapter 07) moves the point right along the roofline at almost no extra time per step.
# * **Prefill is a compute problem.** A long prompt is a GEMM; it reaches the flat roof on its own.
# * **The KV cache decides the batch.** After the weights, free memory divided by the per-sequence
#   cache is how many requests fit at once; wasting it (chapter 05) or shrinking it (GQA, MLA in
#   chapter 10, FP8 in chapter 08) changes throughput directly.
