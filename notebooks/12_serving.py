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
# # 12 · Serving: the engine behind an HTTP API
#
# Chapters 03–07 built an engine that runs many requests at once. People reach it over HTTP, with
# clients that already speak OpenAI's API. `minillm serve` (`minillm/entrypoints/openai/`, FastAPI +
# uvicorn as in vLLM and SGLang) puts the engine behind `/v1/completions` and `/v1/chat/completions`,
# streaming tokens as server-sent events; the engine steps in a thread of its own while the event
# loop serves connections (`AsyncLLMEngine`; `minillm serve` now runs the engine in a separate process
# by default, and this notebook pins the thread design its stored outputs were measured with). This notebook starts the real server in a subprocess,
# follows one request from its HTTP bytes to the kernel and back with measured timestamps, loads the
# server with Poisson arrivals at rising rates the way `vllm bench serve` does (`minillm bench serve`
# runs the same code), finds the knee, and puts the server's throughput next to the offline engine's
# on the same requests.

# %%
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import httpx
import matplotlib.pyplot as plt

from minillm import LLM, SamplingParams, load_tokenizer
from minillm import notebook as nb
from minillm.bench.serve import random_workload, run_requests
from minillm.bench.serve_metrics import SSEParser, summarize
from minillm.bench.table import print_table
from minillm.model_files import embedded_model_path
from minillm.tokenizer.detokenizer import IncrementalDetokenizer

nb.header("12")
GPU = nb.on_gpu()
T0 = time.perf_counter()

# %% [markdown]
# ## The server
#
# On a GPU the server runs the embedded SmolLM2-135M in bf16 (it compiles and captures its CUDA graphs
# before `/health` says 200). On a CPU, where that model answers about one token a second, a tiny
# random model of the same shape family and with SmolLM2's tokenizer and chat template stands in,
# written here as a Hugging Face folder: the numbers then say the path works, not how fast it is.

# %%
from minillm.bench.serve_overhead import tiny_checkpoint  # a 2-layer Llama with SmolLM2's tokenizer, random weights

WORK = Path(tempfile.mkdtemp(prefix="minillm-nb12-"))
MODEL = str(embedded_model_path()) if GPU else str(tiny_checkpoint(WORK / "tiny"))
FLAGS = ["--gpu-memory-utilization", "0.6"] if GPU else ["--device", "cpu"]  # GPU: room for this process too
FLAGS += ["--engine-core", "thread"]  # the design the stored outputs measured (the default is now "process")
SERVER_ENV = {**os.environ, **({} if GPU else {"OMP_NUM_THREADS": "1"})}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def minillm_serve(model: str, *flags: str, timeout: float = 600):
    """`minillm serve` in a subprocess on 127.0.0.1; yields its base URL once /health says 200."""
    port, log = free_port(), WORK / "serve.log"
    cmd = [sys.executable, "-m", "minillm", "serve", "--model", model, "--port", str(port), "--no-access-log", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=SERVER_ENV)
    base, t = f"http://127.0.0.1:{port}", time.perf_counter()
    try:
        while True:
            assert proc.poll() is None, f"minillm serve exited:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            assert time.perf_counter() - t < timeout, f"not healthy after {timeout} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        print(f"minillm serve {' '.join(cmd[4:])}\n  healthy after {time.perf_counter() - t:.1f} s at {base}")
        yield base
    finally:
        proc.terminate()
        proc.wait(60)


server = minillm_serve(MODEL, *FLAGS)
BASE = server.__enter__()
http = httpx.Client(base_url=BASE, timeout=120)
print(http.get("/v1/models").json())

# %% [markdown]
# ## One streamed request, as the client sees it
#
# A chat request with `stream: true`: the answer comes as `data: {json}` events, one per engine step
# that made text, then a usage event (`stream_options.include_usage`) and `data: [DONE]`. The client
# parses the events as the bytes arrive (`SSEParser`, what lab 12 asks you to write) and times each.

# %%
body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
events, times, parser = [], [], SSEParser()
sent = time.perf_counter()
with http.stream("POST", "/v1/chat/completions", json=body) as r:
    for raw in r.iter_bytes():
        now = time.perf_counter()
        for data in parser.feed(raw):
            events.append(data)
            times.append(now)
for data, t in list(zip(events, times))[:3] + list(zip(events, times))[-2:]:
    print(f"+{(t - sent) * 1e3:7.1f} ms  data: {data[:110]}")
