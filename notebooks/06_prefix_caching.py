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
# # 06 · Prefix caching
#
# A token's keys and values depend only on the tokens before it. Two requests that begin with the
# same tokens (a system prompt, the earlier turns of a chat, a few-shot preamble) compute the same
# K/V for that prefix, so the second one need not compute it at all if the first one's blocks are
# still around. Chapter 05's blocks make that cheap: name every *full* block by everything up to its
# end, keep blocks nobody uses instead of freeing them, and let a new sequence start from the blocks
# whose names it shares. minillm has both ways of finding the names (`minillm/engine/prefix_cache.py`):
# vLLM's hash chain and SGLang's radix tree, with least-recently-used eviction when the pool runs
# dry. This notebook checks they change no token, and measures what they save on two workloads.

# %%
import os
import time

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
import numpy as np

from minillm import SamplingParams, load_tokenizer
from minillm import notebook as nb
from minillm.bench.table import print_table
from minillm.config import ModelConfig
from minillm.engine import EngineConfig, HashPrefixCache, LLMEngine, RadixPrefixCache
from minillm.engine.block_manager import cdiv
from minillm.loader import load_model

nb.header("06")
dev = nb.device()

# %% [markdown]
# ## 1. Two ways to name a block
#
# Blocks of 4 tokens here. Sequence A = `[1 2 3 4 | 5 6 7 8 | 9 10 11 12]` sits in blocks 10, 11, 12;
# sequence B shares A's first block and then differs. The hash cache keys block $i$ by
# hash(key of block $i-1$, tokens of block $i$), so `[5 6 7 8]` after `[1 2 3 4]` and after anything
# else are different keys; the radix tree keys it by its path from the root. A new prompt C that
# begins like A finds the longest shared run of full blocks in either.

# %%
# NBVAL_CHECK_OUTPUT
A, B = list(range(1, 13)), [1, 2, 3, 4, 50, 51, 52, 53]
C = [1, 2, 3, 4, 5, 6, 7, 8, 99, 98]
for cache in (HashPrefixCache(4), RadixPrefixCache(4)):
    cache.insert(A, [10, 11, 12])
    cache.insert(B, [10, 20])
    print(f"{type(cache).__name__:>17}: C matches blocks {cache.match(C, max_blocks=len(C) // 4)}, "
          f"B matches {cache.match(B, max_blocks=2)}, [5 6 7 8] alone matches {cache.match([5, 6, 7, 8], 1)}")


def show_tree(node, depth=0):
    for tokens, child in node.children.items():
        print("    " * depth + f"{list(tokens)} -> block {child.block}")
        show_tree(child, depth + 1)


show_tree(cache.root)

# %% [markdown]
# ## 2. The harness
#
# The embedded SmolLM2-135M in fp32 on the GPU (on the CPU, where it takes about a second a step, a
# tiny random Llama with SmolLM2's vocabulary), greedy, `ignore_eos` (every setting does the same work). Each
# run builds a fresh `LLMEngine` with `enable_prefix_caching` = None, `"hash"` or `"radix"` and
# records, per request, the time to first token (`metrics.first_token_time − arrival_time`); per run
# the prefix-cache hit rate (`engine.stats`: the share of full-block prompt tokens asked for that
# were found), the tokens the model computed (from every `SchedulerOutput`: scheduled tokens minus
# the generated tokens fed back), the tokens saved (`hit_tokens`), the evictions, and the wall time.

# %%
tiny, tiny_cfg = nb.tiny_random_model()
if nb.on_gpu():
    model, mcfg, tok = load_model(None, dtype=torch.float32, device=dev)
else:
    model, mcfg, tok = tiny, tiny_cfg, load_tokenizer()
eos = sorted(set(mcfg.eos_token_ids or [tok.eos_token_id]))
print(f"model: {mcfg.name}, {mcfg.num_layers} layers, fp32 on {dev}")
SETTINGS = [None, "hash", "radix"]
BS = 16


