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
# # 12 · Serving: the engine behind an HTTP API
#
# Chapters 03–07 built an engine that runs many requests at once. People reach it over HTTP, with
# clients that already speak OpenAI's API. `minillm serve` (`minillm/entrypoints/openai/`, FastAPI +
# uvicorn as in vLLM and SGLang) puts the engine behind `/v1/completions` and `/v1/chat/completions`,
# streaming tokens as server-sent events. The engine core steps in a process of its own while the API
# process's event loop serves connections (`minillm serve`'s default, vLLM V1's `EngineCore` /
# `AsyncLLM` split). This notebook starts the real server in a subprocess, follows one request from its
# HTTP bytes to the kernel and back with measured timestamps, loads the server with Poisson arrivals at
# three rates the way `vllm bench serve` does (`minillm bench serve` runs the same code), opens many
# streams at once and lets a quarter of them walk away mid-answer, and puts the server's throughput,
# engine steps and CPU time next to the offline engine's on the same requests, with the engine core in
# its own process and, beside it, in a thread of the server's.

# %%
import asyncio
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

from minillm import load_tokenizer
from minillm import notebook as nb
from minillm.bench.serve import random_workload, run_requests, session
from minillm.bench.serve_metrics import SSEParser, summarize
from minillm.bench.serve_overhead import measure
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
FLAGS += ["--engine-core", "process"]  # the default, named: the engine core in a process of its own
SERVER_ENV = {**os.environ, **({} if GPU else {"OMP_NUM_THREADS": "1"})}


def save_json(name: str, rows) -> None:
    """With $MINILLM_BENCH_OUT set (scripts/gpu/nb12.sh), the measured rows go there as JSON too."""
    if os.environ.get("MINILLM_BENCH_OUT"):
        Path(os.environ["MINILLM_BENCH_OUT"], name).write_text(json.dumps(rows, indent=1, default=str))


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
# | hand-off | the request checked and queued for the engine core (one pipe message, sent at once) |
# | queue | queued → the engine step that first runs it begins |
# | prefill | that step: the prompt's forward pass and the first token sampled |
# | decode steps | the other n − 1 tokens, one engine step each |
# | SSE out | the engine's last step → the client has the last chunk (event loop, JSON, SSE, socket) |
#
# The parts add up to the end-to-end latency exactly. Detokenizing happens in the API process, as each
# step's token ids arrive (overlapping the core's next step; only the last row's falls in SSE out); its
# share is measured apart by replaying the answer's tokens through the same `IncrementalDetokenizer`.

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
# template, the hand-off to the engine core's process, and getting the first event out.

# %%
http_ttft = [(t["first_text"] - t["client_sent"]) * 1e3 for t in runs]
engine_ttft = [(t["first_token"] - t["queued"]) * 1e3 for t in runs]
added = statistics.median(h - e for h, e in zip(http_ttft, engine_ttft))
print(f"TTFT through HTTP   median {statistics.median(http_ttft):8.2f} ms")
print(f"TTFT in the engine  median {statistics.median(engine_ttft):8.2f} ms")
print(f"the server adds     median {added:8.2f} ms   (target on a GPU: within 2 ms)")

# %% [markdown]
# ## Load: Poisson arrivals at three rates
#
# `run_requests` is `minillm bench serve`'s client (aiohttp, one session whose connector opens a
# connection for every request that finds none idle): requests are sent at the times of a Poisson
# process of the given rate, each streams, and TTFT, TPOT, ITL and E2E come from its chunk timestamps
# (`serve_metrics.py`, the definitions of `vllm bench serve`). The workload is the course's random one:
# random token ids of SmolLM2's vocabulary as the prompt (sent as ids, so a server and an offline
# engine can be given the very same tokens), EOS ignored so each request makes exactly its output
# length. Each rate gets about 10 s worth of requests (at least 48, at most 384). The three rates are
# a light load, a middling one and one past what the server completes.
#
# Below the server's capacity, a request finds a small batch: TTFT is one prefill, TPOT one decode
# step. Past it, arrivals outpace completions, the queue grows for as long as the run lasts, and TTFT
# climbs by orders of magnitude while throughput stops growing: that bend is the knee. TPOT grows
# gently before it (a bigger batch makes each decode step a little slower, chapter 07) and then
# flattens at the engine's full batch.

