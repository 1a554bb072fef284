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
# # 09 · Speculative decoding
#
# A decode step of a small batch reads every weight and does little arithmetic with them, so checking
# $k + 1$ tokens of a sequence costs about as much as producing one. Speculative decoding guesses $k$
# tokens cheaply (a proposer), verifies them in one step of the target model, and keeps the longest
# prefix the target agrees with plus one token of its own — with a rejection rule that leaves the
# output distribution exactly the target's. This notebook measures the cost of a verify step, draws
# the distribution test, and runs the three proposers through minillm's engine: acceptance,
# predicted vs measured speedup, and speedup vs batch size.

# %%
import os
import time

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt

from minillm import SamplingParams, load_tokenizer
from minillm import notebook as nb
from minillm.bench import spec as spec_bench
from minillm.bench.table import print_table
from minillm.cache import PagedKVCache, kv_cache_spec
from minillm.config import preset
from minillm.engine import EngineConfig, LLMEngine
from minillm.worker.model_input import pack
from minillm.hw import time_it
from minillm.layers import AttentionMetadata
from minillm.loader import load_model
from minillm.sampling import rejection_sampler as rs
from minillm.sampling.rejection_sampler import RejectionSampler, spec_metadata

nb.header("09")
dev = nb.device()
T0 = time.perf_counter()
tok = load_tokenizer()

# %% [markdown]
# ## 1 · A verify step costs about one decode step
#
# One forward pass over $B$ sequences that each bring $q$ new tokens after `ctx` cached ones: $q = 1$
# is a decode step, $q = k + 1$ a verify. Timed as CUDA-graph replays (the engine replays graphs too),
# on the embedded SmolLM2-135M and on Llama-3-8B's shapes with dummy weights. On a CPU a tiny model
# stands in and the times mean nothing.

# %%
def step_time(model, B: int, ctx: int, q: int) -> float:
    """Seconds of one forward pass: B sequences, q new tokens each after ctx cached tokens."""
    bs = 16
    per = -(-(ctx + q) // bs)
    cache = PagedKVCache(kv_cache_spec(model), 1 + B * per, bs, dev)
    cache.bind(model)
    chunks = [(ctx, [7] * q, list(range(1 + b * per, 1 + (b + 1) * per))) for b in range(B)]
    step = pack(chunks, bs)  # a ModelInput
    ids, pos, slots, seq_lens, table = step.input_ids, step.positions, step.slot_mapping, step.seq_lens, step.block_table
    meta = AttentionMetadata.from_seq_lens([q] * B, dev)
    meta.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    meta.block_table = torch.tensor(table, dtype=torch.int32, device=dev)
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
    ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)

    @torch.inference_mode()
    def fn():
        return model.compute_logits(model(ids_t, pos_t, meta))  # logits at every row, as a verify wants

    t = time_it(fn, device=dev, warmup=2, reps=nb.pick(cpu=1, gpu=10), inner=1, cuda_graph=nb.on_gpu())
    cache.unbind(model)
    return t


if nb.on_gpu():
    models = {"SmolLM2-135M": load_model(None, dtype=torch.bfloat16, device=dev)[0],
              "Llama-3-8B (dummy)": load_model(preset("llama-3-8b"), load_format="dummy", dtype=torch.bfloat16,
                                               device=dev)[0]}
else:
    models = {"tiny-random": nb.tiny_random_model()[0]}
ks, batches, ctx = [0, 1, 2, 4, 8], nb.pick(cpu=[1], gpu=[1, 8, 64]), nb.pick(cpu=32, gpu=512)
rows = []
for name, m in models.items():
    for B in batches:
        t1 = step_time(m, B, ctx, 1)
        for k in ks:
            t = step_time(m, B, ctx, k + 1) if k else t1
            rows.append({"model": name, "batch": B, "k": k, "ms": 1e3 * t, "x decode": t / t1})
print_table(rows, title=f"one forward pass, k + 1 tokens per sequence after {ctx} cached ({dev})")
fig, ax = plt.subplots(figsize=(7, 4))
for name in models:
    for B in batches:
        pts = [r for r in rows if r["model"] == name and r["batch"] == B]
        ax.plot([r["k"] for r in pts], [r["x decode"] for r in pts], marker="o", label=f"{name}, batch {B}")
