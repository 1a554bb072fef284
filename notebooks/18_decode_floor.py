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
# # 18 · Decode at the bandwidth floor: PDL, our own GEMV, fused layers
#
# A batch-1 decode step reads every weight once, so its floor is bytes over bandwidth. This notebook
# computes that floor for four models, counts the kernels of a decode layer on the `pdl` backend,
# checks our split-K GEMV (`kernels/gemv.py`) against the unfused PyTorch ops, times it against cuBLAS
# at every decode shape (on a GPU: % of the copy bandwidth measured here), and runs the engine with
# `decode_backend="graphs"` and `"pdl"` side by side. On a CPU the GEMV runs in Triton's interpreter at
# tiny shapes, as a correctness check only: no timing is shown, because the interpreter's time says
# nothing about a GPU's.

# %%
import itertools
import json
import os
import statistics
import time

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)  # tiny shapes: more threads only wait on each other

import matplotlib.pyplot as plt
import numpy as np
import torch.nn.functional as F

import minillm.kernels.flash_decode as fd_module
import minillm.layers.attention as attn_module
from minillm import notebook as nb
from minillm.bench.table import print_table
from minillm.config import PRESETS, ModelConfig
from minillm.hw import time_it
from minillm.kernels import gemv as gemv_module
from minillm.kernels.gemv import gemv, gemv_config, gemv_ref
from minillm.labs import ch18

nb.header("18")
dev = nb.device()
T0 = time.perf_counter()
RESULT = {"header": nb.header_line("18")}
MODELS = ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b", "llama-3-8b"]

# %% [markdown]
# ## 1. The floor: bytes over bandwidth
#
# A step reads every parameter once (a tied embedding once, as the LM head; an untied input embedding
# only the row it looks up). Counted on the "meta" device from each model's real config, and the floor
# at the H200's data-sheet 4.8 TB/s:

# %%
# NBVAL_CHECK_OUTPUT
SPEC_BW = 4.8e12  # bytes/s, the H200's data sheet


def weight_bytes(c: ModelConfig) -> int:
    total = 2 * c.num_params  # bf16
    if not c.tie_word_embeddings:
        total -= 2 * (c.vocab_size - 1) * c.hidden_size  # the input embedding: one row a step
    return total


configs = {m: ModelConfig(**PRESETS[m], name=m) for m in MODELS}
W = {m: weight_bytes(c) for m, c in configs.items()}
rows = [{"model": m, "layers": c.num_layers, "GB read per step": f"{W[m] / 1e9:.3f}",
         "floor at 4.8 TB/s (µs)": f"{W[m] / SPEC_BW * 1e6:.1f}", "floor (tok/s)": f"{SPEC_BW / W[m]:.0f}"}
        for m, c in configs.items()]
print_table(rows, title="batch-1 decode: the weight-read floor (bf16)")

# %% [markdown]
# On a GPU the floor that matters is at the copy bandwidth this device actually reaches (a 1 GiB
# device-to-device copy, read + write):

# %%
if nb.on_gpu():
    from minillm.hw import measure_copy_gbps

    copy_gbps = statistics.median(measure_copy_gbps(dev, 1 << 30) for _ in range(3))
    RESULT["copy_gbps"] = round(copy_gbps, 1)
    print_table([{"model": m, "floor (µs)": W[m] / (copy_gbps * 1e9) * 1e6, "floor (tok/s)": copy_gbps * 1e9 / W[m]}
                 for m in MODELS], title=f"the floor at this GPU's copy bandwidth, {copy_gbps:,.0f} GB/s")
else:
    copy_gbps = None
    print("no GPU: the copy bandwidth, and the floors at it, are measured on a GPU run")

# %% [markdown]
# ## 2. Kernels per layer on the `pdl` backend
#
# `decode_backend="pdl"` sends each decode step of the dense Llama/Qwen3 layers through
# `LlamaDecoderLayer.forward_gemv`: four GEMVs (the RMSNorm prologues, the residual and SiLU·mul
# epilogues inside them) around RoPE + KV store and attention. We count the launches of one decode
# step of a tiny random model, through the engine (eagerly, so every launch passes through Python), by
# wrapping the three kernel entry points and counting the calls on one-token rows. The 12-token
# prompt's prefill takes the layers' own path (the GEMV path is for steps of at most 8 tokens).

# %%
counts = {"gemv": 0, "rope_store_kv": 0, "flash_decode": 0}
originals = (gemv_module.gemv, attn_module.rope_store_kv, fd_module.flash_decode)


def counted(name, fn):
    def wrapper(*args, **kwargs):
        counts[name] += args[0].shape[0] == 1  # x or q: [T, ...]; T = 1 in the decode step
        return fn(*args, **kwargs)
    return wrapper