# %%
RATES = nb.pick(cpu=[2.0, 8.0, 32.0], gpu=[16.0, 64.0, 256.0])
IN_LEN, OUT_LEN = nb.pick(cpu=((4, 16), (4, 8)), gpu=((128, 512), (64, 256)))
SLO = nb.pick(cpu=(60000.0, 60000.0), gpu=(250.0, 25.0))  # (TTFT ms, TPOT ms) for goodput
SWEEP_BUDGET_S = 180  # stop adding rates past this, so the notebook stays within its GPU time


def n_requests(rate: float) -> int:
    if not GPU:
        return 6
    return 384 if math.isinf(rate) else min(384, max(48, int(rate * 10)))


sweep, summaries, workloads, t_sweep = [], [], {}, time.perf_counter()
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
    summaries.append({"request_rate": rate, **s})
    sweep.append({"rate": rate, "requests": s["completed"], "req/s": s["request_throughput"],
                  "out tok/s": s["output_throughput"], "TTFT p50": s["median_ttft_ms"], "TTFT p99": s["p99_ttft_ms"],
                  "TPOT p50": s["median_tpot_ms"], "TPOT p99": s["p99_tpot_ms"], "ITL p99": s["p99_itl_ms"],
                  "goodput": s["goodput"]})
print_table(sweep, title=f"serving sweep (ms; goodput in req/s under TTFT <= {SLO[0]:g} ms and TPOT <= {SLO[1]:g} ms)")
save_json("serve-sweep.json", summaries)
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
# lowest rate's (the queue, not the prefill, now sets it). With three rates the sweep brackets the
# knee rather than pinning it: it lies between the last rate that kept up and that one.

# %%
base_ttft = sweep[0]["TTFT p99"]
knee = next((r for r in sweep if math.isfinite(r["rate"]) and
             (r["req/s"] < 0.9 * r["rate"] or r["TTFT p99"] > 5 * base_ttft)), None)
if knee is None:
    print("no knee within the rates swept: the server kept up with every one")
else:
    kept_up = [r["rate"] for r in sweep if r["rate"] < knee["rate"]]
    print(f"past the knee at {knee['rate']:g} req/s: {knee['req/s']:.1f} req/s completed, p99 TTFT "
          f"{knee['TTFT p99']:.0f} ms (vs {base_ttft:.0f} ms at {sweep[0]['rate']:g} req/s), {knee['out tok/s']:.0f} "
          f"output tokens/s" + (f"; it kept up at {max(kept_up):g} req/s" if kept_up else ""))

# %% [markdown]
# ## Many streams at once, and clients that walk away
#
# A server's users do not wait politely for their answers: they open streams all at once, and some
# close the tab mid-answer. Here 256 clients (32 on a CPU) stream greedy completions at the same time,
# and every fourth one disconnects after its first tokens, from a request that would otherwise run
# for 1,024 tokens. When a client goes, its handler's stream is closed, its `finally` sends
# `("abort", ids)` down the pipe, and the engine core frees the request's KV blocks before its next
# step. What must hold:
#
# - none of the other streams fails: each ends with its `finish_reason`, its usage and `[DONE]`;
# - no token is lost: each stream asks for `logprobs: 0`, so every chunk lists the tokens it carries
#   (a chunk can carry several once the client falls behind and the server coalesces), and the tokens
#   a client received equal the server's `usage` and the same request sent unstreamed;
# - every KV block comes back: `/metrics` (`minillm_kv_cache_used_blocks`) reads 0 once the streams
#   are done, and `minillm_requests_total{finish_reason="abort"}` counted every client that left.
#
# A poller reads `/metrics` every 50 ms while the streams run, so the blocks can be watched coming back.

# %%
N_STREAMS = nb.pick(cpu=32, gpu=256)
LEAVE_AFTER, LEAVER_TOKENS = 2, nb.pick(cpu=64, gpu=1024)  # a leaver goes after 2 tokens of its 1,024
stream_reqs = random_workload(N_STREAMS, IN_LEN, OUT_LEN, seed=24, prompt_format="ids")
leaver = [i % 4 == 3 for i in range(N_STREAMS)]  # a quarter of the clients
URL = f"{BASE}/v1/completions"


def scrape() -> dict[str, float]:
    """/metrics as {name{labels}: value}."""
    out = {}
    for line in httpx.get(f"{BASE}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def body_of(i: int, stream: bool) -> dict:
    q = stream_reqs[i]
    return {"prompt": q.prompt, "max_tokens": LEAVER_TOKENS if leaver[i] else q.max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": stream, **({"stream_options": {"include_usage": True}}
                                                                     if stream else {})}