ax.set(xlabel="draft tokens k", ylabel="verify time / decode time", title="the price of verifying k + 1 tokens")
ax.legend()
plt.show()
del m
models.pop("Llama-3-8B (dummy)", None)  # 16 GB of dummy weights: not needed below
if nb.on_gpu():
    torch.cuda.empty_cache()

# %% [markdown]
# ## 2 · The distribution test, drawn
#
# Scripted target distributions $p_0, p_1$ and draft distributions $q_0, q_1$ on 8 tokens; 30 000
# sequences draw their drafts from $q$ and are verified in one batched call. The tokens emitted at
# each position follow $p$ (left); resampling from $p$ instead of the residual $\max(p - q, 0)$
# (a one-line bug) over-weights the draft's favourites (right).

# %%
V, K, N = 8, 2, 30000
g = torch.Generator().manual_seed(0)
p = torch.softmax(torch.randn(K + 1, V, generator=g), -1)
q = torch.softmax(torch.randn(K, V, generator=g) * 2, -1)
drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)
params = SamplingParams(temperature=1.0)


def emitted(residual=None):
    saved = rs.residual_probs
    rs.residual_probs = residual or saved
    try:
        meta = spec_metadata([params] * N, list(range(N)), [0] * N, [K] * N, V, "cpu")
        return RejectionSampler()(torch.log(p).repeat(N, 1), [K] * N, drafts.reshape(-1).tolist(),
                                  q.repeat(N, 1), meta)
    finally:
        rs.residual_probs = saved


fig, axes = plt.subplots(1, 2, figsize=(11, 3.5), sharey=True)
for ax, (title, out) in zip(axes, [("rejection sampling", emitted()),
                                   ("bug: resample from p", emitted(lambda p_, q_: p_))]):
    hist = torch.bincount(torch.tensor([e[0] for e in out]), minlength=V).float() / N
    ax.bar(torch.arange(V) - 0.2, p[0], width=0.4, label="target p")
    ax.bar(torch.arange(V) + 0.2, hist, width=0.4, label="emitted")
    ax.set(title=f"{title}: first position", xlabel="token")
axes[0].set_ylabel("probability")
axes[0].legend()
plt.show()

# %% [markdown]
# ## 3 · The acceptance model
#
# A draft sampled from $q$ is accepted with probability $\alpha = \sum_x \min(p(x), q(x)) = 1 - \mathrm{TV}(p, q)$.
# The run above verified 30 000 first-position drafts: their acceptance rate should be $\alpha_0$ of the scripted
# $p_0, q_0$ within sampling error. If every position is accepted independently with the same $\alpha$, a verify
# step with $k$ drafts emits $(1 - \alpha^{k+1}) / (1 - \alpha)$ tokens on average; with a draft token costing
# $c$ decode steps, the speedup $(1 - \alpha^{k+1}) / ((1 - \alpha)(1 + c k))$ peaks at a best $k$.

# %%
from minillm.spec_decode.acceptance import (acceptance_rate, expected_speedup, expected_tokens, offline_tokens_per_step,
                                            optimal_k)

out = emitted()
alpha0 = float(acceptance_rate(p[0], q[0]))
empirical = sum(e[0] == d for e, d in zip(out, drafts[:, 0].tolist())) / N  # a rejection never emits the draft
sigma = (alpha0 * (1 - alpha0) / N) ** 0.5
print(f"alpha_0 = 1 - TV(p_0, q_0) = {alpha0:.4f}; accepted first drafts: {empirical:.4f} "
      f"({abs(empirical - alpha0) / sigma:.1f} standard errors apart)")
assert abs(empirical - alpha0) < 6 * sigma

# %%
# NBVAL_CHECK_OUTPUT
alphas, costs = [0.5, 0.7, 0.8, 0.9, 0.95], [0.01, 0.05, 0.2]
print_table([{"alpha": a, **{f"best k, c={c}": optimal_k(a, c) for c in costs},
              **{f"speedup, c={c}": expected_speedup(a, optimal_k(a, c), c) for c in costs}} for a in alphas],
            title="the best number of drafts k for acceptance alpha and draft cost c (verify = one decode step)")
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for a in alphas:
    axes[0].plot(range(11), [expected_tokens(a, k) for k in range(11)], marker="o", label=f"alpha {a}")
    axes[1].plot(range(11), [expected_speedup(a, k, 0.05) for k in range(11)], marker="o", label=f"alpha {a}")
