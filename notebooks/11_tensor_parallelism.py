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
# # 11 · Tensor parallelism: one model across several processes
#
# Split every large weight across $p$ processes and each reads $1/p$ of the bytes per decode step; the
# price is that the processes must meet — an all-reduce after every attention block and every MLP. This
# notebook shows the split on the embedded model's own layers (each rank's shard, combined, is the
# unsharded layer), counts the bytes each rank holds, fits the α–β cost model to all-reduces measured
# on this machine, times one rank's GEMMs on a GPU, predicts what TP = 2, 4 and 8 buy Llama-3-8B, measures
# TP = 1 and 2 on two GPUs beside that prediction, and ends with the oracle: a model split over two
# spawned processes decodes the tokens of one process.

# %%
import gc
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)  # tiny CPU shapes: more threads only wait on each other

import matplotlib.pyplot as plt
import transformers

import minillm
from minillm import LLM, SamplingParams
from minillm import notebook as nb
from minillm.bench.serving import latency
from minillm.bench.serving_setup import NoTextTokenizer
from minillm.bench.table import print_table
from minillm.cache import bytes_per_token, kv_cache_spec
from minillm.config import preset
from minillm.distributed import run_ranks, simulate_tensor_parallel, tensor_parallel_sizes
from minillm.distributed.cost_model import fit_alpha_beta
from minillm.distributed.greedy import decode_rank, greedy_decode
from minillm.distributed.measure import measure_allreduce
from minillm.engine import EngineConfig, LLMEngine
from minillm.hw import measure_copy_gbps, time_it
from minillm.layers import (
    AttentionMetadata,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
)
from minillm.loader import load_model
from minillm.models.registry import get_model_class

nb.header("11")
dev = nb.device()
T0 = time.perf_counter()
EPS = torch.finfo(torch.float32).eps
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()  # no frozen progress bars in the stored outputs

# %% [markdown]
# ## 1. The layout, on the embedded model's layers
#
# The embedded SmolLM2-135M has 9 query heads and 3 KV heads, so it splits at $p = 3$ only (the sizes
# that split every layer are listed below). `simulate_tensor_parallel(r, p)` lets this one process
# play rank $r$ of $p$: the model is built with rank $r$'s shard of every layer, `load_model` fills it
# through the layers' `weight_loader`s, and each collective returns this rank's own part, so we can do
# the summing and concatenating ourselves and compare with the unsharded model (fp32, the same prompt):
#
# | block | layers | combine over ranks |
# |---|---|---|
# | attention | `qkv_proj` column-parallel (3 query heads + 1 KV head per rank) → attention on its heads → `o_proj` row-parallel | **sum** = all-reduce #1 |
# | MLP | `gate_up_proj` column-parallel (512 of 1536 rows of gate and of up) → SiLU·mul → `down_proj` row-parallel | **sum** = all-reduce #2 |
#
# Within a block nothing crosses ranks: the column-parallel output is split by features, exactly what
# the row-parallel layer wants as its input. The error allowed is the reordering of a row-parallel
# sum: $K\varepsilon\,|x|\,|W|^\top$ for $K$ input features split into $p$ partial sums.

# %%
full, cfg, tok = load_model(None, dtype=torch.float32, device=dev)
P_EMBEDDED = max(tensor_parallel_sizes(cfg))
print(f"{cfg.name}: {cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads, FFN {cfg.intermediate_size}: "
      f"splits at p in {tensor_parallel_sizes(cfg)}")
ranks = []
for r in range(P_EMBEDDED):
    with simulate_tensor_parallel(r, P_EMBEDDED):
        ranks.append(load_model(None, dtype=torch.float32, device=dev, tokenizer=False)[0])  # rank r's shard only

ids = torch.tensor(tok.encode("Tensor parallelism splits every weight matrix across GPUs."), device=dev)  # [T]
T = len(ids)
positions = torch.arange(T, device=dev)
meta = AttentionMetadata.from_seq_lens([T], dev)
cos_sin = full.model.rotary_emb.cos_sin(positions, torch.float32)
L0 = full.model.layers[0]