gemv_module.gemv = counted("gemv", originals[0])
attn_module.rope_store_kv = counted("rope_store_kv", originals[1])
fd_module.flash_decode = counted("flash_decode", originals[2])
try:
    prompt = list(range(5, 17))
    tokens_pdl, _ = ch18.greedy_tokens(dev.type, "pdl", [prompt], 2, eager=True)  # a prefill, one decode step
finally:
    gemv_module.gemv, attn_module.rope_store_kv, fd_module.flash_decode = originals
tokens_graphs, _ = ch18.greedy_tokens(dev.type, "graphs", [prompt], 2, eager=True)
layers = ch18.tiny_model(dev.type).config.num_layers
per_layer = {k: v / layers for k, v in counts.items()}
print(f"one decode step of a {layers}-layer model, per layer: {per_layer}")
print(f"kernels per layer on the pdl path: {sum(per_layer.values()):.0f}")
assert tokens_pdl == tokens_graphs, (tokens_pdl, tokens_graphs)
print(f"greedy tokens, pdl == graphs: {tokens_pdl == tokens_graphs}")

# %% [markdown]
# ## 3. The GEMV against the unfused ops
#
# Every fused variant of the decode layer, on fresh random inputs: the norm prologue (QKV), the residual
# epilogue (O and down), the norm prologue with the SiLU·mul epilogue (gate/up). On a CPU, fp32 and
# small tiles at tiny shapes (so K still splits into several programs); on a GPU, bf16 at each model's
# real shapes. Then the property the fixed reduction order buys: a row gives the same bits alone as in
# a batch of 8.