chunks = [json.loads(e) for e in events if e != "[DONE]"]
answer = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
print(f"\n{len(events)} events; the answer: {answer!r}; usage: {chunks[-1]['usage']}")
assert events[-1] == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] <= 24

# %% [markdown]
# The same server speaks to `curl`, to the official `openai` client (`OpenAI(base_url=BASE + "/v1",
# api_key=...)`), to `minillm bench serve`, and to a browser: `BASE/` is a chat page that streams
# from the same endpoint (its Stop button closes the connection, and the server frees the request's
# KV blocks at the next step).
#
# ## Where one request's time goes
#
# The server stamps each request as it moves (`GET /debug/timing/{id}`), with `time.perf_counter()`:
# the machine's monotonic clock, which this notebook's process reads too, so client and server stamps
# subtract. With the server idle (batch 1), one chat request's latency splits into:
#
# | part | from → to |
# |---|---|
# | HTTP in | the client sends → the handler starts (connection, headers, JSON body, validation) |
# | tokenize | chat template + BPE of the conversation |
# | hand-off | the request checked and queued for the engine thread |
# | queue | queued → the engine step that first runs it begins |
# | prefill | that step: the prompt's forward pass and the first token sampled |
# | decode steps | the other n − 1 tokens, one engine step each (detokenizing included) |
# | SSE out | the engine's last step → the client has the last chunk (event loop, JSON, SSE, socket) |
#
# The parts add up to the end-to-end latency exactly. Detokenizing happens inside each step; its share
# is measured apart by replaying the answer's tokens through the same `IncrementalDetokenizer`.

# %%
tok = load_tokenizer(MODEL)
QUESTION = ("Explain in a few sentences how a refrigerator keeps food cold, and why its back is warm. " * 3).strip()
N_SPLIT = nb.pick(cpu=3, gpu=20)
SPLIT_TOKENS = nb.pick(cpu=16, gpu=128)


def timed_request(content: str, max_tokens: int) -> dict:
    """One streamed chat request; -> the client's stamps and the server's /debug/timing record."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    parser, text_times, text, rid, finished = SSEParser(), [], "", None, None
    sent = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        for raw in r.iter_bytes():
            now = time.perf_counter()
            for data in parser.feed(raw):
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                rid = rid or event["id"]
                for choice in event["choices"]:
                    if choice["delta"].get("content"):
                        text_times.append(now)
                        text += choice["delta"]["content"]
                    if choice["finish_reason"]:
                        finished = now  # the last token's chunk (its text may be empty: a special token)
    server_stamps = http.get(f"/debug/timing/{rid}").json()
    return dict(server_stamps, client_sent=sent, first_text=text_times[0], finished=finished, text=text)


def split(t: dict) -> dict:
    marks = [t["client_sent"], t["received"], t["tokenized"], t["queued"], t["scheduled"], t["first_token"],
             t["engine_done"], t["finished"]]
    assert marks == sorted(marks), marks
    names = ["HTTP in", "tokenize", "hand-off", "queue", "prefill", "decode steps", "SSE out"]
    return {n: (b - a) * 1e3 for n, a, b in zip(names, marks, marks[1:])}


def detok_ms(text: str) -> float:
    """Replay: the answer's tokens through a fresh IncrementalDetokenizer, timed."""
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    t = time.perf_counter()
    for i in ids:
        d.step(i)
    return (time.perf_counter() - t) * 1e3


timed_request(QUESTION, 4)  # one untimed request first
runs = [timed_request(QUESTION, SPLIT_TOKENS) for _ in range(N_SPLIT)]
parts = [split(t) for t in runs]
median = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
e2e = statistics.median((t["finished"] - t["client_sent"]) * 1e3 for t in runs)
for p, t in zip(parts, runs):
    assert abs(sum(p.values()) - (t["finished"] - t["client_sent"]) * 1e3) < 1e-6  # the parts tile the request
detok = statistics.median(detok_ms(t["text"]) for t in runs)
rows = [{"part": k, "median ms": v, "share %": 100 * v / e2e} for k, v in median.items()]
rows.append({"part": "  of which detokenize (replayed)", "median ms": detok, "share %": 100 * detok / e2e})
print_table(rows, title=f"one chat request, {runs[0]['prompt_tokens']} prompt tokens, {SPLIT_TOKENS} output tokens, "
            f"batch 1: median of {N_SPLIT} (E2E median {e2e:.1f} ms)")