def row_bound(x_in: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Reordering a sum of K products moves it by at most K * eps * |x| @ |w|^T (per output element)."""
    return x_in.shape[-1] * EPS * (x_in.abs() @ w.abs().T)


captured = {}
hooks = [L0.self_attn.o_proj.register_forward_pre_hook(lambda m, a: captured.__setitem__("o_in", a[0])),
         L0.mlp.down_proj.register_forward_pre_hook(lambda m, a: captured.__setitem__("down_in", a[0]))]
with torch.inference_mode():
    h = full.model.embed_tokens(ids)  # [T, hidden]
    x = L0.input_layernorm(h)
    attn_full = L0.self_attn(positions, x, meta, cos_sin)  # [T, hidden]
    x2 = L0.post_attention_layernorm(h + attn_full)
    mlp_full = L0.mlp(x2)  # [T, hidden]
    attn_parts = [m.model.layers[0].self_attn(positions, x, meta, cos_sin) for m in ranks]  # partial sums
    mlp_parts = [m.model.layers[0].mlp(x2) for m in ranks]
for hk in hooks:
    hk.remove()

rows = []
for name, parts, want, bound in (
        ("attention block (o_proj)", attn_parts, attn_full, row_bound(captured["o_in"], L0.self_attn.o_proj.weight)),
        ("MLP block (down_proj)", mlp_parts, mlp_full, row_bound(captured["down_in"], L0.mlp.down_proj.weight))):
    err = (sum(parts) - want).abs()  # [T, hidden]
    assert (err <= 4 * bound + 1e-6).all(), name  # 4x: the heads' own attention may round differently too
    alone = (parts[0] - want).abs().max().item()
    rows.append({"block": name, "ranks": P_EMBEDDED, "max_err_of_sum": err.max().item(),
                 "err_over_bound": (err / (bound + 1e-30)).max().item(), "rank0_alone_err": alone})
print_table(rows, title=f"layer 0 of {cfg.name}: the ranks' partial outputs, summed, against the unsharded block")

shapes = []
for lname, get in (("qkv_proj", lambda m: m.model.layers[0].self_attn.qkv_proj),
                   ("o_proj", lambda m: m.model.layers[0].self_attn.o_proj),
                   ("gate_up_proj", lambda m: m.model.layers[0].mlp.gate_up_proj),
                   ("down_proj", lambda m: m.model.layers[0].mlp.down_proj),
                   ("embed_tokens", lambda m: m.model.embed_tokens), ("lm_head", lambda m: m.lm_head)):
    shapes.append({"layer": lname, "kind": type(get(full)).__name__, "full_weight": tuple(get(full).weight.shape),
                   "rank_weight": tuple(get(ranks[0]).weight.shape)})
print_table(shapes, title=f"what rank 0 of {P_EMBEDDED} holds")

# %% [markdown]
# A rank's partial output alone is far from the block's output (the last column): only the sum of all
# of them is the block. That sum is the all-reduce — two per layer, so a forward pass of $L$ layers makes
# $2L$ of them, plus one for the embedding.
#
# ## 2. The vocabulary: the embedding's mask and the head's slices
#
# The embedding table is split by rows: rank $r$ holds tokens $[r\lceil V/p\rceil, (r+1)\lceil V/p\rceil)$.
# A token outside that range looks up row 0 and is multiplied by zero, so each rank's output has real
# rows only for its own tokens; the all-reduce adds one real row to $p - 1$ zero rows — exactly. The
# LM head (tied to the same table here) makes each rank's slice of the logits, gathered to rank 0, the
# rank that samples.

# %%
with torch.inference_mode():
    emb_parts = [m.model.embed_tokens(ids) for m in ranks]  # [T, hidden] each: zeros outside its rows
    last = full.model(ids, positions, meta)[meta.last_token_indices]  # [1, hidden]
    logits_full = full.compute_logits(last)  # [1, V]
    logit_parts = [m.lm_head.compute_logits(last) for m in ranks]  # [1, ceil(V / p)] each
rows = []
for r, (m, e) in enumerate(zip(ranks, emb_parts)):
    et = m.model.embed_tokens
    mine = ((ids >= et.vocab_start) & (ids < et.vocab_end))
    assert torch.equal(e.abs().sum(-1) > 0, mine), "rows only for this rank's tokens"
    rows.append({"rank": r, "vocab_rows": f"[{et.vocab_start}, {et.vocab_end})", "tokens_here": int(mine.sum()),
                 "nonzero_rows": int((e.abs().sum(-1) > 0).sum()), "logit_columns": logit_parts[r].shape[-1]})
print_table(rows, title=f"the prompt's {T} tokens over {P_EMBEDDED} ranks")
assert torch.equal(sum(emb_parts), full.model.embed_tokens(ids)), "one real row plus zeros: exact"
logits_cat = torch.cat(logit_parts, -1)[..., :cfg.vocab_size]  # cut the overhang, as the gather does
head_err = (logits_cat - logits_full).abs().max().item()
assert head_err <= cfg.hidden_size * EPS * (last.abs() @ full.lm_head.weight.abs().T).max().item()
print(f"embedding: sum over ranks == the full lookup (exactly); LM head: concatenated slices == the full "
      f"logits (max |err| {head_err:.1e}), same argmax: {bool(logits_cat.argmax() == logits_full.argmax())}")
del ranks

# %% [markdown]
# ## 3. Bytes per rank
#
# Each rank reads its own weights every decode step, so the bytes per rank set the floor of a step's
# time. They come from building the model on the `meta` device (nothing allocated) as each rank and
# counting its parameters in bf16: the norms are replicated, the KV heads are split (or replicated when
# there are fewer than ranks), the vocabulary gets $\lceil V/p \rceil$ rows. The count of all-reduces
# comes from the built model too: one per row-parallel layer, one for the embedding.


# %%
def per_rank(config, p: int, dtype=torch.bfloat16) -> dict:
    """Rank 0's parameter bytes, KV bytes per token and all-reduces per forward, from the model built as it."""
    with simulate_tensor_parallel(0, p), torch.device("meta"):
        m = get_model_class(config.architecture)(config)
    weights = sum(x.numel() for x in m.parameters()) * dtype.itemsize  # a tied table counted once
    reduces = sum(isinstance(x, RowParallelLinear) for x in m.modules()) + 1 if p > 1 else 0  # + the embedding
    return {"weights": weights, "kv_per_token": bytes_per_token(kv_cache_spec(m, dtype)), "allreduces": reduces}


LLAMA = preset("llama-3-8b")
bytes_rows, llama = [], {}
for config, sizes in ((cfg, [1, P_EMBEDDED]), (LLAMA, [1, 2, 4, 8])):
    base = per_rank(config, 1)
    for p in sizes:
        d = per_rank(config, p)
        if config is LLAMA:
            llama[p] = d
        bytes_rows.append({"model": config.name, "p": p, "weights_GB_per_rank": d["weights"] / 1e9,
                           "share_of_p1": d["weights"] / base["weights"], "kv_B_per_token": d["kv_per_token"],
                           "allreduces_per_step": d["allreduces"],
                           "message_B_batch1": config.hidden_size * 2 if p > 1 else 0})
print_table(bytes_rows, title="per rank, bf16 weights (built as rank 0 on the meta device)")

# %% [markdown]
# A share a little above $1/p$ is the replicated norms. The message each all-reduce moves at batch 1 is
# one token's hidden state in bf16: for Llama-3-8B a few KB, $2L + 1$ times per step. At that size the
# bandwidth hardly matters; the fixed cost per call does. So the next step is to measure that cost.
#
# ## 4. What an all-reduce costs here: the α–β model, fitted
#
# `measure_allreduce` spawns two ranks (`minillm/distributed/launch.py`) and times all-reduces from 8 KB
# up. The backend follows the machine: **NCCL** with one GPU per rank on a machine with two or more;
# on a machine with **one GPU, gloo with CUDA tensors** (NCCL cannot put two ranks on one GPU), which
# copies through host memory and is far slower than NCCL over NVLink — a lower bound on what TP can
# do, not a measurement of it; on a CPU, gloo between two processes. `fit_alpha_beta`
# (`minillm/distributed/cost_model.py`) fits $T(n) = 2(p-1)\alpha + \frac{2(p-1)}{p}\frac{n}{\beta}$ (ring)
# and $\alpha + (p-1)\frac{n}{\beta}$ (one-shot) by least squares on relative errors.
#
# On NCCL each size is timed twice: **eager**, each all-reduce launched from Python, and **in a CUDA
# graph**, a loop of them recorded once and replayed. The prediction in §6 uses the in-graph fit,
# because that is how the engine runs them: its decode step is one graph replay (chapter 07), the
# all-reduces inside it included, so no all-reduce of a step pays a launch from the host; the gap
# between the two series below is what that saves here. gloo works on the host, and a CUDA graph
# records GPU work only, so on one GPU and on a CPU there are eager times alone, and the prediction
# uses them.

# %%
sizes = [8192 * 4**i for i in range(nb.pick(cpu=6, gpu=7))]  # 8 KB ... 8 MB (CPU), 32 MB (GPU)
for attempt in range(3):  # a busy machine can upset one sweep's small sizes; the fit then says so: measure again
    # eager, and on NCCL also replayed from a CUDA graph (each after a sum check on random integers)
    ar = measure_allreduce(sizes, world_size=2, iters=nb.pick(cpu=10, gpu=50), repeats=nb.pick(cpu=3, gpu=7))
    times = {"eager": ar["seconds"], **({"graph": ar["graph_seconds"]} if ar["graph_seconds"] else {})}
    try:
        fits = {(mode, alg): fit_alpha_beta(ar["sizes"], t, 2, alg) for mode, t in times.items()
                for alg in ("ring", "one_shot")}
        break
    except ValueError as e:
        print(f"sweep {attempt + 1}: {e}")
ENGINE_MODE = "graph" if "graph" in times else "eager"  # how the engine's step runs its all-reduces here
print(f"backend {ar['backend']} on {ar['device']} tensors, {ar['world_size']} spawned ranks "
      f"(ranks' medians within {ar['rank_spread']:.2f}x of each other)"
      + ("" if "graph" in times else f"; {ar['backend']} cannot be captured in a CUDA graph: eager times only"))
rows = [{"bytes": n, **{f"{mode}_us": 1e6 * t[i] for mode, t in times.items()},
         **{f"{mode}_ring_fit_us": 1e6 * fits[mode, "ring"].allreduce_time(n, 2) for mode in times},
         **{f"{mode}_algbw_GBps": n / t[i] / 1e9 for mode, t in times.items()}} for i, n in enumerate(ar["sizes"])]
print_table(rows, title=f"all-reduce of n bytes over 2 ranks ({ar['backend']}, {ar['device']})")
for (mode, alg), f in fits.items():
    worst = max(abs(f.allreduce_time(n, 2) / t - 1) for n, t in zip(ar["sizes"], times[mode]))
    print(f"{mode:>5} {alg:>8}: alpha {1e6 * f.alpha:8.1f} us, beta {f.beta / 1e9:7.2f} GB/s, "
          f"worst relative error {worst:.0%}")
ring = fits[ENGINE_MODE, "ring"]
print(f"the prediction below uses the {ENGINE_MODE} ring fit: {1e6 * ring.allreduce_time(LLAMA.hidden_size * 2, 2):.1f} "
      f"µs per all-reduce of one Llama-3-8B token ({LLAMA.hidden_size * 2} B)")

fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
grid = [sizes[0] * 2 ** (i / 4) for i in range(4 * (len(sizes) - 1) * 2 + 1)]
for mode, t in times.items():
    pts = ax.loglog(ar["sizes"], [1e6 * x for x in t], "o" if mode == "eager" else "s",
                    label=f"measured, {mode} ({ar['backend']}, {ar['device']})")
    f = fits[mode, "ring"]
    ax.loglog(grid, [1e6 * f.allreduce_time(n, 2) for n in grid], "-", color=pts[0].get_color(),
              label=f"{mode} fit: ring α {1e6 * f.alpha:.1f} µs (one-shot {1e6 * fits[mode, 'one_shot'].alpha:.1f}), "
                    f"β {f.beta / 1e9:.1f} GB/s")
ax.axvline(LLAMA.hidden_size * 2, color="0.6", lw=0.8)
ax.text(LLAMA.hidden_size * 2, ax.get_ylim()[1], " Llama-3-8B decode\n message (batch 1)", va="top", fontsize=8)
ax.set(xlabel="message (bytes)", ylabel="µs per all-reduce", title="all-reduce time over 2 ranks, and the α–β fit")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Flat at the left (α: the fixed cost), a slope of one at the right (β: the bandwidth). A decode message
# sits at the far left, where only α counts. At $p = 2$ the ring and the one-shot all-reduce move the
# same bytes and differ only in how many α they pay (2 against 1), so both fit the same curve, with α
# halved for the ring; they part at $p \ge 4$, where the prediction below uses the ring. On NCCL the
# eager and the graphed series part at the left, where an eager call's launch from the host is most of
# its time and a replay has none, and meet at the right, where moving the bytes is the time.
#
# ## 5. One rank's GEMMs on the GPU
#
# The other term of a step is each rank reading its weights. A rank's shard of Llama-3-8B is minillm's
# own layers built as rank 0 of $p$ (`simulate_tensor_parallel`) with random bf16 weights, at batch 1;
# each layer is timed replayed from a CUDA graph and a step's worth summed: $L$ × (QKV + O + gate-up +
# down) + the LM head. Beside it, the floor: the rank's weight bytes at this GPU's measured copy
# bandwidth.

# %%
def shard_gemm_ms(config, p: int) -> float:
    """ms of one decode step's linear layers (batch 1) on rank 0 of p: minillm's layers, timed on the GPU."""
    H, D, I = config.hidden_size, config.head_dim, config.intermediate_size
    with simulate_tensor_parallel(0, p):
        layers = [QKVParallelLinear(H, D, config.num_heads, config.num_kv_heads),
                  RowParallelLinear(config.num_heads * D, H), MergedColumnParallelLinear(H, [I, I]),
                  RowParallelLinear(I, H)]
        head = ParallelLMHead(config.vocab_size, H)
    total = 0.0
    with torch.inference_mode():
        for layer in layers:
            layer.to(dev, torch.bfloat16).weight.normal_(0, 0.02)
            x = torch.randn(1, layer.weight.shape[1], device=dev, dtype=torch.bfloat16)  # this rank's input
            total += config.num_layers * time_it(lambda layer=layer, x=x: layer(x), device=dev, cuda_graph=True)
        head.to(dev, torch.bfloat16).weight.normal_(0, 0.02)
        x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
        total += time_it(lambda: head.compute_logits(x), device=dev, cuda_graph=True)
    return 1e3 * total


copy_gbps = measure_copy_gbps(dev, nb.pick(cpu=64 << 20, gpu=1 << 30))
floor_ms = {p: 1e3 * llama[p]["weights"] / (copy_gbps * 1e9) for p in llama}
if nb.on_gpu():
    gemm_ms = {p: shard_gemm_ms(LLAMA, p) for p in llama}
    print_table([{"p": p, "gemm_ms_per_step": gemm_ms[p], "floor_ms": floor_ms[p],
                  "pct_of_floor": 100 * floor_ms[p] / gemm_ms[p], "vs_p1": gemm_ms[1] / gemm_ms[p]} for p in llama],
                title=f"rank 0's linear layers, one Llama-3-8B decode step at batch 1 (copy {copy_gbps:.0f} GB/s)")
else:
    gemm_ms = None
    print(f"no GPU: one rank's GEMMs at Llama-3-8B shapes are timed only on a GPU (on this CPU each would "
          f"take seconds and measure nothing the GPU run needs); section 6 uses the weight-reading floor at "
          f"this machine's measured copy bandwidth ({copy_gbps:.1f} GB/s) instead")

# %% [markdown]
# ## 6. Predicted TP = 2, 4, 8 for Llama-3-8B, beside gpt-fast
#
# A batch-1 decode step at size $p$: the weight term (§5: measured GEMMs on a GPU, the floor at the
# measured copy bandwidth on a CPU) plus $2L + 1$ all-reduces of one token's hidden state at the fitted
# α–β (ring; the in-graph fit on NCCL, as the engine replays its step, the eager one elsewhere). The
# fit was made on 2 ranks; for 4 and 8 the ring formula carries it, which assumes the
# same link between every pair — an extrapolation. The published anchor is gpt-fast's: Llama-3.1-8B at
# batch 1 on A100s (330 W), 93.83 tok/s on one GPU, 149.10 on two (1.59×), 217.21 on four, 276.01 on
# eight; Llama-2-7B 104.9 → 168.84 (1.61×) at TP = 2 (the gpt-fast README, github.com/pytorch-labs/gpt-fast,
# commit 32971d3).

# %%
GPT_FAST_TOK_S = {1: 93.83, 2: 149.10, 4: 217.21, 8: 276.01}  # published: Llama-3.1-8B, A100, gpt-fast README
weights_ms = gemm_ms or floor_ms
message = LLAMA.hidden_size * 2  # one token's hidden state, bf16
rows = []
for p in llama:
    comm_ms = 1e3 * llama[p]["allreduces"] * ring.allreduce_time(message, p)
    step_ms = weights_ms[p] + comm_ms
    rows.append({"p": p, "weights_ms": weights_ms[p], "comm_ms": comm_ms, "step_ms": step_ms,
                 "predicted_speedup": (weights_ms[1]) / step_ms, "gpt_fast_A100": GPT_FAST_TOK_S[p] / GPT_FAST_TOK_S[1]})
print_table(rows, title=f"Llama-3-8B batch-1 decode step, predicted on this machine ({ar['backend']} all-reduce, "
            f"{ENGINE_MODE} fit, weights from {'measured GEMMs' if gemm_ms else 'the copy-bandwidth floor'})")
need = {p: (weights_ms[1] / 1.5 - weights_ms[p]) / llama[p]["allreduces"] for p in (2,)}
print(f"for 1.5x at p = 2 each of the {llama[2]['allreduces']} all-reduces must take under {1e3 * need[2]:.1f} µs; "
      f"the {ENGINE_MODE} fit here gives {1e6 * ring.allreduce_time(message, 2):.1f} µs")

fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
ps = list(llama)
ax.plot(ps, ps, ":", color="0.5", label="ideal (weights / p, free all-reduces)")
ax.plot(ps, [r["predicted_speedup"] for r in rows], "o-",
        label=f"predicted here ({ar['backend']}, {ar['device']}, {ENGINE_MODE} all-reduce)")
ax.plot(ps, [GPT_FAST_TOK_S[p] / GPT_FAST_TOK_S[1] for p in ps], "s--", label="gpt-fast, A100 (published)")
ax.set_xscale("log", base=2)
ax.set_xticks(ps, [str(p) for p in ps])
ax.set(xlabel="tensor-parallel size p", ylabel="speedup over p = 1", title="Llama-3-8B batch-1 decode")
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# The gap between the ideal line and gpt-fast's points is the all-reduces (and GEMMs that do not shrink
# as cleanly as their weights): each rank's weight time divides by $p$, but the $2L + 1$ latency-bound
# calls per step do not, and at $p = 8$ they are a large part of the step. Whether TP pays on a machine
# is the ratio of the two terms: the line above says how short each all-reduce must be for 1.5× at
# $p = 2$, to compare with the fitted time. Only a machine with two GPUs on NCCL measures the real
# step: the next section.
#
# ## 7. Measured: the engine at TP = 1 and 2, beside the prediction
#
# On a machine with two or more GPUs, `minillm bench latency` runs here twice
# (`minillm/bench/serving.py`): Llama-3-8B's shapes with dummy weights, batch 1, a 128-token prompt and
# 256 new tokens, the median of 3 runs after a warm-up, CUDA graphs on — first in this process alone,
# then with this process as rank 0 and one worker process on the second GPU (NCCL). Each run's engine
# is shut down before the next starts, so the second one has the GPU's memory to itself. The measured
# step is the median time per output token (TPOT p50: the gaps between consecutive tokens of the 3 timed
# runs); the predicted step is §6's: the weight term of §5 plus $2L + 1$ all-reduces at the in-graph fit. The prediction leaves out attention, the norms, the
# sampling and the host, so it should come in under the measurement; how far under is the error column.
# On a machine with fewer GPUs the cell says what it would run and shows the committed two-GPU run,
# labelled with its GPU, date and commit — not this machine's numbers.

# %%
BENCH_DIR = "chapters/bench/h200x2-2026-11-25"  # the committed two-GPU run shown where this machine has < 2 GPUs
pred_ms = {r["p"]: r["step_ms"] for r in rows}
ON_TWO_GPUS = nb.on_gpu() and torch.cuda.device_count() >= 2
if ON_TWO_GPUS:
    measured = {}
    for p in (1, 2):
        gc.collect()  # the engine is shut down inside latency(); let its model and KV pool go before the next
        torch.cuda.empty_cache()
        print(f"before TP = {p}: {torch.cuda.memory_allocated() / 1e9:.2f} GB allocated on GPU 0")
        res = latency("llama-3-8b-dummy", hf=False, progress=False, tensor_parallel_size=p)
        measured[p] = res["minillm"]["tpot_p50_ms"]
        print()
    source = f"measured here: {torch.cuda.get_device_name()} x 2, NCCL"
else:
    found = [d / BENCH_DIR for d in (Path.cwd().parent, Path(minillm.__file__).resolve().parents[1])
             if (d / BENCH_DIR).is_dir()]
    print(f"{torch.cuda.device_count()} GPU(s) here: on two or more this cell runs `minillm bench latency --model "
          f"llama-3-8b-dummy --no-hf --tensor-parallel-size 1` and `... 2` (batch 1, 128 + 256 tokens) and puts "
          f"the median TPOT beside §6's prediction")
    stored = {p: json.loads((found[0] / f"latency-llama-3-8b-tp{p}.json").read_text()) for p in (1, 2)} if found \
        else None
    if stored:
        head = stored[2]["header"]
        commit = re.search(r"commit ([0-9a-f]{7,})", (found[0] / "README.md").read_text())
        measured = {p: stored[p]["minillm"]["tpot_p50_ms"] for p in (1, 2)}
        source = (f"stored: {stored[2]['ceilings']['device']} x 2 {re.search(r'20[0-9]{2}-[0-9]{2}-[0-9]{2}', head)[0]} "
                  f"commit {commit[1] if commit else 'unknown'} from {BENCH_DIR}, not this run's")
    else:
        measured, source = None, None
        print(f"(no {BENCH_DIR} beside this notebook to show the committed run from)")
if measured:
    print_table([{"p": p, **({"predicted_step_ms": pred_ms[p]} if ON_TWO_GPUS else {}), "measured_step_ms": measured[p],
                  **({"error_pct": 100 * (pred_ms[p] / measured[p] - 1)} if ON_TWO_GPUS else {}),
                  "measured_speedup": measured[1] / measured[p], "gpt_fast_A100": GPT_FAST_TOK_S[p] / GPT_FAST_TOK_S[1]}
                 for p in (1, 2)], title=f"Llama-3-8B batch-1 decode step, TP = 1 and 2 ({source})")
    if not ON_TWO_GPUS:
        print("no predicted column: §6 predicted this machine's step, and the stored measurement is another machine's")

# %% [markdown]
# ## 8. The oracle: TP = 2 in two processes decodes the tokens of one
#
# A tiny random Llama checkpoint written by transformers (4 query heads, 2 KV heads, an odd vocabulary
# of 321 so the last rank's slice has an overhang); two spawned ranks on gloo each load only their shard
# through `load_model`, and decode greedily (`minillm/distributed/greedy.py`): rank 0 gathers the
# logits, picks each token and broadcasts it. The reference is one process's `LLMEngine`.

# %%
WORK = Path(tempfile.mkdtemp(prefix="minillm-nb11-"))
tiny_cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=321, max_position_embeddings=256)
torch.manual_seed(11)
hf = transformers.AutoModelForCausalLM.from_config(tiny_cfg, dtype=torch.float32)
with torch.no_grad():  # weights well above HF's 0.02 init: logits with clear winners
    for prm in hf.parameters():
        prm.normal_(0, 0.2).add_(1.0) if prm.dim() == 1 else prm.normal_(0, 0.2)
