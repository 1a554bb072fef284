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
# # 04 · FlashAttention and FlashDecoding in Triton
#
# Attention is the one part of the model whose cost grows with the square of the sequence. Written
# the obvious way it builds the whole $S \times S$ score matrix in GPU memory; FlashAttention (Dao et
# al., 2022) never does, by walking the keys in tiles with an online softmax. For decode, one query
# per sequence cannot fill a GPU, so Flash-Decoding (Dao, Haziza, Massa & Sizov, 2023) also splits the
# keys across programs and merges the pieces with their log-sum-exp. This notebook counts what each
# costs, runs minillm's Triton kernels (`minillm/kernels/flash_attn.py`, `flash_decode.py`) against
# PyTorch's SDPA and the roofline in the same process, and then runs the whole model through them.

# %%
import math
import os

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt

import minillm
from minillm import hw
from minillm import notebook as nb
from minillm.bench.table import print_table

nb.header("04")
dev = nb.device()
ceil = hw.ceilings(dev)
print(f"ceilings: copy {ceil.copy_gbps:,.0f} GB/s, matmul {ceil.matmul_tflops:,.1f} TFLOP/s ({ceil.dtype}), "
      f"ridge {ceil.ridge:,.0f} FLOP/byte")

# %% [markdown]
# ## 1. The online softmax, in numbers
#
# One query row, twelve scores, seen four at a time. After each tile the state is the running max
# $m$, the running sum $\ell = \sum e^{s-m}$ and the running output $\text{acc} = \sum e^{s-m} v$
# (here $v$ is one number per key). A new maximum rescales what came before by $e^{m_\text{old} -
# m_\text{new}}$. At the end, $\text{acc}/\ell$ is exactly the softmax-weighted sum.

# %%
# NBVAL_CHECK_OUTPUT
g = torch.Generator().manual_seed(4)
s = (torch.randn(12, generator=g, dtype=torch.float64) * 3).round(decimals=1)
v = torch.arange(12, dtype=torch.float64)
m, l, acc = -math.inf, 0.0, 0.0
for start in range(0, 12, 4):
    tile, vt = s[start:start + 4], v[start:start + 4]
    m_new = max(m, tile.max().item())
    alpha = math.exp(m - m_new)  # 0 on the first tile
    p = torch.exp(tile - m_new)
    l, acc, m = l * alpha + p.sum().item(), acc * alpha + (p * vt).sum().item(), m_new
    print(f"tile {start // 4}: scores {tile.tolist()}  ->  m={m:5.1f}  rescale={alpha:.4f}  l={l:.4f}  acc/l={acc / l:.4f}")
print(f"softmax(s) @ v in one go: {(s.softmax(0) @ v).item():.4f}")

# %% [markdown]
# ## 2. The tiling, drawn
#
# The prefill kernel gives each program a `BLOCK_M` tile of queries of one head and walks the key
# tiles. With a causal mask, tiles entirely above the diagonal are never visited, tiles entirely
# below it run without any mask, and only the diagonal tiles pay for masking.