def serve(model, setting, requests, follow_up=None, num_blocks=None, check=True, **engine_args):
    """Run `requests` [(request_id, token ids, params)] through a fresh engine. follow_up(output) may
    return more requests to add when one finishes (the next turn of a chat)."""
    engine = LLMEngine(model, tok, eos, EngineConfig(block_size=BS, num_gpu_blocks=num_blocks,
                                                     enable_prefix_caching=setting, **engine_args), progress=False)
    scheds, evicted = [], []  # instrumentation: every SchedulerOutput, every evicted block
    schedule, pc = engine.scheduler.schedule, engine.block_manager.prefix_cache

    def recording_schedule():
        scheds.append(schedule())
        return scheds[-1]

    engine.scheduler.schedule = recording_schedule
    if pc is not None:
        evict = pc.evict

        def counting_evict():
            block = evict()
            if block is not None:
                evicted.append(block)
            return block

        pc.evict = counting_evict
    # Decode graphs are captured when the engine is built; graphs of steps with prompt tokens would be
    # captured on first use, inside some request's TTFT. Capture them all now, off the clock (the
    # kernels were tuned once for the process by nb.warm_up below; graphs belong to one engine).
    engine.runner.capture_token_buckets()
    outs, queue = {}, list(requests)
    t0 = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        for rid, ids, params in queue:
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
        queue = []
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
                queue += follow_up(out) if follow_up else []
    total = time.perf_counter() - t0
    engine.shutdown()
    ran = sum(n for s in scheds for _, n in s.scheduled)
    fed_back = sum(len(c.token_ids) - 1 for o in outs.values() for c in o.outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs.values())
    st = engine.stats
    if check and setting is not None:  # two independent counts of the same saving (an ample pool)
        assert ran - fed_back == prompt_tokens - st["prefix_hit_tokens"], (ran, fed_back, prompt_tokens, st)
    ttft = np.array([o.metrics.first_token_time - o.metrics.arrival_time for o in outs.values()])
    report = {"prefix caching": str(setting), "hit rate %": 100 * (st["prefix_hit_rate"] or 0.0),
              "prompt tokens": prompt_tokens, "prefill computed": ran - fed_back,
              "saved": st["prefix_hit_tokens"], "computed / prompt %": 100 * (ran - fed_back) / prompt_tokens,
              "evictions": len(evicted),
              "preemptions": st["num_preemptions"], "steps": len(scheds), "TTFT p50 ms": 1e3 * np.median(ttft),
              "TTFT mean ms": 1e3 * ttft.mean(), "total s": total}
    return {rid: [c.token_ids for c in o.outputs] for rid, o in outs.items()}, outs, report


def random_ids(n, gen, vocab=mcfg.vocab_size):
    return torch.randint(100, vocab, (n,), generator=gen).tolist()  # ids from 100 up: past the special tokens


# Before anything is timed: Triton compiles (and, in bf16, autotunes) the prefill kernel per prompt-length
# bucket on first use, which would land in the TTFT of whichever run meets a length first. One warm-up
# per model covers every length up to the largest token budget used below (tuning is per process).
nb.warm_up([model, tiny], tok, 2048)


# %% [markdown]
# ## 3. One system prompt, many questions
#
# N requests, all queued at once: one long system prompt (random token ids, 1,000 tokens on the GPU,
# 64 on the CPU) followed by a distinct short question each. Without a cache every request prefills
# the system prompt again; with one, only the first requests do. Not only the first one: the blocks
# are named when their K/V have been *computed*, so the requests packed into the same first step (the
# token budget, `max_num_batched_tokens`, holds about two of them) cannot see each other's blocks yet.

# %%
N, SYS, Q, NEW = nb.pick(cpu=(8, 64, 12, 4), gpu=(64, 1000, 32, 32))
budget = nb.pick(cpu=128, gpu=2048)
gen = torch.Generator().manual_seed(6)
system = random_ids(SYS, gen)
greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
shared = [(f"q{i}", system + random_ids(Q, gen), greedy) for i in range(N)]
pool = 1 + N * cdiv(SYS + Q + NEW, BS)  # room for every request at once: no eviction, no preemption
engine_args = dict(num_blocks=pool, max_num_batched_tokens=budget, max_num_seqs=N, cuda_graph_max_batch=N)
shared_runs = {s: serve(model, s, shared, **engine_args) for s in SETTINGS}
for s in SETTINGS[1:]:
    assert shared_runs[s][0] == shared_runs[None][0], f"prefix caching {s!r} changed the tokens"
