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
# # 16 · Multi-LoRA serving: many adapters, one base model, one batch
#
# A LoRA adapter is a fine-tune that changes a model by a low-rank update to some of its linear layers,
# $W' = W + \frac{\alpha}{r} B A$, with $A \in \mathbb{R}^{r \times d_{in}}$ and $B \in \mathbb{R}^{d_{out} \times r}$,
# $r \ll d$. Serving one adapter, you merge it into $W$ and serve a plain model. Serving a hundred, you
# cannot keep a hundred merged copies, and a batch mixes requests for different adapters. This notebook
# trains a small adapter on the embedded SmolLM2 with PEFT (it learns to answer in upper case), serves it
# next to random adapters and the base model **in one batch** through minillm's `LLM(enable_lora=True)`,
# checks every request against PEFT, draws what Punica's BGMV kernel does with each token, and runs
# `minillm bench lora`: throughput against the number of distinct adapters in the batch.

# %%
import os
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

if not torch.cuda.is_available():
    torch.set_num_threads(1)  # a CPU run uses tiny shapes, where more threads only wait on each other

import peft

from minillm import LLM, LoRARequest, SamplingParams
from minillm import notebook as nb
from minillm.bench import lora as bench_lora
from minillm.bench.hf_peer import load_hf
from minillm.bench.table import print_table
from minillm.kernels.lora_bgmv import add_lora, add_lora_ref
from minillm.model_files import embedded_model_path

nb.header("16")
dev = nb.device()
T0 = time.perf_counter()
GGUF = embedded_model_path()
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minillm" / "lora"

# %% [markdown]
# ## 1. The update, and what merging costs
#
# PEFT's layer computes $y = xW^T + s\,(xA^T)B^T$ with $s = \alpha / r$ (rsLoRA: $\alpha/\sqrt r$, which
# keeps the update's size steady as $r$ grows). The two forms below, merged and unmerged, are the same
# numbers; what differs is the cost. Merging costs nothing per token but one full copy of $W$ per adapter;
# unmerged, an adapter costs $r(d_{in} + d_{out})$ parameters per layer and two skinny products per token.

# %%
g = torch.Generator().manual_seed(16)
d_in, d_out, r, alpha = 576, 1536, 16, 32
W = torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in**0.5
A = torch.randn(r, d_in, generator=g, dtype=torch.float64) / d_in**0.5
B = torch.randn(d_out, r, generator=g, dtype=torch.float64) * 0.02
x = torch.randn(5, d_in, generator=g, dtype=torch.float64)
s = alpha / r
merged = x @ (W + s * B @ A).T  # [5, d_out]: one GEMM with W' = W + s B A
unmerged = x @ W.T + s * (x @ A.T) @ B.T  # [5, d_out]: the base GEMM plus shrink [5, r] and expand
assert torch.allclose(merged, unmerged)
layers, per_layer = 30, {"q": (576, 576), "k": (576, 192), "v": (576, 192), "o": (576, 576),
                         "gate": (576, 1536), "up": (576, 1536), "down": (1536, 576)}
adapter = layers * sum(r * (i + o) for i, o in per_layer.values())
full = layers * sum(i * o for i, o in per_layer.values())
print(f"SmolLM2, rank {r} on all seven projections: an adapter is {adapter / 1e6:.2f} M parameters, "
      f"{100 * adapter / full:.1f} % of the {full / 1e6:.1f} M it updates; 100 merged copies: "
      f"{100 * full * 2 / 2**30:.1f} GiB in bf16, 100 adapters: {100 * adapter * 2 / 2**30:.2f} GiB")

# %% [markdown]
# ## 2. Train an adapter with PEFT: answer in upper case
#
# The task's effect must be visible at a glance: the base model's own answers to a set of questions,
# upper-cased, are the targets (so the adapter learns a style, not facts). PEFT wraps the HF model (read
# from the same GGUF file minillm runs) with rank-16 adapters on all seven projections; the loss is on
# the answer tokens only. A GPU trains a few hundred steps; a CPU three on four questions (it only
# shows the loop runs, and the loss falls: four questions, the whole set every step).

# %%
TOPICS = ["the sun", "rain", "a cat", "the ocean", "bread", "music", "a bicycle", "winter", "trees", "the moon",
          "coffee", "a library", "mountains", "a river", "birds", "chess", "a volcano", "snow", "the wind", "honey",
          "a train", "glass", "a garden", "clouds", "fire", "a bridge", "paper", "the desert", "a clock", "bees",
          "an apple", "the stars", "a forest", "salt", "a ship", "thunder", "a candle", "wool", "a lake", "gold"]