fig, ax = plt.subplots(figsize=(9, 1.8))
left = 0.0
for (k, v), color in zip(median.items(), plt.cm.tab10.colors):
    ax.barh([0], [v], left=left, color=color, label=f"{k} {v:.2f} ms")
    left += v
ax.set_yticks([])
ax.set_xlabel("ms since the client sent the request")
ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45))
ax.set_title("one request's latency, part by part (batch 1)")
plt.show()

# %% [markdown]
# **TTFT through HTTP vs the engine's own.** The engine's TTFT runs from the moment the request is
# queued for it to its first token; the client's, from sending the bytes to reading the first text.
# The difference is everything the server adds before the first token: HTTP, validation, the chat
# template, the hand-off to the engine thread, and getting the first event out.

# %%
http_ttft = [(t["first_text"] - t["client_sent"]) * 1e3 for t in runs]
engine_ttft = [(t["first_token"] - t["queued"]) * 1e3 for t in runs]
added = statistics.median(h - e for h, e in zip(http_ttft, engine_ttft))
print(f"TTFT through HTTP   median {statistics.median(http_ttft):8.2f} ms")
print(f"TTFT in the engine  median {statistics.median(engine_ttft):8.2f} ms")
print(f"the server adds     median {added:8.2f} ms   (target on a GPU: within 2 ms)")

# %% [markdown]
# ## Load: Poisson arrivals at rising rates
#
# `run_requests` is `minillm bench serve`'s client: requests are sent at the times of a Poisson
# process of the given rate (`inf`: all at once), each streams, and TTFT, TPOT, ITL and E2E come from
# its chunk timestamps (`serve_metrics.py`, the definitions of `vllm bench serve`). The workload is the
# course's random one: random token ids of SmolLM2's vocabulary as the prompt (sent as ids, so the
# server and the offline engine below see the very same tokens), EOS ignored so each request makes
# exactly its output length. Each rate gets about 10 s worth of requests (at least 48, at most 384).
#
# Below the server's capacity, a request finds a small batch: TTFT is one prefill, TPOT one decode
# step. Past it, arrivals outpace completions, the queue grows for as long as the run lasts, and TTFT
# climbs by orders of magnitude while throughput stops growing: that bend is the knee. TPOT grows
# gently before it (a bigger batch makes each decode step a little slower, chapter 07) and then
# flattens at the engine's full batch.

# %%
RATES = nb.pick(cpu=[4.0, math.inf], gpu=[4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, math.inf])
IN_LEN, OUT_LEN = nb.pick(cpu=((4, 16), (4, 8)), gpu=((128, 512), (64, 256)))
SLO = nb.pick(cpu=(60000.0, 60000.0), gpu=(250.0, 25.0))  # (TTFT ms, TPOT ms) for goodput
SWEEP_BUDGET_S = 180  # stop adding rates past this, so the notebook stays within its GPU time


def n_requests(rate: float) -> int:
    if not GPU:
        return 6
    return 384 if math.isinf(rate) else min(384, max(48, int(rate * 10)))


sweep, workloads, t_sweep = [], {}, time.perf_counter()
for rate in RATES:
    if time.perf_counter() - t_sweep > SWEEP_BUDGET_S:
        print(f"(rate {rate} and above skipped: the sweep has used {SWEEP_BUDGET_S} s)")
        break
    reqs = random_workload(n_requests(rate), IN_LEN, OUT_LEN, seed=12, prompt_format="ids")
    # (Jupyter runs an event loop already: the cell awaits the client directly)
    results, duration, _ = await run_requests(BASE, reqs, request_rate=rate, ignore_eos=True, seed=12,
                                              progress=False)
    s = summarize(results, duration, SLO)
    assert s["failed"] == 0 and s["total_output_tokens"] == sum(q.max_tokens for q in reqs)
    workloads[rate] = (reqs, s)
    sweep.append({"rate": rate, "requests": s["completed"], "req/s": s["request_throughput"],
                  "out tok/s": s["output_throughput"], "TTFT p50": s["median_ttft_ms"], "TTFT p99": s["p99_ttft_ms"],
                  "TPOT p50": s["median_tpot_ms"], "TPOT p99": s["p99_tpot_ms"], "ITL p99": s["p99_itl_ms"],
                  "goodput": s["goodput"]})
