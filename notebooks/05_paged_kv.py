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
# # 05 · Paged KV blocks
#
# Chapter 03 gave every sequence one contiguous slab of cache, sized for the longest it might grow.
# A server cannot know that length in advance, so it reserves for the worst case and most of the
# slab is never written. Paging (Kwon et al., *vLLM*, 2023) cuts the cache into blocks of
# `block_size` tokens, hands a sequence one block at a time as it grows, and finds its keys again
# through a per-sequence **block table**, as an OS finds a process's pages. This notebook proves
# the engine's paged cache changes no token, measures the memory it saves on a realistic mix of
# request lengths, weighs the block size, times attention through a scattered block table against a
# contiguous layout, and watches copy-on-write share a prompt among parallel samples. The code:
# `minillm/cache/paged.py`, `minillm/engine/block_manager.py`, `minillm/kernels/store_kv.py`.

# %%
import os

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
import numpy as np

from minillm import SamplingParams, hw, load_tokenizer
from minillm import notebook as nb
from minillm.bench.table import print_table
from minillm.config import ModelConfig
from minillm.engine import EngineConfig, LLMEngine
from minillm.engine.block_manager import cdiv
from minillm.generation import generate_sequences
from minillm.kernels.flash_decode import flash_decode, flash_decode_ref
from minillm.kernels.store_kv import store_kv, store_kv_ref
from minillm.kv_memory import kv_bytes_per_token
from minillm.loader import load_model

nb.header("05")
dev = nb.device()
ceil = hw.ceilings(dev)
print(f"copy ceiling {ceil.copy_gbps:,.0f} GB/s (read + write), measured on {ceil.device}")


def record_schedules(engine):
    """Keep every SchedulerOutput the engine produces (instrumentation for this notebook only)."""
    outputs, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        outputs.append(out)
        return out

    engine.scheduler.schedule = recording
    return outputs


# %% [markdown]
# ## 1. The oracle: paging changes no token
#
# The embedded SmolLM2-135M in fp32 (on the CPU, where it takes about a second a step, a tiny
# random Llama with SmolLM2's vocabulary instead), greedy, several prompts at once through
# `LLMEngine` with 16-token blocks and a pool too small to hold every request at once (so some are
# preempted and recomputed), against chapter 03's one-request path with its contiguous cache
# (`generate_sequences`), one request at a time.

# %%
if nb.on_gpu():
    model, mcfg, tok = load_model(None, dtype=torch.float32, device=dev)
else:
    (model, mcfg), tok = nb.tiny_random_model(), load_tokenizer()
eos = sorted(set(mcfg.eos_token_ids or [tok.eos_token_id]))
print(f"model: {mcfg.name}, {mcfg.num_layers} layers, fp32 on {dev}")
prompts = ["The capital of France is", "def fibonacci(n):", "A haiku about the sea:\n",
           "Paging in operating systems means", "The three primary colours are"][: nb.pick(cpu=3, gpu=5)]
greedy = SamplingParams(temperature=0, max_tokens=nb.pick(cpu=14, gpu=64))
ids = [tok.encode(p) for p in prompts]
longest = max(cdiv(len(i) + greedy.max_tokens, 16) for i in ids)
small_batch = dict(max_num_seqs=8, cuda_graph_max_batch=8)  # few CUDA graphs to capture: a quick start
engine = LLMEngine(model, tok, eos, EngineConfig(block_size=16, num_gpu_blocks=1 + longest + 1, **small_batch),
                   progress=False)
for i, p in enumerate(ids):
    engine.add_request(f"r{i}", {"prompt_token_ids": p}, greedy)
paged = {}
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            paged[out.request_id] = out.outputs[0].token_ids
for i, p in enumerate(ids):
    *_, seqs = generate_sequences(model, tok, p, greedy, eos)
    contiguous = seqs[0].output_ids
    print(f"{prompts[i]!r:>38}: {len(contiguous):2} tokens, paged == contiguous: {paged[f'r{i}'] == contiguous}")
    assert paged[f"r{i}"] == contiguous, f"paging changed the tokens of {prompts[i]!r}"
print(f"pool: {engine.block_manager.num_blocks - 1} blocks of 16 tokens for {len(prompts)} requests "
      f"needing up to {longest} blocks each; preemptions: {engine.stats['num_preemptions']}")