async def stream_one(client, i: int) -> dict:
    tokens, text, finish, usage, done, parser = [], "", None, None, False, SSEParser()
    async with client.post(URL, json=body_of(i, True)) as r:
        status = r.status
        async for raw in r.content.iter_any():
            for data in parser.feed(raw):
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                usage = event.get("usage") or usage
                for c in event["choices"]:
                    text += c["text"]
                    tokens += (c.get("logprobs") or {}).get("tokens") or []
                    finish = c["finish_reason"] or finish
            if leaver[i] and len(tokens) >= LEAVE_AFTER:
                r.close()  # the client goes away mid-answer: the connection closes under the stream
                return dict(status=status, left=True, tokens=tokens, at=time.perf_counter())
    return dict(status=status, left=False, tokens=tokens, text=text, finish=finish, usage=usage, done=done)


async def unstreamed(client, i: int) -> dict:
    async with client.post(URL, json=body_of(i, False)) as r:
        return await r.json()


async def poll(timeline: list, stop: asyncio.Event, t0: float) -> None:
    while not stop.is_set():
        m = await asyncio.to_thread(scrape)
        timeline.append((time.perf_counter() - t0, m["minillm_kv_cache_used_blocks"],
                         m["minillm_num_requests_running"], m["minillm_num_requests_waiting"]))
        await asyncio.sleep(0.05)