print_table(sweep, title=f"serving sweep (ms; goodput in req/s under TTFT <= {SLO[0]:g} ms and TPOT <= {SLO[1]:g} ms)")
metrics = http.get("/metrics").text
print("\n".join(line for line in metrics.splitlines()
                if line.startswith(("minillm_requests_total", "minillm_num_preemptions", "minillm_kv_cache_total"))))

# %%
finite = [r["rate"] for r in sweep if math.isfinite(r["rate"])]
x = [r["rate"] if math.isfinite(r["rate"]) else 2 * max(finite or [1.0]) for r in sweep]
labels = [f"{r:g}" if math.isfinite(r) else "inf" for r in (row["rate"] for row in sweep)]
fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
for ax, key, title in [(axes[0], "TTFT", "time to first token"), (axes[1], "TPOT", "time per output token")]:
    for p, style in [("p50", "o-"), ("p99", "s--")]:
        ax.plot(x, [r[f"{key} {p}"] for r in sweep], style, label=f"{key} {p}")
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title(title)
axes[2].plot(x, [r["out tok/s"] for r in sweep], "o-", label="output tokens/s")
axes[2].set_ylabel("output tokens / s")
axes[2].set_title("throughput")
for ax in axes:
    ax.set_xscale("log")
    ax.set_xticks(x, labels)
    ax.minorticks_off()
    ax.set_xlabel("request rate (req/s)")
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# **The knee**, read off the sweep: the first rate at which the server no longer keeps up — it
# completes less than 90 % of the offered requests per second, or its p99 TTFT is more than 5× the
# lowest rate's (the queue, not the prefill, now sets it).

# %%
base_ttft = sweep[0]["TTFT p99"]
knee = next((r for r in sweep if math.isfinite(r["rate"]) and
             (r["req/s"] < 0.9 * r["rate"] or r["TTFT p99"] > 5 * base_ttft)), None)
if knee is None:
    print("no knee within the finite rates swept: the server kept up with every one")
else:
    print(f"knee at {knee['rate']:g} req/s: {knee['req/s']:.1f} req/s completed, p99 TTFT {knee['TTFT p99']:.0f} ms "
          f"(vs {base_ttft:.0f} ms at {sweep[0]['rate']:g} req/s), {knee['out tok/s']:.0f} output tokens/s")

# %% [markdown]
# ## The server vs the offline engine on the same requests
#
# The `inf` run sent every request at once: the server's engine was as busy as `LLM.generate` would be
# on the same list. Run offline in this process (the server stopped first, so the two never share the
# GPU), on the very same token ids, the ratio of output throughputs is what HTTP, JSON, SSE and the
# async loop cost (the target on a GPU: at least 85 %).

# %%
http.close()
server.__exit__(None, None, None)
reqs, served = workloads[math.inf]
if not GPU:
    torch.set_num_threads(1)  # as the server ran (OMP_NUM_THREADS=1): the same CPU resources for both
llm = LLM(MODEL, device="cuda" if GPU else "cpu")
if GPU:
    llm.engine.warm_up()
prompts = [{"prompt_token_ids": q.prompt} for q in reqs]
params = [SamplingParams(temperature=0.0, max_tokens=q.max_tokens, ignore_eos=True) for q in reqs]
llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
offline_s = time.perf_counter() - t
offline_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
assert offline_tokens == served["total_output_tokens"]  # the same work, token for token
offline_tps = offline_tokens / offline_s
print_table([{"": "minillm serve (HTTP, rate inf)", "requests": len(reqs), "output tokens": served["total_output_tokens"],
              "seconds": served["duration_s"], "out tok/s": served["output_throughput"]},
             {"": "LLM.generate (offline)", "requests": len(reqs), "output tokens": offline_tokens,
              "seconds": offline_s, "out tok/s": offline_tps}], title="same requests, served vs offline")
print(f"server / offline: {100 * served['output_throughput'] / offline_tps:.0f} %  (target on a GPU: >= 85 %)")
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")

# %% [markdown]
# ## What the numbers say
#
# The split shows where a lone request's time goes: on a GPU almost all of it is engine steps, and
# the server's own parts (HTTP in, tokenize, hand-off, SSE out) are fractions of a millisecond each; on
# a CPU the engine steps of a tiny model are so short that the server's parts show. The sweep shows
# the other face of serving: latency at low load is the engine's, and past the knee it is the
# queue's. Goodput (DistServe) is the number to size a deployment by: how many requests per second
# meet both SLOs, not how many tokens leave the GPU. Chapter 12's text walks the same path in words.
