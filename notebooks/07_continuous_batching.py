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
# # 07 · Continuous batching: the serving engine
#
# Chapters 03–06 made one request fast. A server has hundreds at once, each arriving and stopping
# when it likes. Batching them shares the weights' bytes across requests (chapter 00: a decode step
# reads every weight once, whatever the batch), but a *static* batch runs until its longest member
# finishes while the slots of the short ones idle. Continuous batching (Orca, Yu et al., 2022)
# decides again at every step: a finished sequence leaves at once and a waiting one takes its slot.
# This notebook runs minillm's engine (`minillm/engine/`: `Scheduler`, `BlockManager`, `ModelRunner`,
# `LLMEngine`) and shows, from real runs, that batching changes *when* a request's tokens are
# computed and never *which* tokens; what continuous batching, chunked prefill, preemption and CUDA
# graphs each buy; and the end-to-end benchmarks against Hugging Face `generate`.

# %%
import gc
import os
import random
import statistics
import time

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt

from minillm import SamplingParams, load_tokenizer
from minillm import notebook as nb
from minillm.bench import serving
from minillm.bench.serving import profile_decode_step
from minillm.bench.table import print_table
from minillm.engine import EngineConfig, LLMEngine
from minillm.generation import generate_sequences
from minillm.loader import load_model

nb.header("07")
dev = nb.device()
T0 = time.perf_counter()

# %% [markdown]
# The models. Exactness (sections 1 and 4) is shown with the embedded SmolLM2-135M in fp32 on a GPU,
# where its logits have clear winners; speed (sections 2, 3, 5) with the same model in bf16. On a
# CPU, where every Triton kernel runs in the interpreter, a tiny random model of the same family
# stands in (its weights drawn large enough that greedy choices are never near-ties), and SmolLM2
# appears only in section 1, for a few tokens.

# %%
tok = load_tokenizer()
if nb.on_gpu():
    exact_model, _, _ = load_model(None, dtype=torch.float32, device=dev)  # SmolLM2-135M, fp32
    fast_model, _, _ = load_model(None, dtype=torch.bfloat16, device=dev)  # SmolLM2-135M, bf16
else:
    exact_model = fast_model = nb.tiny_random_model()[0]  # 2 layers, random weights: the CPU stand-in
smollm_fp32 = exact_model if nb.on_gpu() else load_model(None, dtype=torch.float32, device=dev)[0]
V = fast_model.config.vocab_size
print(f"exactness: {exact_model.config.name} ({next(exact_model.parameters()).dtype}); "
      f"speed: {fast_model.config.name} ({next(fast_model.parameters()).dtype}); on {dev}")
# Before anything is timed: Triton compiles (and, in bf16, autotunes) the prefill kernel per prompt-length
# bucket on first use. One warm-up per model (LLMEngine.warm_up) runs every bucket up to the largest token
# budget used below (section 3's), so that cost lands here and not in a measured step.
nb.warm_up([fast_model, exact_model], tok, nb.pick(cpu=1024, gpu=8192))


def engine_for(model, warm: bool = False, **kw) -> LLMEngine:
    """An engine over `model` (no EOS: every request here runs to its max_tokens or its stop rule).
    warm: on a GPU, capture the CUDA graphs of its steps with prompt tokens now (LLMEngine.warm_up,
    one per token bucket), so that no capture lands inside a timed run."""
    kw.setdefault("async_scheduling", False)  # this chapter's engine: the host waits for each step's tokens
    engine = LLMEngine(model, tok, [], EngineConfig(**kw), progress=False)  # (chapter 13 overlaps them)
    if warm and engine.runner.graphs is not None:
        engine.warm_up()
    return engine


