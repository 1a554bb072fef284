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
# # 15 · When the KV cache does not fit: evict
#
# A sequence's KV cache grows by the same number of bytes with every token, and the pool is fixed. This
# notebook prices a token's KV, then runs the engine's eviction policies on the embedded SmolLM2
# (`LLM(kv_eviction=...)`): StreamingLLM's sinks and recent window (with both position rules), a window
# with no sinks, H2O's heavy hitters and SnapKV's observation window. It draws which cached blocks each
# policy keeps, step by step, and measures, with `minillm bench kv`, what each costs in quality (greedy
# agreement with the full cache, the full-cache model's NLL of the policy's text, passkey retrieval) and
# what it saves in memory, against the full-cache engine in the same process.

# %%
import os
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    torch.set_num_threads(1)  # a CPU run uses tiny shapes, where more threads only wait on each other

import matplotlib.pyplot as plt

from minillm import notebook as nb
from minillm.bench import kv
from minillm.bench.serving_setup import load_models
from minillm.bench.table import print_table
from minillm.cache import bytes_per_token, kv_cache_spec
from minillm.config import ModelConfig, preset
from minillm.engine import EngineConfig, LLMEngine

nb.header("15")
dev = nb.device()
T0 = time.perf_counter()

# %% [markdown]
# ## 1. The arithmetic: bytes of KV per token
#
# Every layer stores one key and one value vector per KV head for every token:
# `2 x layers x kv_heads x head_dim x bytes`. The engine reads the same figure from the model's layers
# (`cache/spec.py`); the assert checks the formula against it.

# %%
models = load_models(None, dev)
c = models.config
elt = torch.finfo(models.dtype).bits // 8
formula = 2 * c.num_layers * c.num_kv_heads * c.head_dim * elt
assert formula == bytes_per_token(kv_cache_spec(models.model)) == models.kv_bytes_per_token()
rows = [{"model": models.label, "dtype": models.dtype_name, "KiB/token": formula / 1024,
         "MiB at 8k": formula * 8192 / 2**20, "GiB at 32k x 16 seqs": formula * 32768 * 16 / 2**30}]
for name in ("llama-3-8b", "qwen3-0.6b"):
    p = preset(name)
    b = 2 * p.num_layers * p.num_kv_heads * p.head_dim * 2  # bf16
    rows.append({"model": name, "dtype": "bfloat16", "KiB/token": b / 1024, "MiB at 8k": b * 8192 / 2**20,
                 "GiB at 32k x 16 seqs": b * 32768 * 16 / 2**30})
print_table(rows, title="KV cache per token")

# %% [markdown]
# ## 2. The oracle first: a budget that holds everything evicts nothing
#
# With `kv_budget` at least the sequence's length, every policy keeps every block, so its greedy tokens
# must be the full cache's exactly. (The tests go further: each policy equals plain attention over
# exactly the tokens it keeps, `tests/test_kv_eviction.py`, `tests/test_h2o.py`.)

# %%
text, source = kv.long_text()
ids = models.tokenizer.encode(text)[:64]


def greedy(**policy):
    eng = LLMEngine(models.model, models.tokenizer, [], EngineConfig(block_size=16, num_gpu_blocks=64, **policy),
                    progress=False)
    return kv.generate(eng, [ids], 6)["tokens"][0]


want = greedy(kv_eviction="none")
for policy in ("streaming", "h2o", "snapkv"):
    assert greedy(kv_eviction=policy, kv_budget=128) == want, policy
print(f"budget 128 >= 70 tokens: streaming, h2o, snapkv = the full cache's {len(want)} tokens ({source})")

# %% [markdown]
# ## 3. The benchmark: `minillm bench kv`
#
# One call, the same as `minillm bench kv --json out.json`: on a GPU a 2,048-token Wikipedia prompt (the
# corpus file when `MINILLM_CORPUS` points at it), budgets of 256 and 512 tokens, 128 new tokens, batch 1
# and 16, 8 passkeys; on a CPU a tiny random model at tiny sizes, which only shows the code runs (its
# "quality" is a random model's). Every engine is built once and
# warmed; the speed repeats rotate their order.