print(f"tokens identical across {SETTINGS}: True ({N} requests x {NEW} tokens)")
shared_rows = [r for _, _, r in shared_runs.values()]
print_table(shared_rows, title=f"{N} requests = {SYS}-token system prompt + {Q}-token question, {NEW} new tokens each")
off, on = shared_rows[0], shared_rows[1]
print(f"hash cache vs none: {off['prefill computed'] / on['prefill computed']:.1f}x fewer prefill tokens, TTFT p50 "
      f"{off['TTFT p50 ms'] / on['TTFT p50 ms']:.1f}x lower, total time {off['total s'] / on['total s']:.2f}x lower")

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 3.8), dpi=100)
labels = [r["prefix caching"] for r in shared_rows]
nb.plot_bars(labels, [r["prefill computed"] for r in shared_rows], ylabel="prompt tokens computed",
             title="prefill work", annotate="{:,.0f}", ax=a1)
for s, (_, outs, _) in shared_runs.items():
    ttft = sorted(1e3 * (o.metrics.first_token_time - o.metrics.arrival_time) for o in outs.values())
    a2.plot(ttft, np.linspace(0, 100, len(ttft)), label=f"prefix caching {s}")
a2.set(xlabel="time to first token (ms)", ylabel="% of requests", title="TTFT distribution (all queued at once)")
a2.legend(fontsize=8)
a2.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Multi-turn chat
#
# C conversations, each of T turns. Turn $k$'s prompt is turn $k-1$'s prompt + the model's answer +
# a new user message, so every turn repeats the whole history. A conversation's next turn is sent
# when its previous answer is complete; the conversations run side by side. With the cache, a turn
# finds its history in the blocks its previous turn left (all but the last, partly filled block
# and the answer's last token, whose K/V was never computed) and prefills only the new message.

# %%
C, T, U, ANS = nb.pick(cpu=(3, 4, 12, 4), gpu=(16, 8, 96, 48))
answer = SamplingParams(temperature=0, max_tokens=ANS, ignore_eos=True)


def chat_workload(C, T, U, seed=7, vocab=mcfg.vocab_size):
    gen = torch.Generator().manual_seed(seed)
    user = {(c, k): random_ids(U, gen, vocab) for c in range(C) for k in range(T)}  # every user message, fixed up front

    def follow_up(out):
        c, k = map(int, out.request_id[1:].split("t"))
        if k + 1 == T:
            return []
        prompt = list(out.prompt_token_ids) + out.outputs[0].token_ids + user[(c, k + 1)]
        return [(f"c{c}t{k + 1}", prompt, answer)]

    return [(f"c{c}t0", user[(c, 0)], answer) for c in range(C)], follow_up


first, follow = chat_workload(C, T, U)
longest = U + (T - 1) * (ANS + U)
chat_pool = 1 + C * cdiv(longest + ANS, BS) * 2  # the histories of every turn fit: no eviction
chat_runs = {s: serve(model, s, first, follow, num_blocks=chat_pool, max_num_seqs=C, cuda_graph_max_batch=C)
             for s in SETTINGS}
for s in SETTINGS[1:]:
    assert chat_runs[s][0] == chat_runs[None][0], f"prefix caching {s!r} changed the tokens"
print(f"tokens identical across {SETTINGS}: True ({C} conversations x {T} turns x {ANS} tokens)")
chat_rows = [r for _, _, r in chat_runs.values()]
print_table(chat_rows, title=f"{C} conversations x {T} turns: {U}-token user messages, {ANS}-token answers "
                             f"(last turn's prompt {longest} tokens)")

# %%
fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
for s, (_, outs, _) in chat_runs.items():
    per_turn = [1e3 * np.mean([o.metrics.first_token_time - o.metrics.arrival_time
                               for rid, o in outs.items() if rid.endswith(f"t{k}")]) for k in range(T)]
    ax.plot(range(1, T + 1), per_turn, "o-", label=f"prefix caching {s}")
