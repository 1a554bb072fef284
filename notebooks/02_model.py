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
# # 02 · The model
#
# The whole path from token ids to the next token: minillm's Llama-family model
# (`minillm/models/llama.py`, built from `minillm/layers/`), loaded from the embedded GGUF file, held
# to Hugging Face `transformers` logit for logit, timed on the GPU, and followed by the sampler
# that turns logits into a choice.

# %%
import time

import matplotlib.pyplot as plt
import torch

import minillm
from minillm import hw
from minillm import notebook as nb
from minillm.layers.backend import set_kernel_mode

nb.header("02")
dev = nb.device()
# This chapter's model is the plain-PyTorch one; chapter 04 swaps Triton kernels in behind the same
# layers. Pin the PyTorch path so these numbers stay chapter 02's.
set_kernel_mode("torch")

# %% [markdown]
# ## 1. Loading: a GGUF file becomes a PyTorch model
#
# The header gives the config; the 272 tensors are Q4_1 (most weights: 5 bits per weight), Q8_0 (the
# embedding) and F32 (the norms). The loader dequantizes each one on the target device and renames
# it to Hugging Face's naming; llama.cpp's row order for q and k is undone on the way.

# %%
start = time.perf_counter()
llm = minillm.LLM(device=dev, dtype="float32")
print(f"loaded in {time.perf_counter() - start:.1f} s on {llm.device}")
cfg = llm.config

# %%
# NBVAL_CHECK_OUTPUT
for key in ["architecture", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
            "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings"]:
    print(f"{key:>24}: {getattr(cfg, key)}")
print(f"{'parameters':>24}: {cfg.num_params:,}")

# %% [markdown]
# ## 2. A token's path through the forward pass
#
# Hooks on the first decoder layer record the shape of every intermediate tensor for the 5-token
# prompt "The capital of France is". The engine never pads: a batch is a flat stream of $T$ tokens.

# %%
# NBVAL_CHECK_OUTPUT
from minillm.layers import AttentionMetadata

model, tok = llm.model, llm.tokenizer
ids = tok.encode("The capital of France is")
shapes = []
layer0 = model.model.layers[0]
watch = {"embed_tokens": model.model.embed_tokens, "input_layernorm": layer0.input_layernorm,
         "qkv_proj": layer0.self_attn.qkv_proj, "attn (GQA)": layer0.self_attn.attn,
         "o_proj": layer0.self_attn.o_proj, "post_attention_layernorm": layer0.post_attention_layernorm,
         "gate_up_proj": layer0.mlp.gate_up_proj, "silu(gate) * up": layer0.mlp.act_fn,
         "down_proj": layer0.mlp.down_proj, "final norm": model.model.norm}
hooks = [m.register_forward_hook(lambda m, i, o, n=n: shapes.append((n, tuple((o[0] if isinstance(o, tuple) else o).shape))))
         for n, m in watch.items()]
with torch.inference_mode():
    hidden = model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev), AttentionMetadata.from_seq_lens([len(ids)], dev))
    logits = model.compute_logits(hidden[-1:])
for h in hooks:
    h.remove()
seen = set()
for name, shape in shapes:
    if name not in seen:
        seen.add(name)
        print(f"{name:>26}  {shape}")
print(f"{'lm_head (last token only)':>26}  {tuple(logits.shape)}")
T = len(ids)
print(f"qkv_proj splits into q [{T}, {cfg.num_heads}, {cfg.head_dim}], k and v [{T}, {cfg.num_kv_heads}, {cfg.head_dim}]: "
      f"each KV head serves {cfg.num_heads // cfg.num_kv_heads} query heads")

# %%
top = torch.softmax(logits[0], -1).topk(5)
print("next token:", [(tok.decode([i]), round(p, 3)) for i, p in zip(top.indices.tolist(), top.values.tolist())])

# %% [markdown]
# ## 3. The oracle: Hugging Face transformers, from the same file
#
# transformers dequantizes the same GGUF into its own `LlamaForCausalLM`. In fp32 the two must agree
# to rounding on every logit, and greedy decoding must pick the same tokens.

# %%
import transformers

from minillm.model_files import embedded_model_path

transformers.logging.set_verbosity_error()
path = embedded_model_path()
hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                       dtype=torch.float32).to(dev).eval()
chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
with torch.inference_mode():
    ours = model.compute_logits(model(torch.tensor(chat, device=dev), torch.arange(len(chat), device=dev),
                                      AttentionMetadata.from_seq_lens([len(chat)], dev)))
    theirs = hf(torch.tensor([chat], device=dev)).logits[0].float()
diff = (ours - theirs).abs().max().item()
print(f"{len(chat)} positions x {cfg.vocab_size} logits: max |minillm - HF| = {diff:.2e}")
assert diff < 1e-3

