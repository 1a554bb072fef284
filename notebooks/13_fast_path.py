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
# # 13 · The fast path: where a step's time goes
#
# Chapter 07's engine gives every request the right tokens, and for a big model at batch 1 it runs
# close to the time of reading the weights. For the small model this course starts with, and for big
# batches, it does not: the GPU waits for the host. This notebook measures where one decode step's time
# goes — the host's phases against the GPU's kernels — with **overlap scheduling** on and off
# (`minillm/engine/overlap_steps.py`: step N+1 is scheduled and launched before step N's tokens reach
# the host), counts the kernels a step launches and what launching them costs, times one fusion, and
# measures batch-1 latency against the weight-reading floor. First, as always, the oracle: overlap
# changes *when* the host learns a token, never *which* token.

# %%
import gc
import os
import statistics
import time

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)  # a CPU run uses tiny shapes, where more threads only wait on each other

import matplotlib.pyplot as plt

from minillm import SamplingParams
from minillm import notebook as nb
from minillm.bench import serving
from minillm.bench.serving_setup import free_engine, load_models
from minillm.bench.step_profile import profile_decode_step
from minillm.bench.table import print_table
from minillm.engine import EngineConfig, LLMEngine
from minillm.generation import generate_sequences
from minillm.kernels.rms_norm import rms_norm, rms_norm_ref
from minillm.loader import load_model

nb.header("13")
dev = nb.device()
T0 = time.perf_counter()

# %% [markdown]
# ## 1. The oracle: overlap on = overlap off = one request alone
#
# The embedded SmolLM2-135M in fp32 (its logits have clear winners, so a different batch shape cannot
# flip a near-tie). A few chat prompts, greedy and seeded random sampling, some stopping on EOS —
# the case the overlapped engine handles one step late — go through `LLMEngine` together, with
# `async_scheduling` on and off, and each one through chapter 03's one-request path.

# %%
model, cfg, tok = load_model(None, dtype=torch.float32, device=dev)
eos = cfg.eos_token_ids or [tok.eos_token_id]
texts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
         "Explain what a GPU does.", "Say hello.", "Count from one to ten."]
max_new = nb.pick(cpu=10, gpu=48)
requests = [(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=True),
             SamplingParams(max_tokens=max_new, temperature=0.0 if i % 2 == 0 else 0.8, seed=i))
            for i, t in enumerate(texts)]


def run_engine(on: bool) -> tuple[dict, int]:
    """Every request at once through an engine with async_scheduling=on -> ({id: tokens}, overlapped steps)."""
    engine = LLMEngine(model, tok, eos, EngineConfig(async_scheduling=on, num_gpu_blocks=nb.pick(cpu=64, gpu=256),
                                                     max_num_seqs=len(requests), cuda_graph_max_batch=8),
                       progress=False)
    for i, (ids, sp) in enumerate(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, sp)
    got, overlapped = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        overlapped += engine._inflight is not None  # a step is in flight when step() returns
    engine.shutdown()
    return got, overlapped


def one_request(ids, sp) -> list[int]:
    *_, seqs = generate_sequences(model, tok, ids, sp, eos)  # chapter 03: one request, its own KV cache
    return seqs[0].output_ids


alone = {f"r{i}": one_request(ids, sp) for i, (ids, sp) in enumerate(requests)}
on, overlapped = run_engine(True)
off, never = run_engine(False)
assert overlapped > 0 and never == 0, "the overlapped path must have run with overlap on, and only then"
assert on == off == alone, {r: (on[r], off[r], alone[r]) for r in alone if not on[r] == off[r] == alone[r]}
stopped_early = sum(len(t) < max_new for t in alone.values())
print(f"{len(requests)} requests ({stopped_early} stopped on EOS): overlap on == overlap off == one request alone")
for i, t in enumerate(texts[:3]):
    print(f"  {t!r} -> {tok.decode(on[f'r{i}'])!r}")