# %%
S, BM, BN = 1024, 128, 64
kind = torch.zeros(S // BM, S // BN)
for i in range(S // BM):
    for j in range(S // BN):
        q_last, k_first, k_last = (i + 1) * BM - 1, j * BN, (j + 1) * BN - 1
        kind[i, j] = 0 if k_first > q_last else (2 if k_last <= i * BM else 1)  # skipped / masked / full
plt.figure(figsize=(6, 3.4), dpi=100)
plt.imshow(kind.repeat_interleave(BM // 8, 0).repeat_interleave(BN // 8, 1), cmap="viridis", aspect="auto",
           extent=(0, S, S, 0))
plt.xlabel("key position")
plt.ylabel("query position")
n_full, n_diag = int((kind == 2).sum()), int((kind == 1).sum())
plt.title(f"S={S}, {BM}x{BN} tiles: {n_full} full, {n_diag} masked, {int((kind == 0).sum())} skipped", fontsize=9)
plt.show()

# %% [markdown]
# ## 3. FLOPs and bytes
#
# For one sequence of $S$ tokens, $H_q$ query heads of dimension $D$ and $H_{kv}$ KV heads, causal
# prefill does two matrix products over the visible half of the square: about
# $4 \cdot \tfrac{S^2}{2} \cdot H_q D$ FLOPs, and needs to read q, k, v and write the output once:
# $2(2 H_q + 2 H_{kv}) S D$ bytes in bf16. Its intensity grows with $S$: compute-bound.
#
# A decode step has one query per sequence over $N$ cached tokens: $4 N H_q D$ FLOPs against
# $2 \cdot 2 N H_{kv} D$ bytes of K and V. Its intensity is $H_q / H_{kv}$ FLOP per byte — 3 for
# SmolLM2, 4 for Llama-3-8B — far below the ridge: memory-bound, whatever the kernel.

# %%
# NBVAL_CHECK_OUTPUT
for name, (Hq, Hkv, D) in {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}.items():
    for S in (1024, 16384):
        flops, nbytes = 4 * S * S / 2 * Hq * D, 2 * (2 * Hq + 2 * Hkv) * S * D
        print(f"{name:>13} prefill S={S:>5}: {flops / 1e9:8.1f} GFLOP, {nbytes / 1e6:6.1f} MB, "
              f"{flops / nbytes:6.0f} FLOP/byte")
    N = 8192
    print(f"{name:>13} decode  N={N}: {4 * N * Hq * D / 1e6:8.1f} MFLOP, {4 * N * Hkv * D / 1e6:6.1f} MB, "
          f"{Hq / Hkv:6.1f} FLOP/byte")

# %% [markdown]
# ## 4. Measured: minillm's kernels against SDPA and the roofline
#
# `minillm bench attention` in this process: for every shape, minillm's kernel and PyTorch's
# `scaled_dot_product_attention`, restricted to its fused backends (FlashAttention-2, cuDNN or
# memory-efficient, in PyTorch's order; which one ran is not recorded) and timed in the faster of its
# two GQA forms (`enable_gqa`, or KV heads repeated beforehand) on the same tensors, the ratio (SDPA time / minillm time: above 1 means minillm is
# faster) and the fraction of the measured ceiling. On a CPU the kernels run in Triton's interpreter
# on tiny shapes: those numbers only show that the code runs.

# %%
from minillm.bench import attention as bench

res = bench.run(dev)

# %% [markdown]
# ### Materialising the score matrix
#
# Plain attention (q kᵀ, softmax, @ v) writes the $H_q \times S \times S$ scores to memory, reads them
# back for the softmax, writes the probabilities and reads them again: four passes over a matrix that
# at 16k tokens is larger than the rest of the computation. The flash kernel keeps each tile in
# registers.

# %%
mat = res["materialize"]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.8), dpi=100)
Ss = [r["seq_len"] for r in mat]
nb.plot_lines(Ss, {"naive (S×S in memory)": [r["naive_ms"] for r in mat], "FlashAttention": [r["flash_ms"] for r in mat]},
              xlabel="sequence length S", ylabel="ms", title=f"{mat[0]['model']} attention, one sequence",
              logx=True, logy=True, ax=a1)
nb.plot_lines(Ss, {"score matrix": [r["scores_mb"] for r in mat], "naive: extra memory": [r["naive_extra_mb"] for r in mat],
                   "flash: extra memory": [max(r["flash_extra_mb"], 1e-3) for r in mat]},
              xlabel="sequence length S", ylabel="MiB", title="memory beyond inputs and output",
              logx=True, logy=True, ax=a2)
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Prefill: TFLOP/s against SDPA

# %%
pre = res["prefill"]
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), dpi=100)
for ax, model in zip(axes, dict.fromkeys(r["model"] for r in pre)):
    rows = [r for r in pre if r["model"] == model and r["seqs"].startswith("1x")]
    xs = [r["tokens"] for r in rows]
    nb.plot_lines(xs, {"minillm": [r["minillm_tflops"] for r in rows], "SDPA": [r["sdpa_tflops"] for r in rows]},
                  xlabel="sequence length S", ylabel="TFLOP/s", title=f"{model}: causal prefill, one sequence",
                  logx=True, ax=ax)
    ax.axhline(ceil.matmul_tflops, ls=":", c="gray")
    ax.text(xs[0], ceil.matmul_tflops * 0.93, f"matmul ceiling {ceil.matmul_tflops:,.0f}", fontsize=8, color="gray")
plt.tight_layout()
plt.show()
long = [r for r in pre if r["model"] == "Llama-3-8B" and r["tokens"] >= 4096 and r["seqs"].startswith("1x")]
if long:
    print("target: >= 1.0x SDPA at d128, causal, S >= 4k; measured ratio (SDPA time / minillm time): "
          + ", ".join(f"S={r['tokens']}: {r['ratio']:.2f}x" for r in long))

# %% [markdown]
# ### Decode: GB/s against SDPA and the copy ceiling