# %%
if nb.on_gpu():  # the embedded SmolLM2, the full sizes
    res = kv.run(None, quick=False, repeats=3, json_path=os.environ.get("MINILLM_BENCH_JSON"))
else:  # a CPU only shows the code runs: a tiny random Llama over SmolLM2's real vocabulary, tiny sizes
    tok = models.tokenizer
    tiny = ModelConfig(architecture="llama", vocab_size=len(tok.vocab), hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512,
                       tie_word_embeddings=True, name="tiny-llama (random)", eos_token_ids=[tok.eos_token_id])
    res = kv.run(tiny, tokenizer=tok, quick=True, repeats=3, budgets=[32], prompt_len=96, max_tokens=8,
                 batch_sizes=[1, 2], passkey_trials=1, json_path=os.environ.get("MINILLM_BENCH_JSON"))

# %% [markdown]
# ## 4. What each policy keeps
#
# Each panel is one policy at one budget, for the batch-1 run above: a row per engine step (the prompt's
# step first, then one per new token), a column per block-table entry; dark = the entry holds a block,
# light = evicted (it points at block 0 and the kernels never read it). StreamingLLM keeps the first
# block and a window that slides; the window without sinks loses the first block too; H2O keeps the
# blocks that drew the most attention, wherever they are; SnapKV chooses once, after the prompt, and
# then keeps every new token.

# %%
maps = {k: v for k, v in res["kept_maps"].items() if not k.startswith("full")}
fig, axes = plt.subplots(1, len(maps), figsize=(3.2 * len(maps), 3.6), sharey=True)
for ax, (name, m) in zip(np.atleast_1d(axes), maps.items()):
    width = max(len(r) for r in m)
    grid = np.array([r + [0] * (width - len(r)) for r in m])  # [steps, table entries]
    ax.imshow(grid, aspect="auto", cmap="Greys", vmin=0, vmax=1.3, interpolation="nearest")
    ax.set(title=name, xlabel="block-table entry")
np.atleast_1d(axes)[0].set_ylabel("engine step")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Memory and quality against the full cache
#
# `held_blocks`: blocks the sequence holds after its last step (`peak_blocks`: at its peak, the prompt's
# one-step prefill, before any eviction). `agree_frac` / `first_divergence`: its greedy tokens against
# the full cache's. `nll_own`: the full-cache model's mean NLL of the policy's own continuation
# (teacher-forced over the whole prompt), beside `nll_full`, the full cache's of its own. `passkey`:
# the fraction of hidden keys the policy's engine gave back.

# %%
q = [r for r in res["quality"] if "skipped" not in r]
print_table(q, ["policy", "budget", "peak_blocks", "held_blocks", "kv_mib", "mem_vs_full", "agree_frac",
                "first_divergence", "nll_own", "nll_full", "passkey"], title=f"memory and quality ({res['text']})")
full = next(r for r in q if r["policy"] == "full")
assert full["agree_frac"] == 1.0 and all(r["held_blocks"] < full["held_blocks"] for r in q if r is not full)

fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
labels = [f"{r['policy']}@{r['budget']}" for r in q]
axes[0].bar(labels, [r["kv_mib"] for r in q], color=["C3" if r is full else "C0" for r in q])
axes[0].set(ylabel="KV MiB per sequence (after the last step)", title="memory")
axes[1].bar(labels, [r["agree_frac"] for r in q], label="greedy agreement")
axes[1].plot(labels, [r["passkey"] for r in q], "o", color="C1", label="passkey found")
axes[1].set(ylim=(0, 1.05), title="quality vs the full cache")
axes[1].legend(fontsize=8)
for ax in axes:
    ax.tick_params(axis="x", rotation=60)
    ax.grid(True, axis="y", alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 6. Speed
#
# Decode tok/s while every request of the batch decodes, median of 3 repeats, and the ratio to the full
# cache per repeat. On a CPU these say nothing about a GPU: the numbers that matter come from the GPU
# run (chapter 15's text).

# %%
print_table([{k: v for k, v in s.items() if k != "spread"} | {"min": s["spread"]["min"], "max": s["spread"]["max"]}
             for s in res["speed"]], title="decode tok/s (median of repeats)")
print(f"notebook: {time.perf_counter() - T0:.0f} s")