# %% [markdown]
# ## 2. Where one decode step's time goes
#
# `profile_decode_step` (`minillm/bench/step_profile.py`, also `minillm bench profile`) puts `b`
# requests into steady-state decode and measures, per step: the wall time between two `step()` returns;
# on a GPU, the sum of the kernels' durations from `torch.profiler` (the GPU's busy time) and the
# number of kernels; and, in a separate pass, the host's time by phase — `schedule`, `prepare` (packing
# the `ModelInput`), `launch` (the executor's `execute_model`: input copies and a graph replay),
# `sample`, and `other` (bookkeeping: appending tokens, stop checks, outputs; with overlap, also the
# wait for the previous step's tokens).
#
# The model here is SmolLM2-135M's shape with random bf16 weights on a GPU (speed does not depend on
# the weights' values); on a CPU, a tiny random model of the same family, whose numbers only show that
# the code runs.

# %%
if nb.on_gpu():
    speed = load_models("smollm2-135m-dummy", dev)
    speed_model, speed_tok = speed.model, speed.tokenizer
else:
    speed_model, speed_tok = nb.tiny_random_model()[0], tok
num_layers = speed_model.config.num_layers
batches = nb.pick(cpu=[1, 4], gpu=[1, 64, 256])
steps = nb.pick(cpu=3, gpu=10)
profiles = []
for on in (True, False):
    engine = LLMEngine(speed_model, speed_tok, [], EngineConfig(async_scheduling=on, max_num_seqs=max(batches),
                                                                num_gpu_blocks=nb.pick(cpu=64, gpu=4096)),
                       progress=False)
    for b in batches:
        profiles.append({"overlap": "on" if on else "off", **profile_decode_step(engine, b, steps=steps)})
    free_engine(engine)
phases = ["schedule_ms", "prepare_ms", "launch_ms", "sample_ms", "other_ms"]
cols = ["overlap", "batch_size", "wall_ms", "gpu_kernel_ms", "gpu_busy_pct", "gap_ms", "kernels_per_step", *phases]
print_table([{k: p[k] for k in cols} for p in profiles], title=f"one decode step of {speed_model.config.name} "
            "(medians over steps)")
for b in batches:
    p_on, p_off = (next(p for p in profiles if p["overlap"] == o and p["batch_size"] == b) for o in ("on", "off"))
    print(f"batch {b:>3}: step {p_off['wall_ms']:.3f} ms without overlap, {p_on['wall_ms']:.3f} ms with it "
          f"({p_off['wall_ms'] / p_on['wall_ms']:.2f}x)")
if not nb.on_gpu():
    print("on a CPU there are no kernels to time, and the model runs on the host too: overlap has no idle GPU to "
          "fill, so its timings here only show that the code runs")

# %% [markdown]
# The same numbers drawn as two lanes per run: the host's phases laid end to end, and below them the
# GPU's kernel time (busy) and the rest of the step (idle, waiting for the host). These are sums per
# step, not a trace: with overlap the host's work of step N+1 runs *while* the GPU works on step N, so
# the host lane can be as long as the step and the GPU still busy most of it.

# %%
fig, ax = plt.subplots(figsize=(9, 0.9 * len(profiles) + 1.2), dpi=100)
y, labels = 0, []
for p in profiles:
    left = 0.0
    for i, ph in enumerate(phases):
        ax.barh(y, p[ph], left=left, color=f"C{i}", label=ph.removesuffix("_ms") if y == 0 else None)
        left += p[ph]
    labels.append(f"host · overlap {p['overlap']}, b={p['batch_size']}")
    y += 1
    if p["gpu_kernel_ms"] is not None:
        ax.barh(y, p["gpu_kernel_ms"], color="k", label="GPU kernels" if y == 1 else None)
        ax.barh(y, p["wall_ms"] - p["gpu_kernel_ms"], left=p["gpu_kernel_ms"], color="0.85",
                label="GPU idle" if y == 1 else None)
        labels.append(f"GPU · {p['gpu_busy_pct']:.0f}% busy")
        y += 1
    ax.axhline(y - 0.5, color="0.6", lw=0.5)