steps = nb.pick(cpu=16, gpu=64)
greedy = minillm.SamplingParams(temperature=0, max_tokens=steps, min_tokens=steps)
ours_ids = llm.generate({"prompt_token_ids": chat}, greedy)[0].outputs[0].token_ids
with torch.inference_mode():
    hf_ids = hf.generate(torch.tensor([chat], device=dev), do_sample=False, max_new_tokens=steps,
                         min_new_tokens=steps, pad_token_id=2)[0, len(chat):].tolist()
assert ours_ids == hf_ids
print(f"greedy: {steps} tokens, identical to HF: {ours_ids == hf_ids}")
print(repr(tok.decode(ours_ids)))

# %% [markdown]
# ## 4. One forward pass, more and more tokens: the two regimes
#
# Chapter 00 showed a single layer's GEMV→GEMM curve; here is the whole model in bf16. A forward pass
# over $T$ tokens must read all weights once (memory floor) and do about $2 \times \text{params}
# \times T$ FLOPs (compute floor). Decode steps look like small $T$, prefill like large $T$.

# %%
ceil = hw.ceilings(dev)
bf16 = minillm.LLM(device=dev, dtype=nb.pick(cpu="float32", gpu="bfloat16"), enable_kv_cache=False)
m16 = bf16.model
Ts = nb.pick(cpu=[1, 4, 16, 64, 128], gpu=[1, 4, 16, 64, 256, 1024, 2048, 4096, 8192])
weight_bytes = sum(p.numel() * p.element_size() for p in m16.parameters())
rows = []
for T in Ts:
    x = torch.randint(0, cfg.vocab_size, (T,), device=dev)
    pos = torch.arange(T, device=dev)
    meta = AttentionMetadata.from_seq_lens([T], dev)
    with torch.inference_mode():
        s = hw.time_it(lambda x=x, pos=pos, meta=meta: m16.compute_logits(m16(x, pos, meta)[-1:]), device=dev,
                       reps=nb.pick(cpu=3, gpu=10), warmup=2)
    flops = 2 * cfg.num_params * T + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * T * T / 2  # + causal attention
    floor = ceil.floor_seconds(flops, weight_bytes)
    rows.append({"tokens": T, "ms": s * 1e3, "us_per_token": s * 1e6 / T, "floor_ms": floor * 1e3,
                 "pct_of_floor": 100 * floor / s})
from minillm.bench.table import print_table

print_table(rows, title=f"forward pass of {cfg.name} ({str(m16.lm_head.weight.dtype)[6:]}) on {ceil.device}; "
                        f"weights {weight_bytes / 1e6:.0f} MB")

# %%
fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
nb.plot_lines(Ts, {"measured": [r["ms"] for r in rows], "roofline floor": [r["floor_ms"] for r in rows]},
              xlabel="tokens in the forward pass (T)", ylabel="ms", title="time per forward pass",
              logx=True, logy=True, ax=a1)
nb.plot_lines(Ts, {"measured": [r["us_per_token"] for r in rows]}, xlabel="tokens in the forward pass (T)",
              ylabel="µs per token", title="time per token: falling, then rising (attention)",
              logx=True, logy=True, ax=a2)
plt.tight_layout()
plt.show()

# %% [markdown]
# At small $T$ the pass is far above its floor: 30 layers × a dozen kernels each, launched one by
# one from Python, cost more than reading 270 MB of weights. Chapters 04 (fused kernels) and 07
# (CUDA graphs) attack exactly that. At large $T$ the matrix products fill the GPU and the time per
# token falls — until attention, whose cost grows with $T^2$, takes over.
#
# ## 5. Generation speed: minillm vs Hugging Face `generate`, same run
#
# Greedy decoding of the chat prompt, a fixed number of new tokens, bf16 on the GPU, median of three
# runs. minillm runs as this chapter built it, without a KV cache (`enable_kv_cache=False`): every
# step recomputes the whole sequence. HF is timed both ways: with its KV cache (its default) and
# without.

# %%
new = nb.pick(cpu=8, gpu=128)
params = minillm.SamplingParams(temperature=0, max_tokens=new, min_tokens=new)
hf16 = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=m16.lm_head.weight.dtype).to(dev).eval()


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, runs=3):
    """Median wall time of `runs` calls after a warm-up, and the last call's result."""
    fn()  # warm-up
    times = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def hf_generate(use_cache):
    with torch.inference_mode():
        return hf16.generate(torch.tensor([chat], device=dev), do_sample=False, max_new_tokens=new,
                             min_new_tokens=new, pad_token_id=2, use_cache=use_cache)[0, len(chat):].tolist()


t_ours, out = timed(lambda: bf16.generate({"prompt_token_ids": chat}, params, use_tqdm=False)[0].outputs[0].token_ids)
t_hf, hf_out = timed(lambda: hf_generate(True))
t_hf_nc, _ = timed(lambda: hf_generate(False))
speed = {"minillm (no KV cache)": new / t_ours, "HF generate (no KV cache)": new / t_hf_nc,
         "HF generate (KV cache)": new / t_hf}