FORMS = ["Tell me one fact about {}.", "Describe {} in one sentence.", "Why is {} interesting?"]
questions = [f.format(t) for t in TOPICS for f in FORMS]
rng = np.random.default_rng(16)
rng.shuffle(questions)
held_out, train_q = questions[:4], questions[4 : nb.pick(8, len(questions))]
ANSWER_TOKENS, STEPS, BATCH, LR = nb.pick(8, 40), nb.pick(3, 300), nb.pick(4, 16), nb.pick(3e-3, 1e-3)

llm_base = LLM(str(GGUF), device=str(dev), **({"gpu_memory_utilization": 0.2} if nb.on_gpu() else {}))
tok = llm_base.tokenizer
greedy = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0)
answers = [o.outputs[0].text for o in llm_base.chat([[{"role": "user", "content": q}] for q in train_q], greedy,
                                                    use_tqdm=False)]
llm_base.shutdown()
del llm_base


def example(q: str, a: str) -> tuple[list[int], list[int]]:
    prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
    target = tok.encode(a.upper(), add_special_tokens=False) + tok.encode("<|im_end|>", add_special_tokens=False)
    return prompt + target, [-100] * len(prompt) + target  # labels: the answer only


data = [example(q, a) for q, a in zip(train_q, answers)]
print(f"{len(data)} examples, e.g. {train_q[0]!r} -> {answers[0].upper()!r}")

