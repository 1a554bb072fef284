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
# # 17 · Disaggregated prefill and decode: two engines, one K/V
#
# A producer engine prefills each prompt (one token to generate) and keeps its K/V; a consumer engine
# loads those K/V through a KV connector and decodes. Here the two run as two processes on this
# device, beside a third, colocated engine that does both, all three spawned once by
# `minillm.bench.disagg.Cluster`; a queue between producer and consumer plays the router's two-phase
# request. We check that the disaggregated tokens are the colocated ones, draw the timeline of a few
# requests and of a prefill burst, and run `minillm bench disagg`: TTFT, TPOT, ITL percentiles and
# goodput across request rates.
#
# One device as two processes is **not** two devices: the engines share its compute and bandwidth, so
# the split removes the scheduling interference (no decode step carries a prefill chunk), not the
# hardware one.

# %%
import math
import os
import time

import matplotlib.pyplot as plt
import numpy as np

from minillm import notebook as nb
from minillm.bench import disagg

nb.header("17")
dev = nb.device()
T0 = time.perf_counter()
sizes = dict(disagg.GPU if nb.on_gpu() else disagg.CPU)
vocab = 512 if sizes["preset"] is None else 32000
cluster = disagg.Cluster(dev.type, sizes["preset"], sizes["max_batched"])
print(f"three engine processes up ({sizes['preset'] or 'tiny llama, fp32'}), "
      f"connector {'CudaIpcConnector' if nb.on_gpu() else 'SharedPoolConnector'}")

# %% [markdown]
# ## 1. The same tokens
#
# Six requests at once, greedy. The colocated engine computes each prompt and decodes; in the
# disaggregated setup the producer computes the prompt with `max_tokens=1`, the consumer claims the
# transfer, allocates blocks, copies every prompt position but the last from the producer's pool, and
# computes only the last prompt token itself (its logits give the first new token).

# %%
schedule = disagg.poisson_schedule(math.inf, 6, sizes, vocab, seed=1)
colo, t_colo = cluster.run("colocated", schedule, "eq-c")
split, t_split = cluster.run("disagg", schedule, "eq-d")
same = [colo[i][0] == split[i][0] for i in range(len(schedule))]
print(f"tokens identical: {sum(same)} of {len(same)}")
if not nb.on_gpu():  # fp32 on a CPU: bit for bit (bf16 on a GPU may round a different batch differently)
    assert all(same)

# %% [markdown]
# ## 2. The timeline of one batch
#
# Each request a row: from its arrival to its first token (the prefill: on the producer, then the
# transfer, then the consumer's one-token step), then one tick per step that gave it a token.


# %%
def timeline(ax, sched, got, t0, title):
    for i, (arrival, _, _) in enumerate(sched):
        stamps = np.asarray(got[i][1]) - t0
        ax.plot([arrival, stamps[0]], [i, i], color="tab:red", lw=6, solid_capstyle="butt")
        ax.plot(stamps, [i] * len(stamps), "|", color="tab:blue", ms=8)
    ax.set_title(title)
    ax.set_xlabel("seconds since the first arrival")
    ax.set_ylabel("request")


fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), sharex=True)
timeline(axes[0], schedule, colo, t_colo, "colocated: prefill (red) then tokens")
timeline(axes[1], schedule, split, t_split, "1 prefill + 1 decode process")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. A prefill burst
#
# A few long decodes run alone; then several long prompts arrive at once. Colocated, the burst's
# prefill chunks share steps with the decodes, and every decode stream waits for them: the gaps between
# its tokens (ITL) jump. Disaggregated, the burst goes to the producer; the decodes' steps carry no
# prefill (on one device they still share its hardware with the producer).

# %%
burst_at = 1.0 if dev.type == "cpu" else 0.5
bsched = disagg.burst_schedule(sizes, vocab, seed=7, burst_at=burst_at)
nd = sizes["burst_decodes"]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
burst = {}
for ax, setup in zip(axes, ("colocated", "disagg")):
    got, t0 = cluster.run(setup, bsched, f"bu-{setup[0]}")
    burst[setup] = disagg.burst_itl(bsched, got, t0, nd)
    end = max(got[i][1][0] for i in range(nd, len(bsched))) - t0
    for i in range(nd):
        stamps = np.asarray(got[i][1]) - t0
        ax.plot(stamps[1:], np.diff(stamps) * 1e3, ".", ms=3)
    ax.axvspan(burst_at, end, color="tab:red", alpha=0.15, label="the burst's prefill")
    ax.set_title(f"{setup}: ITL p99 {burst[setup]['itl_p99_decode_only_ms']:.1f} ms alone, "
                 f"{burst[setup]['itl_p99_during_burst_ms']:.1f} ms in the burst", fontsize=9)
    ax.set_xlabel("seconds")
axes[0].set_ylabel("ITL of the decodes (ms)")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()
for setup, b in burst.items():
    print(f"{setup:>9}: ITL p99 during the burst / decode-only = {b['ratio']:.2f}x")

# %% [markdown]
# ## 4. `minillm bench disagg`: latency percentiles across request rates
#
# Poisson arrivals; the SLO is 5 x the colocated engine's median TTFT and TPOT at the lowest rate (named
# in the table). With `MINILLM_BENCH_JSON` set, the whole report is written there.

# %%
rates = nb.pick("16,64", "4,16,64")
report = disagg.run(device=dev.type, rates=rates, num_prompts=nb.pick(6, 32), workloads="rates", cluster=cluster)
x = [r["rate"] for r in report["rates"]]
fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
for ax, (key, label) in zip(axes, (("p99_ttft_ms", "TTFT p99 (ms)"), ("p99_itl_ms", "ITL p99 (ms)"),
                                   ("goodput", "goodput (req/s in SLO)"))):
    for setup in ("colocated", "disagg"):
        ax.plot(x, [r[setup][key] for r in report["rates"]], "o-", label=setup)
    ax.set_xscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(label)
axes[0].legend()
plt.tight_layout()
plt.show()
assert all(r["tokens_equal"] == r["requests"] for r in report["rates"]) or nb.on_gpu()

# %%
cluster.close()
print(f"notebook wall time: {time.perf_counter() - T0:.0f} s")
if os.environ.get("MINILLM_BENCH_JSON"):
    print("report written to $MINILLM_BENCH_JSON")