for k, v in speed.items():
    print(f"{k:>26}: {v:8.1f} tok/s")
print(f"minillm / HF without cache: {speed['minillm (no KV cache)'] / speed['HF generate (no KV cache)']:.2f}x;  "
      f"minillm / HF with its cache: {speed['minillm (no KV cache)'] / speed['HF generate (KV cache)']:.2f}x")
print(f"same tokens as HF in {str(m16.lm_head.weight.dtype)[6:]}: {sum(a == b for a, b in zip(out, hf_out))}/{new}")
nb.plot_bars(list(speed), list(speed.values()), ylabel="tokens / s", title=f"greedy, {new} new tokens, batch 1")
plt.xticks(fontsize=8)
plt.show()

# %% [markdown]
# ## 6. Choosing the token: temperature, top-k, top-p, min-p
#
# The sampler (`minillm/sampling/`) applies, per row of a batch: penalties, then temperature, then
# top-k, top-p and min-p filters, in the order HF's `generate` uses. Below, the model's distribution
# over the next token after "Once upon a time, there was a", and what each filter keeps.

# %%
from minillm.sampling import SamplingMetadata, SamplingParams, filtered_probs

story = tok.encode("Once upon a time, there was a")
with torch.inference_mode():
    row = model.compute_logits(model(torch.tensor(story, device=dev), torch.arange(len(story), device=dev),
                                     AttentionMetadata.from_seq_lens([len(story)], dev))[-1:]).cpu()


def distribution(**kw):
    p = SamplingParams(**kw)
    return filtered_probs(row, SamplingMetadata.build([p], [story], [[]], [0], [[]], row.shape[1], "cpu"))[0]


base = distribution(temperature=1.0)
order = base.argsort(descending=True)[:15]
labels = [repr(tok.decode([i]))[1:-1] for i in order.tolist()]
settings = {"temperature 1": dict(temperature=1.0), "temperature 0.5": dict(temperature=0.5),
            "top-k 5": dict(temperature=1.0, top_k=5), "top-p 0.5": dict(temperature=1.0, top_p=0.5),
            "min-p 0.2": dict(temperature=1.0, min_p=0.2)}
fig, axes = plt.subplots(1, len(settings), figsize=(17, 3.6), dpi=100, sharey=True)
for ax, (name, kw) in zip(axes, settings.items()):
    probs = distribution(**kw)
    ax.bar(range(15), probs[order].numpy(), color="C0")
    ax.set_xticks(range(15), labels, rotation=90, fontsize=7)
    ax.set_title(f"{name}: {int((probs > 0).sum())} tokens kept", fontsize=9)
axes[0].set_ylabel("probability")
plt.tight_layout()
plt.show()

# %% [markdown]
# The sampler draws with an exponential race (token $i$ wins with probability $p_i$) from random
# numbers that are a pure function of (seed, step, token), so a seeded request gets the same tokens
# whatever else shares its batch. Many draws at "top-p 0.5" against the exact distribution:

# %%
from minillm.sampling import Sampler

N, chunk = nb.pick(cpu=2_000, gpu=20_000), 500  # [chunk, vocab] at a time keeps memory small
p = SamplingParams(temperature=1.0, top_p=0.5)
drawn = []
for first in range(0, N, chunk):
    meta = SamplingMetadata.build([p] * chunk, [[]] * chunk, [[]] * chunk, [7] * chunk, [[]] * chunk,
                                  row.shape[1], "cpu")
    meta.steps = torch.arange(first, first + chunk)  # step t of one seeded sequence
    drawn.append(Sampler()(row.expand(chunk, -1).contiguous(), meta).token_ids)
drawn = torch.cat(drawn)
exact = distribution(temperature=1.0, top_p=0.5)
freq = torch.bincount(drawn, minlength=row.shape[1]).float() / N
kept = (exact > 0).nonzero().flatten()
print(f"{N:,} draws\ntoken      exact   sampled")
for i in kept[exact[kept].argsort(descending=True)].tolist():
    print(f"{tok.decode([i])!r:>10} {exact[i]:7.3f} {freq[i]:9.3f}")
assert freq[exact == 0].sum() == 0

# %% [markdown]
# Turn the knobs (in JupyterLab; the site shows the static plots above):

# %% tags=["widget"]
import ipywidgets as W


def playground(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    probs = distribution(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    plt.figure(figsize=(7, 3), dpi=100)
    plt.bar(range(15), probs[order].numpy())
    plt.xticks(range(15), labels, rotation=90, fontsize=7)
    plt.title(f"{int((probs > 0).sum())} tokens kept")
    plt.show()


nb.widget(playground, temperature=W.FloatSlider(value=1.0, min=0.05, max=2.0, step=0.05),
          top_k=W.IntSlider(value=0, min=0, max=50), top_p=W.FloatSlider(value=1.0, min=0.05, max=1.0, step=0.05),
          min_p=W.FloatSlider(value=0.0, min=0.0, max=0.5, step=0.01));