folder = WORK / "tiny-llama"
hf.save_pretrained(folder)
tiny, _, _ = load_model(folder, tokenizer=False)  # p = 1, this process
new = 16
g = torch.Generator().manual_seed(int(time.time()))  # fresh prompts every run
for _ in range(16):  # one whose p = 1 run has no near-tie (splitting a sum moves a logit by ~1e-6 here)
    prompt = torch.randint(0, tiny_cfg.vocab_size, (9,), generator=g).tolist()
    alone = greedy_decode(tiny, prompt, new)
    if alone["min_margin"] > 1e-3:
        break
engine = LLMEngine(tiny, NoTextTokenizer(), [], EngineConfig(num_gpu_blocks=16), progress=False)
engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
tp1 = None
while engine.has_unfinished_requests():
    tp1 = next((o.outputs[0].token_ids for o in engine.step() if o.finished), tp1)
engine.shutdown()

t = time.perf_counter()
got = run_ranks(decode_rank, 2, str(folder), prompt, new, backend="gloo", timeout=180)  # CPU tensors, 2 processes
spawn_s = time.perf_counter() - t
whole = {"qkv_proj": tiny.model.layers[0].self_attn.qkv_proj, "down_proj": tiny.model.layers[0].mlp.down_proj,
         "lm_head": tiny.lm_head}