ax.set(xlabel="turn", ylabel="mean TTFT (ms)", title=f"TTFT per turn, {C} conversations side by side")
ax.legend()
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# Without the cache a turn's TTFT grows with the history it must prefill again; with it, each turn
# prefills about one user message, whatever came before.
#
# ## 5. LRU eviction under a small pool
#
# Blocks nobody uses stay cached only while the pool has room. Shrink the pool and the least
# recently used ones are evicted to make room, so later turns find less of their history. The chat
# workload again, with more conversations than run at once (`max_num_seqs`), so a conversation's
# history must survive while others are served; the tiny random model on every device here (the
# hit rate depends only on the tokens), every pool size for both caches. The smallest pool still holds the
# sequences that run at once; below that, the engine preempts.

# %%
C2, T2, U2, RUN = nb.pick(cpu=(6, 4, 16, 2), gpu=(24, 6, 64, 8))
first2, follow2 = chat_workload(C2, T2, U2, seed=8)
final_blocks = cdiv(U2 + (T2 - 1) * (ANS + U2) + ANS, BS)
everything = 1 + C2 * T2 * final_blocks  # every turn's blocks could stay cached
floor = 1 + RUN * final_blocks + 1
pools = sorted({int(x) for x in np.geomspace(floor, everything, 6)}, reverse=True)
sweep, ref_tokens = [], None
for num_blocks in pools:
    for s in ("hash", "radix"):
        toks, _, r = serve(tiny, s, first2, follow2, num_blocks=num_blocks, check=False, max_num_seqs=RUN,
                           cuda_graph_max_batch=RUN)
        ref_tokens = ref_tokens or toks
        assert toks == ref_tokens, f"{s} with {num_blocks} blocks changed the tokens"
        sweep.append({"pool blocks": num_blocks, **r})
print_table(sweep, ["pool blocks", "prefix caching", "hit rate %", "saved", "prefill computed", "computed / prompt %",
                    "evictions", "preemptions", "steps"],
            title=f"{C2} conversations x {T2} turns, {RUN} at a time (tokens identical in every run)")

# %%
fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 3.8), dpi=100)
for s in ("hash", "radix"):
    rs = [r for r in sweep if r["prefix caching"] == s]
    a1.plot([r["pool blocks"] for r in rs], [r["hit rate %"] for r in rs], "o-", label=s)
    a2.plot([r["pool blocks"] for r in rs], [r["computed / prompt %"] for r in rs], "o-", label=s)
    a3.plot([r["pool blocks"] for r in rs], [r["evictions"] for r in rs], "o-", label=s)
a1.set(xscale="log", xlabel="pool size (blocks)", ylabel="hit rate %", title="hit rate (engine.stats)")
a2.set(xscale="log", xlabel="pool size (blocks)", ylabel="% of prompt tokens", title="prefill tokens computed")
a3.set(xscale="log", xlabel="pool size (blocks)", ylabel="blocks evicted", title="LRU evictions")
for a in (a1, a2, a3):
    a.legend()
    a.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# What to take away:
#
# * Prefix caching is bookkeeping over chapter 05's blocks: a hit is a block table that starts with
#   someone else's blocks (reference count + 1), and the tokens stay exactly the same.
# * On a shared system prompt it removes nearly all of the prefill work, which is what the queued
#   requests were waiting on: TTFT falls with it. The first step's batch-mates are the exception:
#   a block is found only once its K/V are computed.
# * In a chat, each turn re-sends the whole history; with the cache a turn costs its new message.
# * Hash chain and radix tree find the same blocks. They could differ in what they evict — the hash
#   cache any least-recently-used block, the radix tree only leaves, so it never keeps a block whose
#   prefix is gone — but the BlockManager releases a sequence's blocks tail first, so the hash
#   cache's LRU order also eats a chain from its end. Compare their rows in section 5.
# * A shrinking pool costs hits only once it can no longer hold the histories of the conversations
#   waiting for their next turn; below that, every eviction is prefill work done again.