axes[0].set(xlabel="draft tokens k", ylabel="tokens per verify step", title="(1 - alpha^(k+1)) / (1 - alpha)")
axes[1].set(xlabel="draft tokens k", ylabel="expected speedup", title="speedup with a draft token costing c = 0.05")
axes[0].legend(fontsize=8)
plt.show()

# %% [markdown]
# ## 4 · Acceptance and speedup per proposer
#
# Greedy, EOS ignored, every request runs the same number of tokens. Grounded prompts quote their
# input (a passage to summarize or repeat, a function to edit); open ones do not. For each proposer:
# acceptance, mean acceptance length $\tau$, the step costs, and the speedup predicted from them,
# $\tau \cdot t_1 / (t_\text{verify} + t_\text{draft} + \text{overhead})$, against the measured one.
# On a CPU a tiny random model stands in with token-id prompts that repeat themselves.

# %%
if nb.on_gpu():
    target = load_model(None, dtype=torch.bfloat16, device=dev)[0]
    ids = {kind: [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True)
                  for t in spec_bench.prompts(kind)] for kind in ("grounded", "open")}
    layers = [8]
else:
    target = models["tiny-random"]
    ids = {"grounded": [[(7 * i) % 50 for i in range(12)] * 3], "open": [list(range(100, 130))]}
    layers = [1]
max_tokens, batch_sizes = nb.pick(cpu=8, gpu=96), nb.pick(cpu=[1], gpu=[1, 8, 64])
results = []
adaptive = ("ngram k=4, off above 16", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                       "disable_by_batch_size": 16})  # speculation backs off in large batches
for name, spec in spec_bench.configs(nb.pick(cpu=[2], gpu=[2, 4]), layers, None) + [adaptive]:
    engine = LLMEngine(target, tok, [], EngineConfig(speculative_config=spec, max_num_seqs=64,
                                                     num_gpu_blocks=nb.pick(cpu=256, gpu=None)), progress=False)
    engine.warm_up(max_prompt_len=max(len(x) for v in ids.values() for x in v))
    for kind in ids:
        for B in batch_sizes:
            reqs = [ids[kind][i % len(ids[kind])] for i in range(B)]
            spec_bench.serve(engine, reqs[:1], 4, "warm")
            results.append({"prompts": kind, "batch": B, "config": name,
                            **spec_bench.serve(engine, reqs, max_tokens, name)})
    engine.shutdown()
for r in results:
    base = next(b for b in results if b["config"] == "plain" and (b["prompts"], b["batch"]) == (r["prompts"], r["batch"]))
    r["predicted"] = r["tau"] * base["t_step_ms"] / (r["t_exec_ms"] + r["t_draft_ms"]
                                                     + base["t_step_ms"] - base["t_exec_ms"])
    r["measured"] = r["decode_tok_s"] / base["decode_tok_s"]
print_table(results, ["prompts", "batch", "config", "decode_tok_s", "acceptance", "tau", "t_step_ms", "t_exec_ms",
                      "t_draft_ms", "predicted", "measured"], title="speculative decoding through the engine")

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for ax, kind in zip(axes, ids):
    for name in dict.fromkeys(r["config"] for r in results if r["config"] != "plain"):
        pts = [r for r in results if r["prompts"] == kind and r["config"] == name]
        ax.plot([r["batch"] for r in pts], [r["measured"] for r in pts], marker="o", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="batch size", ylabel="speedup over plain decoding", title=f"{kind} prompts")
axes[0].legend(fontsize=8)
plt.show()