# %%
torch.manual_seed(16)
hf = load_hf(GGUF, torch.float32, dev)  # fp32 weights: the oracle's precision, and stable training
model = peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]), adapter_name="upper")
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
losses, t_train = [], time.perf_counter()
model.train()
for _step in range(STEPS):
    batch = [data[i] for i in rng.choice(len(data), size=BATCH, replace=len(data) < BATCH)]
    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in batch], device=dev)  # [B, width], padded right
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch], device=dev)
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch], device=dev)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
model.eval()
model.save_pretrained(str(CACHE / "upper"), selected_adapters=["upper"])
UPPER = CACHE / "upper" / "upper"  # PEFT writes an adapter not named "default" into its own subfolder
first, last = np.mean(losses[: STEPS // 10 or 1]), np.mean(losses[-(STEPS // 10 or 1) :])  # the first and last tenth
print(f"{STEPS} steps in {time.perf_counter() - t_train:.1f} s; loss {first:.3f} -> {last:.3f}; "
      f"saved in PEFT's format: {sorted(p.name for p in UPPER.iterdir())}")
assert last < first

# %%
plt.figure(figsize=(6, 3))
plt.plot(losses)
plt.gca().set(xlabel="step", ylabel="loss (answer tokens)", title="training the 'upper' adapter with PEFT")
plt.grid(True, alpha=0.3)
plt.show()

# %% [markdown]
# ## 3. Serve it beside random adapters and the base model, in ONE batch
#
# Two random adapters (PEFT's own format, random $A$ and $B$) join the trained one. `LLM(enable_lora=True,
# max_loras=4)` gives every wrapped layer four adapter slots; each prompt names its adapter with a
# `LoRARequest(name, int_id, path)` (or none). The six requests below run in the same steps; every one
# must equal PEFT with that adapter alone (fp32 on a CPU: token for token; bf16 on a GPU: the table
# counts the tokens that agree before the first difference, as bf16 rounding differs from PEFT's fp32).

# %%
tmp = Path(tempfile.mkdtemp(prefix="minillm-ch16-"))
model, folders = bench_lora.make_peft_adapters(model, tmp, 2, rank=8, seed=1)
requests = {"upper": LoRARequest("upper", 1, str(UPPER)),
            "a0": LoRARequest("a0", 2, str(folders[0])), "a1": LoRARequest("a1", 3, str(folders[1]))}
llm = LLM(str(GGUF), device=str(dev), enable_lora=True, max_loras=4, max_lora_rank=16,
          **({"gpu_memory_utilization": 0.3} if nb.on_gpu() else {}))
convs = [[{"role": "user", "content": q}] for q in held_out]
names = [None, "upper", "a0", None, "upper", "a1"]
batch = [convs[i % len(convs)] for i in range(len(names))]
outs = llm.chat(batch, SamplingParams(max_tokens=ANSWER_TOKENS + 8, temperature=0.0), use_tqdm=False,
                lora_request=[requests[n] if n else None for n in names])
for n, c, o in zip(names, batch, outs):
    print(f"{n or 'base':6s} | {c[0]['content']:38s} | {o.outputs[0].text!r}")

# %%
def upper_share(text: str) -> float:
    letters = [ch for ch in text if ch.isalpha()]
    return sum(ch.isupper() for ch in letters) / max(1, len(letters))


share = {n: np.mean([upper_share(o.outputs[0].text) for m, o in zip(names, outs) if m == n]) for n in (None, "upper")}
print(f"upper-case share of letters: base {share[None]:.2f}, 'upper' adapter {share['upper']:.2f}")
if nb.on_gpu():  # a few hundred steps: the style is learned (a CPU's three steps need not get there)
    assert share["upper"] > 0.8 > 0.3 > share[None], share

# the oracle: each request alone through PEFT, against ours all in one batch
prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in convs]
check = bench_lora.check_rows(llm, model, list(requests.values()), prompts, max_tokens=8)
print_table([{k: v for k, v in r.items() if k not in ("ours", "peft")} for r in check],
            title="greedy tokens: ours (one mixed batch) vs PEFT (alone)")
if not nb.on_gpu():
    assert all(r["equal"] for r in check), check

# %% [markdown]
# ## 4. What BGMV does with a batch
#
# Every wrapped layer holds its slots stacked: $A$ `[max_loras, R, in]`, $B$ `[max_loras, out, R]`. The
# step's forward context carries `lora_mapping`, one slot per token (−1: no adapter). Punica's **shrink**
# gathers each token's $A$ and computes $s_t = x_t A_{slot_t}^T$ (`[T, R]`, fp32); **expand** gathers its $B$
# and adds $s_t B_{slot_t}^T$ into the base GEMM's output. Each program of the kernel is one token, so a
# batch of any mix of adapters is two launches per layer, and the slot buffer is a device tensor a CUDA
# graph reads at replay. Below: a decode batch of 8 tokens over 3 slots, and the kernel checked against a
# per-token loop on fresh random inputs.

# %%
T, L, R, K, N = 8, 3, 4, 64, 96
slots = torch.tensor([1, -1, 0, 2, 1, 1, -1, 0], dtype=torch.int32)
xs = torch.randn(T, K, generator=g)
a_stack, b_stack = torch.randn(L, R, K, generator=g) * 0.1, torch.randn(L, N, R, generator=g) * 0.1
y0 = torch.randn(T, N, generator=g)
loop = y0.clone()
for t in range(T):  # the definition: token t uses its own slot's A and B
    if slots[t] >= 0:
        loop[t] += (xs[t] @ a_stack[slots[t]].T) @ b_stack[slots[t]].T
y_kernel, y_ref = y0.clone().to(dev), y0.clone().to(dev)
add_lora(y_kernel, xs.to(dev), a_stack.to(dev), b_stack.to(dev), slots.to(dev))  # Triton (interpreted on a CPU)
add_lora_ref(y_ref, xs.to(dev), a_stack.to(dev), b_stack.to(dev), slots.to(dev))  # one GEMM per slot
torch.testing.assert_close(y_kernel.cpu(), loop, rtol=1e-4, atol=1e-4)
torch.testing.assert_close(y_ref.cpu(), loop, rtol=1e-4, atol=1e-4)

fig, ax = plt.subplots(figsize=(9, 3.6))
colors = {-1: "0.85", 0: "C0", 1: "C1", 2: "C2"}
for t, sl in enumerate(slots.tolist()):
    ax.add_patch(plt.Rectangle((0, T - 1 - t), 1.6, 0.8, color=colors[sl]))
    ax.text(0.8, T - 0.6 - t, f"token {t}", ha="center", va="center", fontsize=8)
    if sl >= 0:
        ax.annotate("", xy=(4, 1.2 + 2.4 * (L - 1 - sl) + 0.9), xytext=(1.6, T - 0.6 - t),
                    arrowprops=dict(arrowstyle="->", color=colors[sl], lw=1))
for sl in range(L):
    ax.add_patch(plt.Rectangle((4, 1.2 + 2.4 * (L - 1 - sl)), 2.2, 1.8, color=colors[sl], alpha=0.7))
    ax.text(5.1, 2.1 + 2.4 * (L - 1 - sl), f"slot {sl}\nA [R, in], B [out, R]", ha="center", va="center", fontsize=8)
ax.text(0.8, T + 0.2, "lora_mapping", ha="center", fontsize=9)
ax.text(5.1, T + 0.2, "GPU slots (max_loras = 3)", ha="center", fontsize=9)
ax.text(8.5, T / 2, "shrink  s = x · A[slot]ᵀ   [T, R]\nexpand  y += s · B[slot]ᵀ\n\ngrey: slot −1, no adapter:\n"
        "the row is left as the\nbase GEMM wrote it", va="center", fontsize=9)
ax.set(xlim=(-0.2, 12.5), ylim=(-0.4, T + 0.8))
ax.axis("off")
ax.set_title("BGMV: each token gathers its own adapter's A and B")
plt.show()

# %% [markdown]
# ## 5. `minillm bench lora`: throughput against the number of distinct adapters
#
# On a GPU the embedded SmolLM2 in bf16: batch 1 and 64, 128-token prompts, 32 new tokens, 0/1/4/16
# distinct random rank-16 adapters in the batch (request $i$ runs adapter $i \bmod n$; 0: LoRA on, no
# adapter) against the base model without LoRA, and HF + PEFT serving the same requests one adapter at a
# time (and, for one adapter, PEFT's merged weights). On a CPU a tiny random Llama, tiny sizes: the
# numbers only show the code runs. Three alternating repeats, medians with min-max.

# %%
del model, hf
llm.shutdown()
del llm
if nb.on_gpu():
    res = bench_lora.run(None, num_adapters=[0, 1, 4, 16], batch_sizes=[1, 64], prompt_len=128, max_tokens=32,
                         repeats=3, json_path=os.environ.get("MINILLM_BENCH_JSON"))
else:
    import transformers

    tiny = tmp / "tiny"  # 2 layers, hidden 64, random weights, SmolLM2's tokenizer (its files from the GGUF)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tiny)
    transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name).save_pretrained(tiny)
    res = bench_lora.run(str(tiny), num_adapters=[0, 1, 4], batch_sizes=[1, 4], rank=8, prompt_len=8, max_tokens=6,
                         repeats=3, device="cpu", json_path=os.environ.get("MINILLM_BENCH_JSON"))