ax.set_yticks(range(len(labels)), labels, fontsize=8)
ax.invert_yaxis()
ax.set(xlabel="ms per decode step", title=f"where a decode step of {speed_model.config.name} goes")
ax.legend(fontsize=8, loc="lower right")
ax.grid(True, axis="x", alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Kernels per step, and what launching them costs
#
# Even a graphed step pays for every kernel: a launch from a CUDA graph, and a ramp-up and a tail while
# the kernel's blocks spread over the SMs and the last ones drain. So a step of $k$ kernels cannot take
# less than $k \cdot t_\text{launch}$, whatever each kernel does. Here $t_\text{launch}$ is measured: a
# CUDA graph of $N$ one-element adds, replayed, timed with device events (eagerly, each launch also pays
# the host's dispatch through PyTorch, timed the same way).

# %%
def launch_cost_us(n: int = nb.pick(cpu=200, gpu=2000), reps: int = nb.pick(cpu=2, gpu=20)) -> dict:
    """µs per kernel of n tiny kernels: eager (host dispatch + launch) and, on a GPU, replayed from a graph."""
    x = torch.zeros(1, device=dev)
    out = {}

    def eager():
        for _ in range(n):
            x.add_(1)

    def timed(fn) -> float:
        fn()  # warm-up
        if not nb.on_gpu():
            t = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                t.append(time.perf_counter() - t0)
            return 1e6 * statistics.median(t) / n
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            t.append(start.elapsed_time(end) * 1e3)  # ms -> µs
        return statistics.median(t) / n

    out["eager_us"] = timed(eager)
    if nb.on_gpu():
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            eager()  # warm up on a side stream before capture, as CUDA graphs ask
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            eager()
        out["graphed_us"] = timed(g.replay)
    return out


launch = launch_cost_us()
print("µs per tiny kernel: " + ", ".join(f"{k.removesuffix('_us')} {v:.2f}" for k, v in launch.items()))
rows = []
for p in profiles:
    if p["kernels_per_step"] is None:
        continue
    k = p["kernels_per_step"]
    rows.append({"overlap": p["overlap"], "batch_size": p["batch_size"], "kernels_per_step": k,
                 "kernels_per_layer": k / num_layers, "launch_floor_ms": 1e-3 * k * launch["graphed_us"],
                 "gpu_kernel_ms": p["gpu_kernel_ms"], "wall_ms": p["wall_ms"]})
if rows:
    print_table(rows, title=f"kernels per step ({num_layers} layers) and the launch floor = kernels x "
                f"{launch['graphed_us']:.2f} µs")
    b1 = next(p for p in profiles if p["overlap"] == "on" and p["batch_size"] == 1)
    print_table([{**k, "batch_size": 1} for k in b1["top_kernels"]], ["name", "launches_per_step", "us_per_step"],
                title="the top kernels of a batch-1 step (overlap on)")
else:
    print("(on a CPU no kernels are counted)")

# %% [markdown]
# ## 4. One fusion, measured: residual add + RMSNorm
#
# Every decoder layer does `residual = x + residual; x = norm(residual)` twice. In plain PyTorch that is
# about eight kernels (add, cast, square, mean, add eps, rsqrt, multiply, multiply by the weight), each
# reading and writing the row again; chapter 04's Triton kernel does it in one pass. The same 2 × 30
# calls a SmolLM2 step makes, at a decode shape, captured in a CUDA graph each way, on fresh random
# inputs (the outputs agree first).

# %%
T, H = nb.pick(cpu=(3, 96), gpu=(1, 576))
dt = torch.bfloat16 if nb.on_gpu() else torch.float32
g = torch.Generator(device="cpu").manual_seed(13)
x, res = (torch.randn(T, H, generator=g).to(dev, dt) for _ in range(2))
w = (1 + 0.1 * torch.randn(H, generator=g)).to(dev, dt)
(o1, r1), (o2, r2) = rms_norm(x, w, 1e-5, res), rms_norm_ref(x, w, 1e-5, res)
assert torch.equal(r1, r2), "the new residual is one rounded add both ways"
assert torch.allclose(o1.float(), o2.float(), atol=2e-2 if dt == torch.bfloat16 else 1e-5, rtol=1e-2)
calls = 2 * 30


def graphed_ms(fn) -> float:
    """ms for `calls` calls of fn, replayed from one CUDA graph (median of 20)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        t.append(start.elapsed_time(end))
    return statistics.median(t)


if nb.on_gpu():
    fused_ms = graphed_ms(lambda: rms_norm(x, w, 1e-5, res))
    unfused_ms = graphed_ms(lambda: rms_norm_ref(x, w, 1e-5, res))
    print(f"{calls} residual-add + RMSNorm calls at [{T}, {H}] {dt}: PyTorch ops {1e3 * unfused_ms:.0f} µs, "
          f"one Triton kernel {1e3 * fused_ms:.0f} µs ({unfused_ms / fused_ms:.1f}x)")
else:
    print("fused and PyTorch residual-add + RMSNorm agree; their timing needs a GPU")

# %% [markdown]
# ## 5. Batch-1 latency, overlap on and off, against the floor
#
# `minillm bench latency` (a 128-token prompt, 256 new tokens, greedy, EOS ignored on a GPU) in this
# process, with `async_scheduling` on and off. The floor is the time of reading every weight and the
# K/V so far once per step at the measured copy bandwidth: the fastest any engine could decode.

# %%
gc.collect()
if nb.on_gpu():
    torch.cuda.empty_cache()  # the profiled engines are gone: each latency engine's pool takes 90 % of what is free
    lat_model, lat_args = "smollm2-135m-dummy", {}
else:
    lat_model, lat_args = speed_model.config, dict(input_len=16, output_len=8, num_iters=2, num_gpu_blocks=16)
lats = {on: serving.latency(lat_model, hf=False, progress=False, async_scheduling=on, **lat_args)
        for on in (True, False)}

# %%
rows = [{"overlap": "on" if on else "off", **{k: r["minillm"][k] for k in
                                              ("decode_tok_s", "tpot_p50_ms", "floor_tok_s", "pct_of_floor")}}
        for on, r in lats.items()]
print_table(rows, title="batch-1 decode, overlap on and off")
on_s, off_s = (lats[o]["minillm"]["decode_tok_s"] for o in (True, False))
print(f"overlap on / off: {on_s / off_s:.2f}x decode tok/s")
if rows and nb.on_gpu():
    step_ms = 1e3 / on_s
    floor_ms = 1e3 / lats[True]["minillm"]["floor_tok_s"]
    launch_ms = 1e-3 * b1["kernels_per_step"] * launch["graphed_us"]
    fig, ax = plt.subplots(figsize=(7, 2.6), dpi=100)
    bars = {"weight-reading floor": floor_ms, "launch floor (kernels x launch)": launch_ms,
            "GPU kernels (profile, b=1)": b1["gpu_kernel_ms"], "measured step (overlap on)": step_ms}
    ax.barh(list(bars), list(bars.values()), color=["C2", "C1", "k", "C0"])
    for i, v in enumerate(bars.values()):
        ax.text(v, i, f" {v:.3f} ms", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms per decode step", title="batch 1: the step against its two floors")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# At batch 1 the GPU is busy most of the step, but busy with many small kernels: the step is near its
# launch floor, far above the weight-reading floor. Fewer, fatter kernels (the fused decode layer) move
# the launch floor down; overlap already removed most of the host gap. At batch 256 the story flips:
# the GPU finishes early and waits for the host's per-sequence Python bookkeeping.

# %%
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")