fig, ax = plt.subplots(figsize=(5, 5))
spec_rows = [r for r in results if r["config"] != "plain"]
ax.scatter([r["predicted"] for r in spec_rows], [r["measured"] for r in spec_rows], c=[r["acceptance"] for r in spec_rows])
top = max(max(r["predicted"], r["measured"]) for r in spec_rows) * 1.1
ax.plot([0, top], [0, top], color="grey", lw=0.8)
ax.fill_between([0, top], [0, 0.85 * top], [0, 1.15 * top], color="grey", alpha=0.15, label="within 15 %")
ax.set(xlabel="predicted speedup", ylabel="measured speedup", title="the cost model against the clock (colour: acceptance)")
ax.legend()
plt.show()
close = sum(abs(r["measured"] / r["predicted"] - 1) <= 0.15 for r in spec_rows)
print(f"{close} of {len(spec_rows)} measured speedups within 15 % of the prediction")

# %% [markdown]
# ## 5 · Predicted before the run
#
# The "predicted" column above divides by the same run's step times, so it checks bookkeeping, not a model.
# Here the prediction uses nothing from the speculating engine: greedy tokens from plain decoding (the
# unbatched path of chapter 03), replayed offline to see how many n-gram drafts greedy verification would
# keep at each step (exact: greedy speculation emits the plain tokens); the verify cost $r_k$ from section 1's
# forward passes; the draft cost $c$ from timing the lookup here. A batch runs until its slowest sequence is
# done, so the batch's prediction uses its fewest tokens per step:
# $\min_b E_b / (r_k + c_B)$.

# %%
from minillm.generation import generate_sequences
from minillm.spec_decode.ngram import ngram_lookup

greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
plain = {kind: [] for kind in ids}  # per prompt: (prompt length, prompt + greedy output)
for kind in ids:
    for prompt_ids in ids[kind]:
        *_, seqs = generate_sequences(target, tok, prompt_ids, greedy, [])
        plain[kind].append((len(prompt_ids), list(seqs[0].token_ids)))
verify = {(r["batch"], r["k"]): r["x decode"] for r in rows if r["model"] == next(iter(models))}
decode_ms = {B: next(r["ms"] for r in rows if r["model"] == next(iter(models)) and r["batch"] == B and r["k"] == 0)
             for B in batch_sizes}
offline = []
for name, spec in spec_bench.configs(nb.pick(cpu=[2], gpu=[2, 4]), [], None)[1:]:
    k, lo, hi = spec["num_speculative_tokens"], spec.get("prompt_lookup_min", 1), spec["prompt_lookup_max"]
    calls, per_prompt = [], {}

    def propose(prefix, kk, lo=lo, hi=hi, calls=calls):
        calls.append(1)
        return ngram_lookup(prefix, lo, hi, kk)

    t0 = time.perf_counter()
    for kind in ids:
        for j, (n, toks) in enumerate(plain[kind]):
            per_prompt[kind, j] = offline_tokens_per_step(toks, n, propose, k)
    t_call = (time.perf_counter() - t0) / max(len(calls), 1)  # seconds per lookup (the replay is mostly lookups)
    for kind in ids:
        for B in batch_sizes:
            E = [per_prompt[kind, i % len(ids[kind])][0] for i in range(B)]
            c = B * t_call * 1e3 / decode_ms[B]
            pred = min(E) / (verify[B, k] + c)
            meas = next(r["measured"] for r in results if (r["prompts"], r["batch"], r["config"]) == (kind, B, name))
            offline.append({"prompts": kind, "batch": B, "config": name, "E mean": sum(E) / B, "E min": min(E),
                            "r_k": verify[B, k], "c": c, "predicted": pred, "measured": meas, "meas/pred": meas / pred})
print_table(offline, title="speedup predicted from offline acceptance and section 1's verify cost, against the engine")
print_table([{"prompt": f"{kind} {j}", "tokens/step (k=" + str(k) + ")": v[0],
              **{f"accepted at {i + 1}": a for i, a in enumerate(v[1])}} for (kind, j), v in per_prompt.items()],
            title=f"per prompt, offline, the last configuration ({name}): tokens per step and acceptances per draft position")

fig, ax = plt.subplots(figsize=(5, 5))
ax.scatter([r["predicted"] for r in offline], [r["measured"] for r in offline])
top = max(max(r["predicted"], r["measured"]) for r in offline) * 1.1
ax.plot([0, top], [0, top], color="grey", lw=0.8)
ax.set(xlabel="predicted before the run", ylabel="measured by the engine", title="offline acceptance model vs the clock")
plt.show()
print(f"notebook time: {time.perf_counter() - T0:.0f} s")