assert res["summary"]["all_equal"] or nb.on_gpu()

# %%
rows = res["rows"]
Bmax = max(res["batch_sizes"])
big = [r for r in rows if r["batch"] == Bmax and r["lora"]]
base_row = next(r for r in rows if r["batch"] == Bmax and not r["lora"])
n = [r["distinct_adapters"] for r in big]
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for ax, key, label in ((axes[0], "decode_tok_s", "decode"), (axes[1], "prefill_tok_s", "prefill")):
    med = [r[key]["median"] for r in big]
    err = [[m - r[key]["min"] for m, r in zip(med, big)], [r[key]["max"] - m for m, r in zip(med, big)]]
    ax.errorbar(range(len(n)), med, yerr=err, marker="o", capsize=4, label="minillm, LoRA on")
    ax.axhline(base_row[key]["median"], color="k", ls="--", label="minillm, base model (no LoRA)")
    if key == "decode_tok_s" and "peft_output_tok_s" in big[0]:
        ax.plot(range(len(n)), [r["peft_output_tok_s"]["median"] for r in big], marker="s",
                label="HF + PEFT, one adapter at a time (output tok/s)")
    ax.set_xticks(range(len(n)), [str(v) for v in n])
    ax.set(xlabel=f"distinct adapters in a batch of {Bmax}", ylabel=f"{label} tok/s (median, min-max)",
           title=f"{label}, batch {Bmax}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
print_table([{"batch": r["batch"], "config": r["config"], "decode tok/s": r["decode_tok_s"]["median"],
              "vs base": r["decode_vs_base"], "prefill tok/s": r["prefill_tok_s"]["median"],
              "prefill vs base": r["prefill_vs_base"],
              "ours / PEFT": r.get("ours_vs_peft", {}).get("median", float("nan")),
              "ours / PEFT merged": r.get("ours_vs_peft_merged", {}).get("median", float("nan"))} for r in rows],
            title="median of 3 repeats")
print(f"notebook: {time.perf_counter() - T0:.0f} s")