def wait_idle(timeout: float = 60.0) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds a block, on two scrapes in a row."""
    deadline, idle = time.perf_counter() + timeout, 0
    while idle < 2:
        m = scrape()
        idle = idle + 1 if m["minillm_num_requests_running"] == m["minillm_num_requests_waiting"] == \
            m["minillm_kv_cache_used_blocks"] == 0 else 0
        assert time.perf_counter() < deadline, f"not idle after {timeout} s: {m}"
        time.sleep(0.05)
    return m


ABORTS = 'minillm_requests_total{finish_reason="abort"}'
before = wait_idle()
timeline, stop, t_streams = [], asyncio.Event(), time.perf_counter()
async with session(N_STREAMS + 2, None, 600) as client:
    poller = asyncio.create_task(poll(timeline, stop, t_streams))
    streams = await asyncio.gather(*(stream_one(client, i) for i in range(N_STREAMS)))
    streams_s = time.perf_counter() - t_streams
    after = await asyncio.to_thread(wait_idle)
    stop.set()
    await poller
    stayers = [i for i in range(N_STREAMS) if not leaver[i]]
    whole = await asyncio.gather(*(unstreamed(client, i) for i in stayers))

failed = [i for i in stayers if streams[i]["left"] or streams[i]["status"] != 200 or not streams[i]["done"]
          or streams[i]["finish"] != "length" or streams[i]["usage"] is None]
streamed_tokens = sum(len(streams[i]["tokens"]) for i in stayers)
usage_tokens = sum(streams[i]["usage"]["completion_tokens"] for i in stayers if streams[i]["usage"])
whole_tokens = sum(w["usage"]["completion_tokens"] for w in whole)
lost = sum(max(0, w["usage"]["completion_tokens"] - len(streams[i]["tokens"])) for i, w in zip(stayers, whole))
same = sum(streams[i]["tokens"] == w["choices"][0]["logprobs"]["tokens"] and streams[i]["text"] == w["choices"][0]["text"]
           for i, w in zip(stayers, whole))
left = [s for s in streams if s["left"]]
peak = max(timeline, key=lambda row: row[1])
print_table([{"": "streams", "value": f"{N_STREAMS} at once, {len(left)} left after {LEAVE_AFTER} tokens"},
             {"": "failed among the rest", "value": f"{len(failed)} of {len(stayers)}"},
             {"": "tokens streamed / server usage / unstreamed", "value": f"{streamed_tokens} / {usage_tokens} / "
              f"{whole_tokens}"},
             {"": "lost tokens", "value": lost},
             {"": "answers equal to the unstreamed (tokens and text)", "value": f"{same} of {len(stayers)}"},
             {"": "aborted (/metrics)", "value": int(after.get(ABORTS, 0) - before.get(ABORTS, 0))},
             {"": "seconds until every stream ended", "value": f"{streams_s:.2f}"}],
            title=f"{N_STREAMS} concurrent streams, a quarter of them disconnecting mid-answer")
print_table([{"/metrics": label, "running": m[2], "waiting": m[3], "KV blocks used": m[1]}
             for label, m in [("before", (0, before["minillm_kv_cache_used_blocks"], before["minillm_num_requests_running"],
                                          before["minillm_num_requests_waiting"])),
                              (f"peak (at {peak[0]:.2f} s)", peak),
                              ("after", (0, after["minillm_kv_cache_used_blocks"], after["minillm_num_requests_running"],
                                         after["minillm_num_requests_waiting"]))]],
            title=f"the KV pool through /metrics ({int(after['minillm_kv_cache_total_blocks'])} blocks in all)")
save_json("serve-streams.json", dict(streams=N_STREAMS, left=len(left), failed=len(failed), streamed_tokens=streamed_tokens,
                                     usage_tokens=usage_tokens, unstreamed_tokens=whole_tokens, lost_tokens=lost,
                                     equal_answers=same, seconds=streams_s, metrics_before=before, metrics_after=after,
                                     peak=dict(zip(["t", "used_blocks", "running", "waiting"], peak))))
assert not failed and lost == 0 and streamed_tokens == usage_tokens == whole_tokens
assert int(after.get(ABORTS, 0) - before.get(ABORTS, 0)) == len(left) == N_STREAMS // 4
assert peak[1] > 0 and after["minillm_kv_cache_used_blocks"] == 0  # every block back in the pool
if not GPU:  # fp32 on a CPU: the same tokens whatever the batch; bf16 on a GPU may part at a near-tie (chapter 12)
    assert same == len(stayers)

# %%
ts, used, running, _ = zip(*timeline)
fig, ax = plt.subplots(figsize=(9, 3.2))
ax.plot(ts, used, "-", label="KV blocks used")
ax.set_xlabel("seconds since the streams opened")
ax.set_ylabel("KV blocks used")
ax2 = ax.twinx()
ax2.plot(ts, running, "--", color="tab:orange", label="requests running")
ax2.set_ylabel("requests running")
gone = max(s["at"] for s in left) - t_streams
ax.axvline(gone, color="gray", lw=0.8)
ax.text(gone, max(used) * 0.95, " every leaver gone", fontsize=8, va="top")
ax.legend(handles=ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0], fontsize=8, loc="upper right")
ax.set_title(f"{N_STREAMS} streams, a quarter leaving: the KV pool through /metrics")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## The server vs the offline engine on the same requests
#
# The server stops here: each measurement below starts its own. `measure` (`minillm/bench/serve_overhead.py`,
# what `python -m minillm.bench.serve_overhead` runs) sends the course's random workload all at once
# (rate inf) to a fresh `minillm serve`, from a client in a process of its own, then runs the very same
# token ids through `LLM.generate` in another process of its own, which ends before the next server
# sizes its KV pool. The ratio of output throughputs is what HTTP, JSON, SSE and the process hops cost
# (the target on a GPU: at least 85 %).
#
# A ratio of wall times hides its cause, so it comes with two more signals:
#
# - **Engine steps on each side**, from `/metrics` (`minillm_engine_steps_total`) and the offline
#   engine's own count, and the output tokens per step: each running sequence makes one token a step,
#   so tokens per step is the mean number of sequences that made a token in a step. A server whose
#   requests trickle in steps more often with fewer sequences each.
# - **CPU time per 1000 output tokens of each process**, from `/proc`: the API process's event loop
#   and its other threads, the engine core's process, the client's, and the offline run's.
#
# The engine core runs in its own process first (the default), then in a thread of the server's.

# %%
http.close()
server.__exit__(None, None, None)
CORES = nb.pick(cpu=["process"], gpu=["process", "thread"])
N_SAME = nb.pick(cpu=24, gpu=384)
OVERHEAD_BUDGET_S = 200  # the thread core only if the notebook has had less than this so far
overhead = {}
for core in CORES:
    if overhead and time.perf_counter() - T0 > OVERHEAD_BUDGET_S:
        print(f"(engine core {core} not measured: the notebook has run {time.perf_counter() - T0:.0f} s)")
        continue
    (WORK / core).mkdir(exist_ok=True)  # the server's log goes there
    overhead[core] = measure(MODEL, "cuda" if GPU else "cpu", N_SAME, IN_LEN, OUT_LEN, WORK / core,
                             flags=["--engine-core", core])
save_json("serve-overhead.json", [{"engine_core": core, **r} for core, r in overhead.items()])
per_k = {core: 1e6 / r["output_tokens"] for core, r in overhead.items()}  # CPU seconds -> ms per 1000 output tokens
print_table([{"engine core": core, "out tok/s served": r["served_tps"], "offline": r["offline_tps"],
              "served / offline %": 100 * r["ratio"], "engine steps served / offline": f"{r['served_steps']:.0f} / "
              f"{r['offline_steps']}", "tok/step served / offline": f"{r['output_tokens'] / r['served_steps']:.1f} / "
              f"{r['output_tokens'] / r['offline_steps']:.1f}"} for core, r in overhead.items()],
            title=f"the same {N_SAME} requests ({next(iter(overhead.values()))['output_tokens']:,} output tokens) at "
            "rate inf, served and offline")
print_table([{"engine core": core, "API loop": per_k[core] * r["loop_cpu_s"],
              "API other threads": per_k[core] * r["other_cpu_s"], "core process": per_k[core] * r["core_cpu_s"],
              "client": per_k[core] * r["client_cpu_s"], "offline": per_k[core] * r["offline_cpu_s"]}
             for core, r in overhead.items()], title="CPU ms per 1000 output tokens, by process")
for core, r in overhead.items():
    print(f"engine core {core}: server / offline {100 * r['ratio']:.0f} % (target on a GPU: >= 85 %); served steps "
          f"{r['served_steps'] / r['offline_steps']:.2f} x offline's (target: <= 1.25 x)")

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 3.6), width_ratios=[1, 1, 1.3])
names = list(overhead)
axes[0].bar([i - 0.2 for i in range(len(names))], [overhead[c]["served_tps"] for c in names], 0.4, label="served")
axes[0].bar([i + 0.2 for i in range(len(names))], [overhead[c]["offline_tps"] for c in names], 0.4, label="offline")
for i, c in enumerate(names):
    axes[0].text(i - 0.2, overhead[c]["served_tps"], f"{100 * overhead[c]['ratio']:.0f} %", ha="center", va="bottom",
                 fontsize=8)
axes[0].set_xticks(range(len(names)), [f"engine core: {c}" for c in names])
axes[0].set_ylabel("output tokens / s")
axes[0].set_title("the same requests, served and offline")
axes[0].legend(fontsize=8)
steps = [overhead[c]["served_steps"] for c in names] + [overhead[names[0]]["offline_steps"]]
axes[1].bar([f"served ({c})" for c in names] + ["offline"], steps, color=["tab:blue"] * len(names) + ["tab:orange"])
axes[1].set_ylabel("engine steps")
axes[1].set_title("engine steps for the same tokens")
parts = [("loop_cpu_s", "API loop"), ("other_cpu_s", "API other threads"), ("core_cpu_s", "core process"),
         ("client_cpu_s", "client")]
bars = [f"served ({c})" for c in names] + ["offline"]
bottom = [0.0] * len(bars)
for key, label in parts:
    heights = [per_k[c] * overhead[c][key] for c in names] + [0.0]
    axes[2].bar(bars, heights, bottom=bottom, label=label)
    bottom = [b + h for b, h in zip(bottom, heights)]
axes[2].bar(bars, [0.0] * len(names) + [per_k[names[0]] * overhead[names[0]]["offline_cpu_s"]], bottom=bottom,
            label="offline LLM.generate")
axes[2].set_ylabel("CPU ms per 1000 output tokens")
axes[2].set_title("where the CPU goes, by process")
axes[2].legend(fontsize=8)
plt.tight_layout()
plt.show()
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")

# %% [markdown]
# ## What the numbers say
#
# The split shows where a lone request's time goes: on a GPU almost all of it is engine steps, and
# the server's own parts (HTTP in, tokenize, hand-off, SSE out) are fractions of a millisecond each; on
# a CPU the engine steps of a tiny model are so short that the server's parts show. The sweep shows
# the other face of serving: latency at low load is the engine's, and past the knee it is the
# queue's. Goodput (DistServe) is the number to size a deployment by: how many requests per second
# meet both SLOs, not how many tokens leave the GPU. The streams show the server's bookkeeping under
# churn: clients that leave cost nothing once their abort lands, and those that stay get every token.
# Served against offline, the step counts and the CPU per process say where the difference comes
# from: more engine steps with fewer sequences each, or more CPU per token in one of the processes.
# Chapter 12's text walks the same path in words.