class Recorder:
    """Steps an engine and writes down, per step, its wall-clock span and who ran how many tokens."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.steps, self.rid = engine, [], {}  # steps: (t0, t1, [(request_id, n_tokens)])
        self.swapped_blocks = 0
        schedule = engine.scheduler.schedule

        def recorded():
            out = schedule()
            self._now = [(self.rid[s.seq_id], n) for s, n in out.scheduled]
            self.swapped_blocks += len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
            return out

        engine.scheduler.schedule = recorded  # the engine calls this once per step

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.add_request(rid, {"prompt_token_ids": prompt_ids}, params)
        for s in self.engine.groups[rid].seqs:
            self.rid[s.seq_id] = rid

    def run(self) -> dict:
        """Step until every request is done; -> {request_id: [token ids of each completion]}."""
        done = {}
        while self.engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = self.engine.step()  # ends with the sampled ids on the host: the GPU is done too
            self.steps.append((t0, time.perf_counter(), self._now))
            for o in outs:
                if o.finished:
                    done[o.request_id] = o
        return done

    @property
    def tokens_processed(self) -> int:
        return sum(n for *_, ran in self.steps for _, n in ran)


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


# %% [markdown]
# ## 1. The oracle: batched through the engine = each request alone
#
# A random mix of requests — different prompt lengths, greedy and seeded sampling, `n > 1`, stop
# tokens — goes through the engine all at once (paged KV cache, continuous batches, chunked prompts),
# and each one again *alone* through chapter 03's one-request path
# (`generation.generate_sequences`, contiguous KV cache). Every completion's tokens must agree. The
# token budget per step is kept small so long prompts are cut into chunks, and the pool of KV
# blocks small enough that some sequences are preempted.

# %%
rng = random.Random(7)
texts = ["The capital of France is", "def fibonacci(n):", "A haiku about the sea:\n", "Once upon a time,",
         "The three laws of thermodynamics", "import numpy as np\n", "Q: What is 17 * 23?\nA:", "Dear Sir,"]
n_req, max_new = nb.pick(cpu=(6, 10), gpu=(16, 48))
requests = []
for _ in range(n_req):
    ids = tok.encode(rng.choice(texts) * rng.choice([1, 1, 2, 6]))  # prompts of 4 to ~60 tokens
    kind = rng.choice(["greedy", "greedy", "seeded"])
    params = SamplingParams(max_tokens=rng.randrange(2, max_new + 1), n=rng.choice([1, 1, 2, 3]),
                            temperature=0.0 if kind == "greedy" else 0.8, top_p=rng.choice([1.0, 0.9]),
                            seed=None if kind == "greedy" else rng.randrange(1 << 30),
                            stop_token_ids=[tok.encode(".")[0]] if rng.random() < 0.3 else [])
    requests.append((ids, params))

engine = engine_for(smollm_fp32, num_gpu_blocks=nb.pick(cpu=24, gpu=60), block_size=16,
                    max_num_batched_tokens=nb.pick(cpu=32, gpu=128), max_num_seqs=nb.pick(cpu=4, gpu=16))
rec = Recorder(engine)
for i, (ids, params) in enumerate(requests):
    rec.add(f"r{i}", ids, params)
batched = rec.run()
alone = []
for ids, params in requests:
    *_, seqs = generate_sequences(smollm_fp32, tok, ids, params, [])
    alone.append([s.output_ids for s in seqs])
for i in range(n_req):
    got = [c.token_ids for c in batched[f"r{i}"].outputs]
    assert got == alone[i], f"r{i}: engine {got} != alone {alone[i]}"
print(f"{n_req} requests, {sum(p.n for _, p in requests)} completions, "
      f"{sum(len(t) for a in alone for t in a)} tokens: all identical to the one-request path")
print(f"{len(rec.steps)} engine steps, {engine.stats['num_preemptions']} preemptions, "
      f"peak {engine.stats['peak_used_blocks']} of {engine.stats['num_blocks'] - 1} blocks")
engine.shutdown()

# %% [markdown]
# Why this holds exactly: every sequence's tokens are computed by the same arithmetic wherever they
# sit in the batch (the packed layout has no padding, attention reads only the sequence's own
# blocks), and sampling draws each sequence's randomness from its own seed and step count, not from
# a generator shared by the batch. `tests/test_engine.py` runs the same oracle over random models,
# block sizes, prefix caches and aborts.
#
# ## 2. Static vs continuous batching, drawn from real runs
#
# The same requests, with output lengths spread from a few tokens to many (log-uniform), run twice
# through the same engine:
#
# - **static**: groups of $B$ — add $B$ requests, step until all of them finish, then the next $B$.
#   A finished request's slot stays empty until its whole group is done.
# - **continuous**: all requests added at once with `max_num_seqs = B`; the scheduler refills a slot
#   the step after it frees.
#
# Each step's wall-clock span and the requests it ran are recorded (the scheduler's output).

# %%
B, n_req = nb.pick(cpu=(4, 12), gpu=(32, 128))
out_lo, out_hi = nb.pick(cpu=(2, 48), gpu=(4, 512))
rng = random.Random(2)
workload = [(rand_ids(rng, rng.randrange(8, nb.pick(cpu=32, gpu=128))),
             SamplingParams(max_tokens=round(out_lo * (out_hi / out_lo) ** rng.random()), ignore_eos=True,
                            temperature=0.0))
            for _ in range(n_req)]
pool = nb.pick(cpu=256, gpu=4096)


def run_static() -> Recorder:
    rec = Recorder(engine_for(fast_model, warm=True, num_gpu_blocks=pool, max_num_seqs=B))
    for g in range(0, n_req, B):
        for i in range(g, min(g + B, n_req)):
            rec.add(f"r{i}", *workload[i])
        rec.run()
    return rec


def run_continuous() -> Recorder:
    rec = Recorder(engine_for(fast_model, warm=True, num_gpu_blocks=pool, max_num_seqs=B))
    for i, (ids, params) in enumerate(workload):
        rec.add(f"r{i}", ids, params)
    rec.run()
    return rec


runs = {"static": run_static(), "continuous": run_continuous()}
out_tokens = sum(p.max_tokens for _, p in workload)
rows = []
for name, r in runs.items():
    r.engine.shutdown()
    wall = r.steps[-1][1] - r.steps[0][0]
    busy = statistics.mean(len(ran) for *_, ran in r.steps)
    mixed = [t1 - t0 for t0, t1, ran in r.steps if any(n > 1 for _, n in ran)]  # a prompt (chunk) rode along
    pure = [t1 - t0 for t0, t1, ran in r.steps if all(n == 1 for _, n in ran)]  # decode only: graph replay
    rows.append({"batching": name, "steps": len(r.steps), "seconds": wall, "output_tok_per_s": out_tokens / wall,
                 "mean_running": busy, "slot_use_pct": 100 * busy / B,
                 "prefill_steps": len(mixed), "prefill_step_ms": 1e3 * statistics.median(mixed),
                 "decode_steps": len(pure), "decode_step_ms": 1e3 * statistics.median(pure) if pure else None})
print_table(rows, title=f"{n_req} requests, outputs {out_lo}-{out_hi} tokens (log-uniform), B = {B}, "
                        f"{fast_model.config.name} on {dev} (step times: medians)")
print(f"continuous / static throughput: {rows[1]['output_tok_per_s'] / rows[0]['output_tok_per_s']:.2f}x")

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 7), dpi=100, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
t_max = max(r.steps[-1][1] - r.steps[0][0] for r in runs.values())
for col, (name, r) in enumerate(runs.items()):
    start, spans = r.steps[0][0], {}
    for t0, t1, ran in r.steps:
        for rid, n in ran:
            spans.setdefault(rid, []).append((t0 - start, t1 - t0, n > 1))
    ax = axes[0, col]
    for rid, segs in spans.items():
        y = int(rid[1:])
        for prefill in (False, True):
            ax.broken_barh([(a, w) for a, w, p in segs if p == prefill], (y - 0.4, 0.8),
                           color="C1" if prefill else "C0", linewidth=0)
    ax.set(title=f"{name}: {len(r.steps)} steps, {rows[col]['seconds']:.2f} s", ylabel="request",
           ylim=(n_req, -1))
    ax.grid(True, axis="x", alpha=0.3)
    occ = axes[1, col]
    occ.step([t0 - start for t0, *_ in r.steps], [len(ran) for *_, ran in r.steps], where="post")
    occ.axhline(B, color="gray", ls=":", lw=1)
    occ.set(xlabel="seconds", ylabel="running", ylim=(0, B * 1.15), xlim=(0, t_max))
    occ.grid(True, alpha=0.3)
axes[0, 0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color="C1"), plt.Rectangle((0, 0), 1, 1, color="C0")],
                  labels=["prefill", "decode"], loc="lower right")
plt.suptitle(f"each row a request, each bar a step it ran in (dotted line: the B = {B} slots)")
plt.tight_layout()
plt.show()

# %% [markdown]
# In the static run each group lasts as long as its longest request: the rows of the short ones
# end early and the running count falls to the group's stragglers until the next group starts.
# Continuous batching keeps the count at $B$ for as long as requests wait, and needs far fewer steps
# for the same tokens. Whether that is also fewer *seconds* depends on what a step costs, and the
# table's last columns show two kinds of step. A pure decode step replays a CUDA graph captured for
# its batch size; a step that carries a prompt (chunk) replays one captured for its token count,
# padded up to the next token bucket (section 5). Static batching prefills a whole group in a few
# steps; continuous batching runs a prefill step whenever it admits a request, which here is nearly
# every time one finishes, so it wins only if a step with a prompt chunk costs little more than a
# decode step. Run eagerly — one Python launch per kernel — such a step costs as much as a dozen
# graph replays on a GPU with a model this small (the launches are the cost, not the math), and the
# extra prefill steps can eat the steps saved; that is why the engine graphs them too (vLLM
# captures mixed batches as well, piecewise around the attention call). On a CPU both
# kinds of step run eagerly and only the step count matters. Note what an idle slot
# costs here: minillm packs the batch (padded at most to the next captured size), so a finished
# request costs no compute, only the opportunity — the step still takes the time of reading every weight, for fewer tokens. (Hugging
# Face's static `generate` keeps computing the finished rows as padding; section 6 measures it.)
#
# ## 3. Chunked prefill: a long prompt arriving while others decode
#
# A few requests are decoding when one with a long prompt arrives. With a large token budget
# (`max_num_batched_tokens` ≥ the prompt) its whole prefill runs in one step, and every decoding
# request waits for that step: one long gap between its tokens (inter-token latency, ITL). With a
# small budget the prompt is cut into chunks that ride along with the decode tokens, several
# shorter steps instead of one long one (Sarathi, Agrawal et al., 2023).

# %%
n_dec, long_len = nb.pick(cpu=(4, 512), gpu=(16, 8000))
budgets = {"one step (no chunking)": nb.pick(cpu=1024, gpu=8192), "chunked": nb.pick(cpu=128, gpu=1024)}
dec_new, arrive_at = nb.pick(cpu=(24, 8), gpu=(64, 20))
rng = random.Random(3)
decoders = [rand_ids(rng, 16) for _ in range(n_dec)]
long_prompt = rand_ids(rng, long_len)


def chunk_run(budget: int) -> dict:
    eng = engine_for(fast_model, warm=True, num_gpu_blocks=nb.pick(cpu=160, gpu=1024), max_num_batched_tokens=budget,
                     max_num_seqs=n_dec + 1)
    for i, ids in enumerate(decoders):
        eng.add_request(f"d{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=dec_new, ignore_eos=True))
    outs, steps = {}, 0
    while eng.has_unfinished_requests():
        if steps == arrive_at:  # the long prompt arrives while the others decode
            eng.add_request("long", {"prompt_token_ids": long_prompt}, SamplingParams(max_tokens=4, ignore_eos=True))
        for o in eng.step():
            outs[o.request_id] = o
        steps += 1
    eng.shutdown()
    m = outs["long"].metrics
    return {"itl": [[b - a for a, b in zip(t, t[1:])] for t in (outs[f"d{i}"].metrics.token_times[0]
                                                                  for i in range(n_dec))],
            "times": outs["d0"].metrics.token_times[0], "ttft_long": m.first_token_time - m.arrival_time}


res = {name: chunk_run(b) for name, b in budgets.items()}
rows = []
for name, r in res.items():
    itl = sorted(x for per in r["itl"] for x in per)
    rows.append({"prefill": name, "budget": budgets[name], "itl_p50_ms": 1e3 * itl[len(itl) // 2],
                 "itl_max_ms": 1e3 * itl[-1], "long_ttft_ms": 1e3 * r["ttft_long"]})
print_table(rows, title=f"{n_dec} requests decoding, a {long_len}-token prompt arrives at step {arrive_at}")

fig, ax = plt.subplots(figsize=(10, 3.8), dpi=100)
for name, r in res.items():
    t = r["times"]
    ax.plot(range(1, len(t)), [1e3 * x for x in r["itl"][0]], marker=".", label=f"{name} (budget {budgets[name]})")
ax.set(xlabel="token index of a decoding request", ylabel="ms since its previous token", yscale="log",
       title=f"inter-token latency of a decoding request while a {long_len}-token prompt is prefilled")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
plt.show()

# %% [markdown]
# Chunking trades one long stall for several shorter ones, and the long request's own first token
# comes a little later (its prefill is spread over more steps). vLLM's default budget is a few
# thousand tokens for this reason: large enough that prefill GEMMs stay efficient, small enough that
# decoders never wait for a whole long prompt.
#
# ## 4. Preemption under memory pressure
#
# The KV pool is made too small for the requests' peak demand. When a running sequence needs a
# block and none is free, the scheduler preempts the lowest-priority (latest) running sequence:
#
# - **recompute** frees its blocks; it waits again, and its prompt and the tokens it already produced
#   are prefilled anew when it comes back — compute spent twice, no extra memory;
# - **swap** copies its blocks to CPU memory and back — PCIe traffic instead of compute.
#
# Both must give exactly the tokens of an unpressured run. Counted: preemptions, tokens the model
# processed beyond the unpressured run (the recomputation), blocks moved by swapping, time.

# %%
n_req, lo, hi = nb.pick(cpu=(12, 8, 48), gpu=(24, 32, 160))
rng = random.Random(4)
pressure = [(rand_ids(rng, rng.randrange(lo, hi)),
             SamplingParams(max_tokens=rng.randrange(lo, hi), ignore_eos=True, temperature=rng.choice([0.0, 0.8]),
                            seed=rng.randrange(1 << 30)))
            for _ in range(n_req)]
need = sum(-(-(len(ids) + p.max_tokens) // 16) for ids, p in pressure)
small = nb.pick(cpu=12, gpu=64)
configs = {"unpressured": dict(num_gpu_blocks=need + 1),
           "recompute": dict(num_gpu_blocks=small, preemption_mode="recompute"),
           "swap": dict(num_gpu_blocks=small, preemption_mode="swap", num_cpu_blocks=need)}


def pressure_run(**kw):
    rec = Recorder(engine_for(exact_model, warm=True, max_num_seqs=n_req, **kw))
    for i, (ids, params) in enumerate(pressure):
        rec.add(f"r{i}", ids, params)
    t0 = time.perf_counter()
    done = rec.run()
    seconds = time.perf_counter() - t0
    rec.engine.shutdown()
    return rec, seconds, {rid: [c.token_ids for c in o.outputs] for rid, o in done.items()}


results = {name: pressure_run(**kw) for name, kw in configs.items()}
base_rec, base_s, base_tokens = results["unpressured"]
rows = []
for name, (r, seconds, tokens) in results.items():
    assert tokens == base_tokens, f"{name}: preemption changed the tokens"
    st = r.engine.stats
    rows.append({"run": name, "pool_blocks": st["num_blocks"] - 1, "preemptions": st["num_preemptions"],
                 "tokens_recomputed": r.tokens_processed - base_rec.tokens_processed,
                 "blocks_swapped": r.swapped_blocks, "steps": len(r.steps), "seconds": seconds,
                 "vs_unpressured": seconds / base_s})
print_table(rows, title=f"{n_req} requests needing {need} blocks of 16 tokens at once, {exact_model.config.name}")
print("outputs of both preemption modes are identical to the unpressured run")

# %% [markdown]
# Which mode wins depends on the ratio of compute to PCIe bandwidth and on how long the preempted
# sequences are: recomputing a short context is a cheap prefill, while a long one costs more
# FLOPs than its blocks cost bytes to park in CPU memory. vLLM defaults to recompute.
#
# ## 5. CUDA graphs: the decode step without the launch overhead
#
# A decode step of SmolLM2 is some 400 small kernels. Chapter 03 measured it at 13–30 ms on an
# H100 — far above the microseconds of GPU work — because each kernel is launched from Python.
# The `ModelRunner` records one decode step per batch size into a CUDA graph once
# (`capture_cuda_graphs`) and afterwards only copies the step's inputs into fixed buffers and
# replays it; a batch of $b$ is padded to the smallest captured size $\ge b$. Steps that carry prompt
# tokens are graphed the same way per *token* bucket (16, 32, … 512, then every 512), captured the
# first time a step needs one (`minillm/worker/cuda_graphs.py`). Timed here: one engine step
# (scheduling, inputs, forward pass, sampling) of a pure decode batch of $b$ sequences, eager
# (`enforce_eager=True`) and with graphs, in the same run.

# %%
batches = nb.pick(cpu=[1, 2, 4, 8], gpu=[1, 2, 4, 8, 16, 32, 64, 128, 256])
reps = nb.pick(cpu=3, gpu=20)


def decode_step_seconds(eng: LLMEngine, b: int) -> float:
    """Median seconds of an engine step that decodes b sequences (prefills excluded)."""
    for i in range(b):
        eng.add_request(f"b{b}-{i}", {"prompt_token_ids": [1 + i % 100] * 32},
                        SamplingParams(max_tokens=reps + 8, ignore_eos=True))
    while any(len(g.seqs[0].output_ids) == 0 for g in eng.groups.values()):
        eng.step()  # prefill (in chunks of the token budget)
    eng.step()  # first pure decode step (warm)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    eng.abort_request(list(eng.groups))
    return statistics.median(times)


modes = {"eager": True, "CUDA graphs": False} if nb.on_gpu() else {"eager": True}
engines, step_s = {}, {}
for mode, eager in modes.items():
    engines[mode] = engine_for(fast_model, num_gpu_blocks=nb.pick(cpu=64, gpu=2048), enforce_eager=eager,
                               max_num_seqs=max(batches), cuda_graph_max_batch=max(batches))
    step_s[mode] = [decode_step_seconds(engines[mode], b) for b in batches]
rows = [{"batch": b, **{f"{m}_ms": 1e3 * step_s[m][i] for m in modes},
         **{f"{m}_tok_per_s": b / step_s[m][i] for m in modes}} for i, b in enumerate(batches)]
if nb.on_gpu():
    for r, e, g in zip(rows, step_s["eager"], step_s["CUDA graphs"]):
        r["graphs_speedup"] = e / g
print_table(rows, title=f"one decode step of {fast_model.config.name}, engine step (schedule + forward + sample)")
if not nb.on_gpu():
    print("CUDA graphs need a CUDA GPU: on this CPU only the eager step is measured (the graph run is skipped)")

fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
nb.plot_lines(batches, {m: [1e3 * s for s in v] for m, v in step_s.items()}, xlabel="batch (sequences)",
              ylabel="ms per step", title="decode step time", logx=True, logy=True, ax=a1)
nb.plot_lines(batches, {m: [b / s for b, s in zip(batches, v)] for m, v in step_s.items()},
              xlabel="batch (sequences)", ylabel="output tokens / s", title="decode throughput",
              logx=True, logy=True, ax=a2)
plt.tight_layout()
plt.show()

# %% [markdown]
# Eager, the step time is flat in the batch size until the GPU work outgrows the launches: the
# launches are the cost. With graphs the flat part drops to what the GPU and the engine's Python
# bookkeeping (scheduling, building the inputs, sampling) take.
#
# Where one decode step's time goes, from `minillm.bench.serving.profile_decode_step`: on a GPU
# the sum of the kernels' durations (torch.profiler) against the step's wall time — the difference
# is the GPU waiting for the host — and, in a second pass, the host's time by phase (scheduling,
# packing inputs, launching the forward pass, sampling, the rest). The engines here run without
# chapter 13's overlap scheduling, so the host waits for each step's tokens.

# %%
prof_batches = nb.pick(cpu=[1], gpu=[1, 64])
profiles = [{"mode": m, **profile_decode_step(eng, b, steps=nb.pick(cpu=3, gpu=10))}
            for m, eng in engines.items() for b in prof_batches]
for eng in engines.values():
    eng.shutdown()
del engines
phases = ["schedule_ms", "prepare_ms", "launch_ms", "sample_ms", "other_ms"]
cols = ["mode", "batch_size", "wall_ms", "gpu_kernel_ms", "gap_ms", *phases]
print_table([{k: p[k] for k in cols} for p in profiles], title="one decode step, profiled (medians over steps)")
if not nb.on_gpu():
    print("on a CPU there are no kernels to time and no graphs: only the host's phases are shown")

fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
labels = [f"{p['mode']}, b={p['batch_size']}" for p in profiles]
left = [0.0] * len(profiles)
for i, ph in enumerate(phases):
    vals = [p[ph] for p in profiles]
    ax.barh(labels, vals, left=left, color=f"C{i}", label=ph.removesuffix("_ms"))
    left = [a + v for a, v in zip(left, vals)]
if nb.on_gpu():
    ax.scatter([p["gpu_kernel_ms"] for p in profiles], labels, color="k", marker="|", s=400, zorder=3,
               label="GPU kernels (sum)")
ax.set(xlabel="ms per decode step", title=f"where a decode step of {fast_model.config.name} goes")
ax.legend(fontsize=8, loc="lower right")
ax.grid(True, axis="x", alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 6. Benchmarks: throughput and latency, against Hugging Face
#
# `minillm bench throughput` and `minillm bench latency` (`minillm/bench/serving.py`), in this
# process, each with its peer run on the same requests:
#
# - **throughput** — the workload nano-vllm and mini-sglang publish: 256 requests, prompt and output
#   lengths uniform in 100–1024, random token ids, greedy, EOS ignored; all handed to the engine at
#   once. The peer is Hugging Face `generate` with static batches (left-padded, every row runs to
#   the batch's longest output; only each request's own tokens count). Both run warm: the engine
#   after `warm_up`, HF after one untimed batch of the real shape.
# - **latency** — batch 1, a 128-token prompt, 256 new tokens, against HF `generate` and against
#   the floor: each decode step must read every weight and the K/V so far, at the measured copy
#   bandwidth.
#
# The targets, printed next to the measurements (not asserted: they are about one GPU):
# SmolLM2 batch-1 decode ≥ 2,000 tok/s with CUDA graphs on an H100, and throughput ≥ 10× HF static
# batching. On a CPU the benchmark runs a tiny random model on a few short requests: its numbers
# say the code runs, nothing about speed.

# %%
gc.collect()
if nb.on_gpu():
    torch.cuda.empty_cache()  # the engines above are gone: the benchmark's pool takes 90% of what is free
    HF_REQUESTS = 64  # HF static batching is slow: it serves the first 64 of the 256 requests (one timed batch,
    # after one untimed warm-up batch of the same shape)
    bench_model, tp_args, lat_args = None, dict(hf_requests=HF_REQUESTS), {}
else:
    bench_model = fast_model.config  # the tiny shape, random weights for both minillm and HF
    tp_args = dict(num_requests=4, min_input_len=8, max_input_len=32, min_output_len=4, max_output_len=16,
                   hf_batch_size=2, num_gpu_blocks=64)
    lat_args = dict(input_len=16, output_len=8, num_iters=2, num_gpu_blocks=16)
tp = serving.throughput(bench_model, progress=False, **tp_args)
if nb.on_gpu():
    print(f"note: HF ran the first {tp['hf_requests']} of {tp['num_requests']} requests, to keep this notebook "
          f"within minutes; tok/s compare rates, not totals")

# %%
lat = serving.latency(bench_model, progress=False, **lat_args)

# %%
targets = [
    {"measure": "batch-1 decode, tok/s", "minillm": lat["minillm"]["decode_tok_s"],
     "HF": lat["hf"]["decode_tok_s"], "ratio": lat["ratio"], "target": "minillm >= 2,000",
     "met": lat["minillm"]["decode_tok_s"] >= 2000},
    {"measure": "throughput, output tok/s", "minillm": tp["minillm"]["output_tok_s"],
     "HF": tp["hf"]["output_tok_s"], "ratio": tp["ratio"], "target": "ratio >= 10x", "met": tp["ratio"] >= 10},
    {"measure": "batch-1 decode, % of bandwidth floor", "minillm": lat["minillm"]["pct_of_floor"],
     "HF": lat["hf"]["pct_of_floor"], "ratio": lat["minillm"]["pct_of_floor"] / lat["hf"]["pct_of_floor"],
     "target": "", "met": ""},
]
print_table(targets, title=f"measured vs the issue's targets ({'H100 targets' if nb.on_gpu() else 'CPU run: targets are for an H100'})")
m = tp["minillm"]
print(f"throughput run: TTFT p50/p99 {m['ttft_p50_ms']:.0f}/{m['ttft_p99_ms']:.0f} ms, TPOT p50/p99 "
      f"{m['tpot_p50_ms']:.1f}/{m['tpot_p99_ms']:.1f} ms, ITL p50/p99 {m['itl_p50_ms']:.1f}/{m['itl_p99_ms']:.1f} ms, "
      f"peak {m['peak_used_blocks']} of {m['num_blocks']} KV blocks")

# %%
reqs = tp["requests"]
fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4), dpi=100)
for ax, key, what in ((a1, "ttft_s", "time to first token"), (a2, "tpot_s", "time per output token")):
    vals = sorted(1e3 * r[key] for r in reqs if r[key] is not None)
    ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], drawstyle="steps-post")
    ax.set(xlabel="ms", ylabel="fraction of requests", title=f"throughput run: {what}")
    ax.grid(True, alpha=0.3)
a2.axvline(m["itl_p50_ms"], color="C1", ls="--", label="ITL p50")
a2.axvline(m["itl_p99_ms"], color="C3", ls="--", label="ITL p99")
a2.legend()
nb.plot_bars(["minillm", "HF static"], [tp["minillm"]["output_tok_s"], tp["hf"]["output_tok_s"]],
             ylabel="output tokens / s", title=f"throughput ({tp['ratio']:.1f}x)", ax=a3, annotate="{:,.0f}")
plt.tight_layout()
plt.show()

# %% [markdown]
# TTFT in the throughput run is mostly queueing: all requests arrive at once and wait for a slot
# and for the token budget; a request's TPOT grows with how many others share its steps. The
# latency run shows the other end: one request alone, where CUDA graphs and the engine's host
# overhead decide how close a step comes to the time of reading the weights once.

# %%
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")