# %%
dec = res["decode"]
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), dpi=100)
for ax, model in zip(axes, dict.fromkeys(r["model"] for r in dec)):
    series = {}
    for B in dict.fromkeys(r["batch"] for r in dec):
        rows = [r for r in dec if r["model"] == model and r["batch"] == B]
        series[f"minillm, batch {B}"] = [r["minillm_gbps"] for r in rows]
        ctxs = [r["context"] for r in rows]
    series["SDPA, largest batch"] = [r["sdpa_gbps"] for r in rows]
    nb.plot_lines(ctxs, series, xlabel="context length (cached tokens)", ylabel="GB/s",
                  title=f"{model}: decode attention", logx=True, ax=ax)
    ax.axhline(ceil.copy_gbps, ls=":", c="gray")
    ax.text(ctxs[0], ceil.copy_gbps * 0.93, f"copy ceiling {ceil.copy_gbps:,.0f} GB/s", fontsize=8, color="gray")
plt.tight_layout()
plt.show()
target = [r for r in dec if r["context"] >= 4096 and r["batch"] >= 8]
if target:
    print("target: >= 80% of copy bandwidth for context >= 4k, batch >= 8; measured: "
          + ", ".join(f"{r['model']} b{r['batch']} ctx{r['context']}: {r['pct_of_copy']:.0f}%" for r in target))

# %% [markdown]
# ### FlashDecoding: splitting the keys
#
# With few sequences and KV heads, one program per (sequence, KV head) leaves most of the GPU's
# multiprocessors idle while each streams a long cache alone. Splitting the keys into `num_splits`
# chunks multiplies the programs; the price is a second, tiny kernel that merges the partial outputs
# with their log-sum-exps.

# %%
sp = res["splits"]
nb.plot_lines([r["num_splits"] for r in sp], {"GB/s": [r["gbps"] for r in sp]}, xlabel="num_splits", ylabel="GB/s",
              title=f"{sp[0]['model']}, batch {sp[0]['batch']}, context {sp[0]['context']}", logx=True)
plt.axhline(ceil.copy_gbps, ls=":", c="gray")
plt.show()

# %% [markdown]
# ### On the roofline

# %%
points = []
for r in pre:
    if r["seqs"].startswith("1x") and r["tokens"] in (max(x["tokens"] for x in pre),):
        Hq, Hkv, D = bench.GPU_SHAPES.get(r["model"], bench.CPU_SHAPES.get(r["model"], (1, 1, 1)))
        S = r["tokens"]
        points.append((f"prefill {r['model']}", (4 * S * S / 2 * Hq * D) / (2 * (2 * Hq + 2 * Hkv) * S * D), r["minillm_tflops"]))
for r in dec:
    if r["batch"] == max(x["batch"] for x in dec) and r["context"] == max(x["context"] for x in dec):
        Hq, Hkv, D = bench.GPU_SHAPES.get(r["model"], bench.CPU_SHAPES.get(r["model"], (1, 1, 1)))
        points.append((f"decode {r['model']}", Hq / Hkv, r["minillm_gbps"] * Hq / Hkv / 1e3))
nb.plot_roofline(ceil, points, title="minillm's attention kernels on the roofline")
plt.show()

# %% [markdown]
# ## 5. The kernels in the engine
#
# On a GPU the model runs these kernels by default (`MINILLM_KERNELS=auto`); `kernel_mode("torch")`
# runs the PyTorch references instead, on the same GPU. Greedy tokens both ways, in fp32 (where the
# two must agree exactly in their choices) and bf16, then generation speed both ways.

# %%
from minillm.layers.backend import kernel_mode

prompt = "The three most important ideas in computer science are"
new = nb.pick(cpu=3, gpu=64)
greedy = minillm.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
POOL = dict(num_gpu_blocks=nb.pick(cpu=None, gpu=2048))  # 32k tokens each: both engines fit beside each other
for dtype in nb.pick(cpu=["float32"], gpu=["float32", "bfloat16"]):
    llm = minillm.LLM(device=dev, dtype=dtype, **POOL)
    with kernel_mode("triton"):
        ours = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    with kernel_mode("torch"):
        ref = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    same = sum(a == b for a, b in zip(ours.token_ids, ref.token_ids))
    print(f"{dtype:>9}: {same}/{new} greedy tokens identical (Triton kernels vs PyTorch references)")
print(repr(ours.text))

# %%
import time


def tok_per_s(mode, runs=3):
    with kernel_mode(mode):
        llm.generate(prompt, greedy, use_tqdm=False)  # warm-up (and Triton's autotuning)
        times = []
        for _ in range(runs):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompt, greedy, use_tqdm=False)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return new / sorted(times)[len(times) // 2]


if nb.on_gpu():
    speed = {"minillm, Triton kernels": tok_per_s("triton"), "minillm, PyTorch references": tok_per_s("torch")}
    for k, v in speed.items():
        print(f"{k:>28}: {v:7.1f} tok/s")
    print(f"ratio: {speed['minillm, Triton kernels'] / speed['minillm, PyTorch references']:.2f}x  "
          f"(bf16, batch 1, {new} tokens, KV cache on)")