print_table([{"rank": r, **{k: str(g_["shard"][k]) for k in whole}, "steps_with_logits": g_["steps_with_logits"]}
             for r, g_ in enumerate(got)] + [{"rank": "p = 1", **{k: str(tuple(m.weight.shape)) for k, m in whole.items()},
                                              "steps_with_logits": new}],
            title="each rank's shard of layer 0 and the head, and the whole layers (p = 1)")
assert alone["tokens"] == tp1, "the two one-process paths agree"
assert got[0]["tokens"] == got[1]["tokens"] == tp1, (got[0]["tokens"], got[1]["tokens"], tp1)
assert got[0]["steps_with_logits"] == new and got[1]["steps_with_logits"] == 0, "logits go to rank 0 only"
print(f"prompt {prompt}\n  TP = 1 (LLMEngine):  {tp1}\n  TP = 2 (2 processes): {got[0]['tokens']}  "
      f"(equal; the group ran in {spawn_s:.0f} s with its start-up)")

# %% [markdown]
# ## 9. The engine on several ranks: `LLM(model, tensor_parallel_size=N)`
#
# Everything above started the ranks by hand. The engine does it itself: `LLM(...,
# tensor_parallel_size=N)` makes this process rank 0 (it schedules, samples and holds a worker of its
# own) and starts N - 1 worker processes (`minillm/worker/worker_proc.py`), each of which loads only its
# shard and then runs whatever rank 0 sends it: every executor call (`minillm/executor/
# multiproc_executor.py`) is broadcast as plain data, the step's `ModelInput` included, so the
# all-reduces inside the forward pass meet in the same order on every rank. How many KV blocks fit is
# the minimum over the ranks; only rank 0 receives logits.
#
# The embedded model has 9 query heads and 3 KV heads, so it splits at 3 only; we run it as 3 CPU
# processes (gloo), on any machine, and compare with the same prompts at size 1.