print(repr(tok.decode(paged["r0"])))  # (gibberish from the tiny random model on a CPU)
engine.shutdown()

# %% [markdown]
# ## 2. Fragmentation on a realistic mix of lengths
#
# Chat requests are short-prompt, long-tail. We draw prompt and output lengths from lognormals
# ($\sigma = 1$) whose means match what the vLLM paper reports for ShareGPT conversations (about
# 161 prompt and 338 output tokens), clipped to a 2,048-token context. On the CPU every length is
# divided by 8 (context 256) so the run stays short; the GPU runs the full lengths.

# %%
# NBVAL_CHECK_OUTPUT
MAX_LEN, N_REQ, SIGMA = 2048, 512, 1.0
rng = np.random.default_rng(5)


def lognormal(mean, n):
    return rng.lognormal(np.log(mean) - SIGMA**2 / 2, SIGMA, n)  # E[X] = exp(mu + sigma^2 / 2) = mean


full_prompt = np.clip(np.round(lognormal(161, N_REQ)), 4, MAX_LEN // 2).astype(int)
full_output = np.clip(np.round(lognormal(338, N_REQ)), 1, MAX_LEN - full_prompt).astype(int)
for name, x in (("prompt", full_prompt), ("output", full_output), ("total", full_prompt + full_output)):
    print(f"{name:>6} tokens: mean {x.mean():6.1f}  p50 {np.median(x):6.0f}  p90 {np.percentile(x, 90):6.0f}  "
          f"p99 {np.percentile(x, 99):6.0f}  max {x.max():5}")

# %% [markdown]
# The requests go through the engine (a small model with dummy weights: only the lengths matter
# here; `ignore_eos`, `max_tokens` = the drawn output length), at most `max_num_seqs` at a time, the
# steady state of a busy server. After every step we count, over the running sequences:
#
# * **stored**: tokens whose K/V are in the cache (`num_computed_tokens`);
# * **paged**: blocks held (`engine.block_manager`) $\times$ `block_size`;
# * **contiguous, max_len**: what chapter 03's `KVCache` reserves, `max_model_len` per sequence;
# * **contiguous, prompt + max_tokens**: a kinder contiguous server that reserves exactly what each
#   request may grow to (it still cannot know when a request will stop early on EOS; here none does,
#   so this variant's waste is only the part not yet generated).
#
# Waste = 1 − stored / held, for the same set of live sequences.

# %%
scale, max_num_seqs = nb.pick(cpu=(8, 12), gpu=(1, 128))
n_req = nb.pick(cpu=24, gpu=N_REQ)
max_len = MAX_LEN // scale
plen = np.maximum(full_prompt[:n_req] // scale, 1)
olen = np.clip(full_output[:n_req] // scale, 1, max_len - plen)
small = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=max_len, name="tiny-dummy")
dummy, _, _ = load_model(small, load_format="dummy", dtype=torch.float32, device=dev)
BS = 16
pool = 1 + sum(cdiv(int(p + o), BS) for p, o in zip(plen, olen))  # room for everyone: no preemption
engine = LLMEngine(dummy, tok, [], EngineConfig(block_size=BS, num_gpu_blocks=pool, max_num_seqs=max_num_seqs,
                                                 cuda_graph_max_batch=max_num_seqs), progress=False)
g = torch.Generator().manual_seed(0)
for i, (p, o) in enumerate(zip(plen, olen)):
    engine.add_request(f"q{i}", {"prompt_token_ids": torch.randint(0, 512, (int(p),), generator=g).tolist()},
                       SamplingParams(temperature=0, max_tokens=int(o), ignore_eos=True))
bm = engine.block_manager
trace = []  # per step: (tokens stored per live sequence, prompt + max_tokens per live sequence)
while engine.has_unfinished_requests():
    engine.step()
    live = list(engine.scheduler.running)
    stored = [s.num_computed_tokens for s in live]
    held = [len(bm.block_tables[s.seq_id]) for s in live]
    # the block manager holds exactly ceil(stored / block_size) blocks per sequence, nothing more
    assert held == [cdiv(c, BS) for c in stored] and bm.num_used_blocks == sum(held)
    trace.append((np.array(stored), np.array([len(s.prompt_ids) + s.params.max_tokens for s in live])))
engine.shutdown()
trace = [t for t in trace if len(t[0])]


def waste_series(block_size=BS):
    """Per step: waste % of paging with block_size, contiguous max_len, contiguous prompt + max_tokens."""
    rows = []
    for stored, reserve in trace:
        s = stored.sum()
        paged_held = (-(-stored // block_size) * block_size).sum()
        rows.append((100 * (1 - s / paged_held), 100 * (1 - s / (max_len * len(stored))),
                     100 * (1 - s / reserve.sum())))
    return np.array(rows)  # [steps, 3]


def token_weighted_waste(block_size=BS):
    s = sum(t[0].sum() for t in trace)
    return {"paged": 100 * (1 - s / sum((-(-t[0] // block_size) * block_size).sum() for t in trace)),
            "contiguous max_len": 100 * (1 - s / sum(max_len * len(t[0]) for t in trace)),
            "contiguous prompt+max_tokens": 100 * (1 - s / sum(t[1].sum() for t in trace))}


w = waste_series()
kinds = ["paged, block 16", f"contiguous, max_len {max_len}", "contiguous, prompt + max_tokens"]
rows = [{"layout": k, "mean waste % (over steps)": w[:, j].mean(), "token-weighted waste %": v}
        for j, (k, v) in enumerate(zip(kinds, token_weighted_waste().values()))]
print_table(rows, title=f"{n_req} requests, {len(trace)} engine steps, up to {max_num_seqs} sequences at once")
held_tokens = {"stored": np.array([t[0].sum() for t in trace]),
               "paged": np.array([(-(-t[0] // BS) * BS).sum() for t in trace]),
               "contiguous max_len": np.array([max_len * len(t[0]) for t in trace]),
               "contiguous prompt+max_tokens": np.array([t[1].sum() for t in trace])}
print(f"seed claims: 60-80 % wasted by contiguous reservation, under 4 % with paging. Measured here: "
      f"{rows[1]['mean waste % (over steps)']:.0f} % (max_len), {rows[2]['mean waste % (over steps)']:.0f} % "
      f"(prompt + max_tokens), {rows[0]['mean waste % (over steps)']:.1f} % (paged)")
print(f"the same memory holds {held_tokens['contiguous max_len'].sum() / held_tokens['paged'].sum():.1f}x as many "
      f"sequences paged as with max_len slabs, {held_tokens['contiguous prompt+max_tokens'].sum() / held_tokens['paged'].sum():.1f}x "
      "as many as with prompt + max_tokens slabs")

# %%
llama_bytes = kv_bytes_per_token(32, 8, 128, dtype_bytes=2)  # Llama-3-8B, bf16: what these tokens would cost
fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4), dpi=100)
for j, k in enumerate(kinds):
    a1.plot(w[:, j], label=f"{k} (mean {w[:, j].mean():.1f} %)", lw=1)
a1.set(xlabel="engine step", ylabel="waste % (held but not stored)", title="KV memory wasted, step by step", ylim=(0, 100))
a1.legend(fontsize=8)
a1.grid(alpha=0.3)
for k, v in held_tokens.items():
    a2.plot(v * llama_bytes / 2**30, label=k, lw=1)
a2.set(xlabel="engine step", ylabel="GiB (at Llama-3-8B's 128 KiB/token)", title="KV memory held vs stored")
a2.legend(fontsize=8)
a2.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# Paging's waste is the unfilled tail of each sequence's last block, on average about
# (block_size − 1) / 2 tokens per sequence, whatever its length; a contiguous slab wastes everything
# between where the sequence is now and where it might end. (The CPU run's lengths are 8x shorter,
# so the same half-block is a larger share of them.)
#
# ## 3. Choosing the block size
#
# Smaller blocks waste less but make the block table longer and break attention's reads into
# smaller pieces. Waste first, from the same trace: the engine showed above that it holds exactly
# ⌈stored / block_size⌉ blocks per sequence, so every block size can be replayed on the recorded
# token counts.

# %%
block_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
bs_waste = [token_weighted_waste(b)["paged"] for b in block_sizes]
print_table([{"block_size": b, "paged waste %": x} for b, x in zip(block_sizes, bs_waste)],
            title="token-weighted waste on the trace above")

# %% [markdown]
# The same question for the full-length distribution, every sequence at its final length (the
# waste a finished batch leaves; independent of the device):

# %%
# NBVAL_CHECK_OUTPUT
final = full_prompt + full_output
for b in block_sizes:
    held = (-(-final // b) * b).sum()
    print(f"block {b:>3}: {100 * (1 - final.sum() / held):5.2f} % wasted")
print(f"contiguous max_len {MAX_LEN}: {100 * (1 - final.sum() / (MAX_LEN * len(final))):5.2f} % wasted")

# %% [markdown]
# Now the other side: the time of one decode attention step (`flash_decode`) when each sequence's
# keys are scattered over random blocks of the given size. On the GPU: one Llama-3-8B layer
# (32 query heads, 8 KV heads, head_dim 128, bf16), 16 sequences of 4,096 tokens. On the CPU the
# kernel runs in Triton's interpreter on a toy shape: those times only show the code runs. Every
# result is checked against the plain-PyTorch reference.

# %%
Hq, Hkv, D, B, CTX, dt = nb.pick(cpu=(4, 2, 16, 2, 64, torch.float32), gpu=(32, 8, 128, 16, 4096, torch.bfloat16))
reps = nb.pick(cpu=1, gpu=20)


def random_paged(batch, ctx, block_size, seed=0):
    """K/V caches with each sequence's blocks scattered at random over the pool (block 0 left unused)."""
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=dev).manual_seed(seed)  # drawn where they live: gigabytes at the longest context
    per_seq = cdiv(ctx, block_size)
    num_blocks = 1 + batch * per_seq
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gd, device=dev, dtype=dt)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gd, device=dev, dtype=dt)
    table = (1 + torch.randperm(batch * per_seq, generator=g)).view(batch, per_seq).to(dev, torch.int32)
    q = torch.randn(batch, Hq, D, generator=gd, device=dev, dtype=dt)
    seqused = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, seqused, table


def attn_bytes(batch, ctx):
    return (2 * batch * ctx * Hkv * D + 2 * batch * Hq * D) * hw.dtype_bytes(dt)  # K, V read; q read, out written


def check_and_time(args):
    out = flash_decode(*args)
    ref = flash_decode_ref(*args)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < (2e-2 if dt == torch.bfloat16 else 1e-4), f"flash_decode differs from its reference by {err}"
    return hw.time_it(lambda: flash_decode(*args), device=dev, reps=reps, warmup=nb.pick(cpu=0, gpu=3),
                      cuda_graph=nb.on_gpu())


dec_rows = []
for b in nb.pick(cpu=[1, 4, 16, 64], gpu=block_sizes):
    t = check_and_time(random_paged(B, CTX, b))
    dec_rows.append({"block_size": b, "us": t * 1e6, "GB/s": attn_bytes(B, CTX) / t / 1e9,
                     "% of copy": 100 * attn_bytes(B, CTX) / t / 1e9 / ceil.copy_gbps})
print_table(dec_rows, title=f"flash_decode, batch {B} x context {CTX}, Hq {Hq}, Hkv {Hkv}, D {D}, {dt} on {ceil.device}")

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.8), dpi=100)
nb.plot_lines(block_sizes, {"paged": bs_waste}, xlabel="block size (tokens)", ylabel="waste %",
              title="memory: waste vs block size (the trace of section 2)", logx=True, ax=a1)
nb.plot_lines([r["block_size"] for r in dec_rows], {"flash_decode": [r["GB/s"] for r in dec_rows]},
              xlabel="block size (tokens)", ylabel="GB/s", title="time: decode attention bandwidth vs block size",
              logx=True, ax=a2)
a2.axhline(ceil.copy_gbps, ls=":", c="gray")
a2.text(dec_rows[0]["block_size"], ceil.copy_gbps * 0.93, f"copy ceiling {ceil.copy_gbps:,.0f} GB/s", fontsize=8, color="gray")
plt.tight_layout()
plt.show()

# %% [markdown]
# Turn the knob (in JupyterLab; the site shows the static plots above): the waste over the run for
# one block size.

# %% tags=["widget"]
def show_block_size(block_size=16):
    ws = waste_series(block_size)
    plt.figure(figsize=(7, 3), dpi=100)
    plt.plot(ws[:, 0], label=f"paged, block {block_size} (mean {ws[:, 0].mean():.1f} %)")
    plt.plot(ws[:, 1], label=f"contiguous max_len (mean {ws[:, 1].mean():.1f} %)")
    plt.ylim(0, 100)
    plt.xlabel("engine step")
    plt.ylabel("waste %")
    plt.legend(fontsize=8)
    plt.show()


def block_size_widget():
    import ipywidgets as W

    return nb.widget(show_block_size, block_size=W.SelectionSlider(options=block_sizes, value=16))


_ = block_size_widget()

# %% [markdown]
# ## 4. Paged vs contiguous attention
#
# The price of the indirection: the same decode attention reading keys through a shuffled table of
# 16-token blocks, and through a contiguous layout (one block per sequence, `block_size` = context,
# chapter 03's slab). Ratio = paged time / contiguous time (1.00 = paging is free). GB/s counts the
# K and V read once (plus q and the output), against the copy ceiling.

# %%
pc_rows = []
for ctx in nb.pick(cpu=[32, 128], gpu=[1024, 4096, 16384]):
    for batch in nb.pick(cpu=[1, 2], gpu=[1, 8, 32]):
        t_paged = check_and_time(random_paged(batch, ctx, 16, seed=1))
        t_contig = check_and_time(random_paged(batch, ctx, ctx, seed=1))
        gb = attn_bytes(batch, ctx) / 1e9
        pc_rows.append({"context": ctx, "batch": batch, "paged_us": t_paged * 1e6, "contiguous_us": t_contig * 1e6,
                        "paged/contig": t_paged / t_contig, "paged_GB/s": gb / t_paged,
                        "paged_%copy": 100 * gb / t_paged / ceil.copy_gbps,
                        "contig_%copy": 100 * gb / t_contig / ceil.copy_gbps})
print_table(pc_rows, title=f"flash_decode: shuffled 16-token blocks vs one block per sequence ({dt}, Hq {Hq}, Hkv {Hkv}, D {D})")

# %% [markdown]
# Every layer, every step, the engine also *writes* the new tokens' K and V into their slots
# (`slot_mapping`): minillm's Triton `store_kv`, one launch for K and V, against its PyTorch
# reference `store_kv_ref` (a boolean mask to drop padding slots, then two `index_copy_`). The
# reference's mask sizes a tensor by the data, a host sync that a CUDA graph cannot hold, so it is
# timed eagerly; the plain `index_copy_` pair (no padding) is the graph-captured peer. Bytes: K and V
# each read once and written once.

# %%
kv_rows = []
for T in nb.pick(cpu=[16, 64], gpu=[64, 1024, 16384]):
    g = torch.Generator().manual_seed(T)
    k, v = (torch.randn(T, Hkv, D, generator=g).to(dev, dt) for _ in range(2))
    nb_blocks = 1 + cdiv(4 * T, 16)
    caches = [torch.zeros(nb_blocks, 16, Hkv, D, dtype=dt, device=dev) for _ in range(4)]
    slots = (16 + torch.randperm((nb_blocks - 1) * 16, generator=g)[:T]).to(dev)  # distinct, past block 0
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), "store_kv != store_kv_ref"
    flat = [c.view(-1, Hkv, D) for c in caches[2:]]

    def index_copy(flat=flat, k=k, v=v, slots=slots):
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)

    args = (k, v, *caches[:2], slots), (k, v, *caches[2:], slots)
    kw = dict(device=dev, reps=nb.pick(cpu=2, gpu=20))
    t_tri = hw.time_it(lambda a=args[0]: store_kv(*a), cuda_graph=nb.on_gpu(), **kw)
    t_ref = hw.time_it(lambda a=args[1]: store_kv_ref(*a), **kw)
    t_ic = hw.time_it(index_copy, cuda_graph=nb.on_gpu(), **kw)
    gb = 2 * 2 * T * Hkv * D * hw.dtype_bytes(dt) / 1e9
    kv_rows.append({"tokens": T, "store_kv_us": t_tri * 1e6, "store_kv_ref_us": t_ref * 1e6,
                    "index_copy_us": t_ic * 1e6, "ref/triton": t_ref / t_tri, "index_copy/triton": t_ic / t_tri,
                    "triton_GB/s": gb / t_tri, "triton_%copy": 100 * gb / t_tri / ceil.copy_gbps,
                    "index_copy_%copy": 100 * gb / t_ic / ceil.copy_gbps})
print_table(kv_rows, title=f"KV write into 16-token blocks, Hkv {Hkv}, D {D}, {dt} on {ceil.device}")

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.8), dpi=100)
for batch in dict.fromkeys(r["batch"] for r in pc_rows):
    rs = [r for r in pc_rows if r["batch"] == batch]
    a1.plot([r["context"] for r in rs], [r["paged_%copy"] for r in rs], "o-", label=f"paged, batch {batch}")
    a1.plot([r["context"] for r in rs], [r["contig_%copy"] for r in rs], "x--", label=f"contiguous, batch {batch}")
a1.set(xscale="log", xlabel="context (tokens)", ylabel="% of copy bandwidth", title="decode attention")
a1.legend(fontsize=7)
a1.grid(alpha=0.3)
nb.plot_lines([r["tokens"] for r in kv_rows], {"store_kv (Triton)": [r["triton_%copy"] for r in kv_rows],
                                               "index_copy_ x2": [r["index_copy_%copy"] for r in kv_rows]},
              xlabel="tokens written", ylabel="% of copy bandwidth", title="KV write", logx=True, ax=a2)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Copy-on-write: parallel sampling shares the prompt
#
# A request with `n=3` prefills its prompt once. When the prompt is done, the other two sequences
# `fork` the first one's block table: the same blocks, each reference count now 3. The prompt's last
# block is only partly full; the first decode step writes each sequence's own token into it, so each
# writer that finds it shared takes a private copy first (`pending_copies`, done on the GPU before
# the step), and the last one keeps the original. The full prompt blocks stay shared to the end.

# %%
# NBVAL_CHECK_OUTPUT
prompt = tok.encode("Write three different opening lines for a story about a lighthouse keeper who finds a message "
                    "in a bottle, each in a different genre: mystery, comedy and romance. Keep each line short.")
params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
engine = LLMEngine(model, tok, eos, EngineConfig(block_size=16, num_gpu_blocks=32, **small_batch), progress=False)
bm, scheds = engine.block_manager, record_schedules(engine)
engine.add_request("story", {"prompt_token_ids": prompt}, params)
full = len(prompt) // 16
assert len(prompt) % 16, "the example wants a partly filled last prompt block"
print(f"prompt: {len(prompt)} tokens = {full} full blocks + {len(prompt) % 16} tokens in block {full + 1}")


def show(when):
    print(when)
    for sid, table in bm.block_tables.items():
        print(f"  seq {sid}: blocks {table}  ref counts {[bm.ref_counts[b] for b in table]}")


engine.step()
show("after step 1 (prefill, then fork):")
engine.step()
show(f"after step 2 (first decode): copies done before it (src -> dst): {scheds[-1].blocks_to_copy}")
tables = list(bm.block_tables.values())
assert all(t[:full] == tables[0][:full] and bm.ref_counts[b] == 3 for t in tables for b in t[:full])  # shared
assert len({t[full] for t in tables}) == 3 and len(scheds[-1].blocks_to_copy) == 2  # 2 copies + the original
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            forked = [c.token_ids for c in out.outputs]
print(f"free blocks at the end: {bm.num_free_blocks} of {bm.num_blocks - 1}")

# %% [markdown]
# The oracle again: the three samples equal what the one-request path (its own contiguous slot per
# sample, no sharing) draws with the same seed.

# %%
*_, seqs = generate_sequences(model, tok, prompt, params, eos)
for i, (a, b) in enumerate(zip(forked, [s.output_ids for s in seqs])):
    print(f"sample {i}: identical: {a == b}  {tok.decode(a)!r}")
assert forked == [s.output_ids for s in seqs], "copy-on-write changed a sample"
assert len({tuple(f) for f in forked}) > 1, "the samples did not diverge"

# %% [markdown]
# What to take away:
#
# * Paging changes where the K/V live, never what the model computes: the tokens are the
#   contiguous cache's, token for token.
# * On a realistic length mix, reserving `max_len` per sequence wastes most of the cache, and even a
#   reservation of exactly `prompt + max_tokens` wastes a large share while the request is young;
#   16-token blocks waste about half a block per sequence, a few percent. The freed memory is more
#   sequences in the batch, which is what decode throughput is made of (chapter 07).
# * The indirection's price is section 4's `paged/contig` column, and section 3 shows where it
#   grows: the kernel looks up one table entry per key, and a block's keys are `block_size`
#   consecutive rows, so tiny blocks mean short contiguous runs and a long table to read.
# * Sharing is reference counting: forks share everything, writes copy only the block being written.
#   Chapter 06 names full blocks by their tokens, so *different* requests can share them too.