# %%
def decode_linears(c: ModelConfig) -> list[dict]:
    """The four projections of a decode layer, W [N, K], and the fusion each gets on the pdl backend."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return [dict(op="qkv_proj", N=q + 2 * kv, K=c.hidden_size, norm=True, res=False, silu=False),
            dict(op="o_proj", N=c.hidden_size, K=q, norm=False, res=True, silu=False),
            dict(op="gate_up_proj", N=2 * c.intermediate_size, K=c.hidden_size, norm=True, res=False, silu=True),
            dict(op="down_proj", N=c.hidden_size, K=c.intermediate_size, norm=False, res=True, silu=False)]


DTYPE = torch.bfloat16 if nb.on_gpu() else torch.float32
PDL = nb.on_gpu() and torch.cuda.get_device_capability() >= (9, 0)  # the interpreter has no griddepcontrol
g = torch.Generator().manual_seed(18)


def inputs(s, M):
    n_out = s["N"] // 2 if s["silu"] else s["N"]
    x = torch.randn(M, s["K"], generator=g).to(dev, DTYPE)
    w = (torch.randn(s["N"], s["K"], generator=g) * s["K"] ** -0.5).to(dev, DTYPE)
    fused = dict(norm_weight=(1 + 0.2 * torch.randn(s["K"], generator=g)).to(dev, DTYPE) if s["norm"] else None,
                 residual=torch.randn(M, n_out, generator=g).to(dev, DTYPE) if s["res"] else None, silu_mul=s["silu"])
    return x, w, fused


if nb.on_gpu():
    shapes = [(m, s) for m in MODELS for s in decode_linears(configs[m])]
    tiles = None  # gemv_config's
else:  # tiny stand-ins with every variant; 8 x 64 tiles so K = 200 splits four ways
    shapes = [("tiny", dict(s, N=s["N"] // 16, K=s["K"] // 3 + 8)) for s in decode_linears(configs["smollm2-135m"])]
    tiles = (8, 64, 4)
rows = []
for model, s in shapes:
    x, w, fused = inputs(s, 4)
    batched = gemv(x, w, **fused, config=tiles, pdl=PDL)
    ref = gemv_ref(x.float(), w.float(), **{k: (v.float() if torch.is_tensor(v) else v) for k, v in fused.items()})
    err = ((batched.float() - ref).abs().max() / ref.abs().max()).item()
    alone = gemv(x[2:3], w, **{**fused, "residual": None if fused["residual"] is None else fused["residual"][2:3]},
                 config=tiles, pdl=PDL)
    rows.append({"model": model, "op": s["op"], "N x K": f"{s['N']} x {s['K']}", "max rel err": f"{err:.1e}",
                 "row alone == in batch": bool(torch.equal(alone[0], batched[2]))})
    assert err < (2e-2 if nb.on_gpu() else 1e-5) and rows[-1]["row alone == in batch"], rows[-1]
print_table(rows, title=f"gemv vs the unfused ops at M = 4 ({DTYPE})")

# %% [markdown]
# ## 4. Our GEMV against cuBLAS, % of the copy bandwidth (GPU)
#
# At $M = 1$, every decode projection of the four models. The weights are rotated through enough
# copies (≥ 160 MB, three times the L2) that every call reads HBM, as a decode step does; the calls are
# captured back to back in one CUDA graph, so the launch cost is counted and, with PDL, each launch
# overlaps its predecessor's tail as in a graphed step. µs per call = one replay / calls, median of 5
# replays; 3 repeats alternating the implementations. cuBLAS (`F.linear`) does only the projection; our
# kernel also does its fused norm or epilogue. (`scripts/gpu/floor_gemv.py` also times our kernel without
# PDL, what PDL buys a GEMV on its own, and M = 4 and 8.)

# %%
def time_us(calls) -> float:
    """µs per call, the calls cycled through inside one CUDA graph of max(32, len(calls)) calls (hw.time_it:
    median of 5 replays; the warm-up compiles and allocates outside the capture)."""
    turn = itertools.count()
    return 1e6 * time_it(lambda: calls[next(turn) % len(calls)](), warmup=3, reps=5, inner=max(32, len(calls)),
                         device=dev, cuda_graph=True)


gemv_rows = []
if nb.on_gpu():
    for model, s in shapes:
        x, w0, fused = inputs(s, 1)
        nbytes = s["N"] * s["K"] * 2
        ws = [w0] + [torch.randn_like(w0) * s["K"] ** -0.5 for _ in range(max(0, min(255, int(160e6 // nbytes))))]
        impls = {"cuBLAS": [lambda w=w, x=x: F.linear(x, w) for w in ws],
                 "ours + PDL": [lambda w=w, x=x, f=fused: gemv(x, w, **f, pdl=PDL) for w in ws]}
        times = {k: [] for k in impls}
        for _ in range(3):
            for k, calls in impls.items():
                times[k].append(time_us(calls))
        row = {"model": model, "op": s["op"], "MB": nbytes / 1e6, "config": str(gemv_config(s["N"], s["K"], s["silu"]))}
        for k, ts in times.items():
            row[f"{k} µs"] = statistics.median(ts)
            row[f"{k} % copy"] = 100 * nbytes / (statistics.median(ts) * 1e-6) / (copy_gbps * 1e9)
        gemv_rows.append(row)
        del ws
    print_table(gemv_rows, title=f"M = 1, µs per call and % of the {copy_gbps:,.0f} GB/s copy (median of 3 repeats)")
    RESULT["gemv"] = gemv_rows
else:
    print("no GPU: not timed (the interpreter's time says nothing about a GPU's); the run on a GPU fills this table")

# %%
if gemv_rows:
    fig, ax = plt.subplots(figsize=(11, 3.8))
    labels = [f"{r['model']}\n{r['op']}" for r in gemv_rows]
    xs = np.arange(len(gemv_rows))
    ax.bar(xs - 0.2, [r["cuBLAS % copy"] for r in gemv_rows], 0.4, label="cuBLAS (projection only)")
    ax.bar(xs + 0.2, [r["ours + PDL % copy"] for r in gemv_rows], 0.4, label="ours + PDL (with its fusion)")
    ax.axhline(85, color="k", ls=":", lw=1, label="issue 49's target, 85 %")
    ax.set_xticks(xs, labels, rotation=70, ha="right", fontsize=7)
    ax.set(ylabel="% of copy bandwidth", title="decode GEMVs at M = 1")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    plt.tight_layout()
    plt.show()

# %% [markdown]
# ## 5. The bubble model, and the ladder
#
# Chapter 18's accounting: a step is its bytes at a share $\eta$ of the copy bandwidth plus a fixed cost
# per kernel boundary, $t_\text{step} \approx W / (\eta B) + k\,t_b$. With $\eta = 0.85$, $B$ = 4.0 TB/s
# and $t_b$ = 1.35 µs for a graphed kernel without PDL (chapter 13's measurement), 0.6 µs with it (issue
# 49's), the model predicts each rung: `graphs` at 11 kernels a layer, `pdl` at 6, and the ≤ 5 target.
# These are predictions from stated assumptions, not measurements; the GPU run below puts the measured
# `graphs` and `pdl` rungs beside them.

# %%
# NBVAL_CHECK_OUTPUT
RUNGS = {"graphs (11 a layer)": (11, 1.35e-6), "pdl (6 a layer)": (6, 0.6e-6), "fused (5 a layer)": (5, 0.6e-6)}


def predicted_tok_s(m: str, per_layer: int, t_b: float, eta: float = 0.85, bw: float = 4.0e12) -> float:
    k = per_layer * configs[m].num_layers + 5  # + embedding, final norm, LM head, sampling
    return 1 / (W[m] / (eta * bw) + k * t_b)


pred = {m: {r: predicted_tok_s(m, *v) for r, v in RUNGS.items()} for m in MODELS}
print_table([{"model": m, "floor at 4.0 TB/s": f"{4.0e12 / W[m]:.0f}", **{r: f"{v:.0f}" for r, v in pred[m].items()}}
             for m in MODELS], title="predicted batch-1 tok/s per rung (the bubble model)")

# %% [markdown]
# ## 6. The engine: `graphs` vs `pdl` (GPU)
#
# `minillm bench latency` (batch 1, a 128-token prompt, 256 new tokens, greedy, EOS ignored) on the
# embedded SmolLM2 in bf16 and on Llama-3.2-1B's shapes with dummy weights, the two backends
# alternating, 3 repeats. Then the embedded model's greedy tokens under both backends. They are not
# bitwise equal by design (cuBLAS and our GEMV add in different orders, and bf16 rounds the
# difference), so the result is the first position where they part; a wrong PDL wait would show as
# garbage from the first token.

# %%
e2e = []
if nb.on_gpu():
    from minillm import LLM, SamplingParams
    from minillm.bench.serving import latency

    cases = [("smollm2-135m (embedded, bf16)", None), ("llama-3.2-1b (dummy)", "llama-3.2-1b-dummy")]
    for rep in range(3):
        for label, model in cases:
            for backend in ("graphs", "pdl"):
                r = latency(model, hf=False, num_iters=1, num_iters_warmup=1, progress=False, decode_backend=backend,
                            max_num_seqs=1, num_gpu_blocks=64)
                e2e.append({"model": label, "backend": backend, "repeat": rep,
                            "tok/s": r["minillm"]["decode_tok_s"], "% of floor": r["minillm"]["pct_of_floor"],
                            "floor tok/s": r["minillm"]["floor_tok_s"]})
    summary = [{"model": label, "backend": b,
                **{f"tok/s {k}": f(v) for k, f in (("median", statistics.median), ("min", min), ("max", max))
                   for v in [[r["tok/s"] for r in e2e if r["model"] == label and r["backend"] == b]]},
                "% of floor": statistics.median(r["% of floor"] for r in e2e if r["model"] == label and r["backend"] == b)}
               for label, _ in cases for b in ("graphs", "pdl")]
    print_table(summary, title="batch-1 decode, 3 alternating repeats")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    toks = {}
    for backend in ("graphs", "pdl"):
        llm = LLM(dtype="bfloat16", decode_backend=backend, max_num_seqs=2, num_gpu_blocks=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        toks[backend] = [o.outputs[0].token_ids for o in outs]
        print(f"{backend:6}: {prompts[0]!r} -> {outs[0].outputs[0].text[:70]!r}")
        del llm
        torch.cuda.empty_cache()
    parts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(toks["graphs"], toks["pdl"])]
    print(f"graphs vs pdl greedy tokens: first difference per prompt {parts} (None: all 32 equal)")
    RESULT["e2e"], RESULT["e2e_summary"], RESULT["first_difference"] = e2e, summary, parts
else:
    print("no GPU: the engine's tok/s are measured on a GPU run (section 2 showed pdl == graphs tokens on a CPU)")

# %%
fig, ax = plt.subplots(figsize=(10, 3.8))
xs = np.arange(len(MODELS))
width = 0.2
ax.bar(xs - 1.5 * width, [4.0e12 / W[m] for m in MODELS], width, color="lightgray", label="floor at 4.0 TB/s")
for i, r in enumerate(RUNGS):
    ax.bar(xs + (i - 0.5) * width, [pred[m][r] for m in MODELS], width, alpha=0.45, label=f"predicted: {r}")
for label_m, m in (("smollm2-135m (embedded, bf16)", "smollm2-135m"), ("llama-3.2-1b (dummy)", "llama-3.2-1b")):
    for j, b in enumerate(("graphs", "pdl")):
        vals = [r["tok/s"] for r in e2e if r["model"] == label_m and r["backend"] == b]
        if vals:
            ax.plot(MODELS.index(m) + (j - 0.5) * width, statistics.median(vals), "k*", ms=12,
                    label="measured (median of 3)" if (m, b) == ("smollm2-135m", "graphs") else None)
ax.set_yscale("log")
ax.set_xticks(xs, MODELS)
ax.set(ylabel="batch-1 decode tok/s", title="the ladder: floor, predicted rungs" + (", measured" if e2e else ""))
ax.legend(fontsize=8)
ax.grid(True, axis="y", alpha=0.3)
plt.tight_layout()
plt.show()

# %%
RESULT["predicted_tok_s"] = pred
RESULT["weight_bytes"] = W
if os.environ.get("MINILLM_BENCH_JSON"):
    with open(os.environ["MINILLM_BENCH_JSON"], "w") as f:
        json.dump(RESULT, f, indent=1, default=str)
    print("results written to $MINILLM_BENCH_JSON")
print(f"notebook wall time: {time.perf_counter() - T0:.0f} s")