# %%
tp_prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
tp_params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
t0 = time.perf_counter()
with LLM(device="cpu", dtype="float32") as one:
    want = [o.outputs[0] for o in one.generate(tp_prompts, tp_params, use_tqdm=False)]
t1 = time.perf_counter()
with LLM(device="cpu", dtype="float32", tensor_parallel_size=3) as three:
    got = [o.outputs[0] for o in three.generate(tp_prompts, tp_params, use_tqdm=False)]
    print(f"rank 0 holds {sum(p.numel() for p in three.model.parameters()) / 1e6:.1f} M of the model's "
          f"{sum(p.numel() for p in one.model.parameters()) / 1e6:.1f} M parameters (norms and biases replicated)")
t2 = time.perf_counter()
for prompt, w, g in zip(tp_prompts, want, got):
    print(f"{prompt!r:28} size 1: {w.text!r:40} size 3: {'same tokens' if g.token_ids == w.token_ids else g.text!r}")
assert [g.token_ids for g in got] == [w.token_ids for w in want]
print(f"size 1 in {t1 - t0:.1f} s, size 3 in {t2 - t1:.1f} s (3 processes starting, loading and sharing this "
      f"machine's cores: tensor parallelism on one CPU is a correctness demo, not a speed-up)")

# %% [markdown]
# ## What this notebook showed
#
# Column-parallel, then row-parallel: each block's shards need one sum, and the ranks' sums are the
# unsharded model's blocks; the vocabulary splits by rows with a mask (embedding) and by columns of
# logits gathered to the sampling rank (head). Each rank holds about $1/p$ of the bytes and makes
# $2L + 1$ all-reduces of a few KB per decode step, whose cost is almost all α. On this machine's
# all-reduce the α–β model predicts the speedup plotted above, and on two GPUs §7 puts the engine's
# measured TP = 1 and 2 steps beside that prediction.

# %%
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")
