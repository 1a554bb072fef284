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
# # 10 · MLA and MoE: a cache an order of magnitude smaller, experts that cost only what they route
#
# DeepSeek-V2 (2024) changed two parts of the Llama layer. **Multi-head latent attention** caches
# one latent vector per token and layer ($L + R = 512 + 64$ numbers) instead of a key and a value per
# head, and rebuilds the heads from it — or, *absorbed*, never rebuilds them (`minillm/layers/mla.py`,
# `minillm/kernels/mla_decode.py`). A **mixture of experts** replaces the MLP by many smaller ones of
# which each token runs a few (Shazeer et al., 2017; GShard; Switch; Mixtral), in one grouped GEMM
# launch for all of them (`minillm/layers/moe.py`, `minillm/kernels/fused_moe.py`). This notebook shows
# that minillm's DeepSeek and Mixtral give Hugging Face's tokens, what the latent cache saves, and how
# fast the two kernels are against their baselines and the hardware.

# %%
import gc
import os
import tempfile
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton's interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
import transformers

from minillm import SamplingParams, load_tokenizer
from minillm import notebook as nb
from minillm.bench import moe as moe_bench
from minillm.bench import serving
from minillm.bench.table import print_table
from minillm.cache import PagedKVCache, bytes_per_token, kv_cache_spec
from minillm.config import MLAConfig, preset
from minillm.engine import EngineConfig, LLMEngine
from minillm.hw import time_it
from minillm.layers import AttentionMetadata
from minillm.layers.mla import DeepseekRotaryEmbedding, MultiHeadLatentAttention
from minillm.loader import load_model

nb.header("10")
dev = nb.device()
T0 = time.perf_counter()
transformers.logging.set_verbosity_error()
TOKENIZER = load_tokenizer()  # only to detokenize: the tiny checkpoints' ids are < 320

# %% [markdown]
# ## 1. The oracle: tiny random DeepSeek-V3 and Mixtral checkpoints
#
# No MoE or MLA model small enough ships on PyPI, so transformers writes tiny random ones
# (`save_pretrained`), and minillm loads the files through its Hugging Face loader. DeepSeek-V3's
# router is the most involved: sigmoid scores, a learnt bias that steers the choice, only the best 2
# of 4 expert groups, weights renormalised and scaled by 2.5; its q has a low-rank bottleneck. The
# packed forward (no cache) runs MLA's naive path; generation through the engine runs the absorbed
# path over the paged latent cache, and on a GPU the Triton kernels inside CUDA graphs.

# %%
WORK = Path(tempfile.mkdtemp(prefix="minillm-nb10-"))
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=320, max_position_embeddings=256)
CHECKPOINTS = {
    "deepseek_v3": transformers.DeepseekV3Config(**TINY, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                                                 qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                                                 num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
                                                 first_k_dense_replace=1, n_group=4, topk_group=2),
    "mixtral": transformers.MixtralConfig(**TINY, num_local_experts=8, num_experts_per_tok=2),
}


def tiny_checkpoint(name, cfg):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # weights well above HF's 0.02 init: logits with clear winners
        for p in hf.parameters():
            p.normal_(0, 0.2).add_(1.0) if p.dim() == 1 else p.normal_(0, 0.2)
        for bname, b in hf.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    hf.save_pretrained(WORK / name)
    return hf.eval()


def engine_greedy(model, prompt, n):
    """Greedy tokens through LLMEngine: paged cache (MLA: the latent), chunked prefill, CUDA graphs on a GPU.
    min_tokens keeps the checkpoint's EOS out, as HF's min_new_tokens does."""
    config = EngineConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=8)  # chunked
    engine = LLMEngine(model, TOKENIZER, model.config.eos_token_ids, config)
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n, min_tokens=n))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids


g = torch.Generator().manual_seed(0)
rows = []
for name, cfg in CHECKPOINTS.items():
    hf = tiny_checkpoint(name, cfg)
    ids = torch.randint(0, 320, (40,), generator=g)
    model, config, _ = load_model(WORK / name, device=dev, tokenizer=False)
    with torch.inference_mode():
        theirs = hf(ids[None]).logits[0]
        ours = model.compute_logits(model(ids.to(dev), torch.arange(40, device=dev),
                                          AttentionMetadata.from_seq_lens([40], dev))).cpu()
        want = hf.generate(ids[None, :20], attention_mask=torch.ones(1, 20, dtype=torch.long), do_sample=False,
                           max_new_tokens=24, min_new_tokens=24, pad_token_id=0)[0, 20:].tolist()
    got = engine_greedy(model, ids[:20].tolist(), 24)
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-3 and got == want, (name, diff, got, want)
    rows.append({"checkpoint": name, "params_M": config.num_params / 1e6, "max_logit_diff": diff,
                 "greedy_24_equal": got == want})
    del model, hf
print_table(rows, title="minillm vs transformers, fp32 (naive MLA for the logits, absorbed through the engine)")

# %% [markdown]
# ## 2. What the latent cache saves
#
# Each layer states what it caches per token (`kv_cache_spec`, `minillm/cache/spec.py`), and the paged
# pool is allocated from those specs. Chapter 00's formula per layer is $2 \cdot H_{kv} \cdot d \cdot$
# bytes for K and V; an MLA layer caches one vector of $L + R$ numbers read as both. Below: the
# bytes per token from each model's spec (on the "meta" device: no weights allocated), and how many
# tokens a pool of the same size really holds, allocated here.

# %%
llama = preset("llama-3-8b")
lite = preset("deepseek-v2-lite")
v3 = lite.with_(name="deepseek-v3 (attention)", num_layers=61, sliding_windows=[], hidden_size=7168, num_heads=128,
                num_kv_heads=128, moe=None, mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                                          v_head_dim=128, q_lora_rank=1536))
MODELS = {"Llama-3-8B (GQA, 8 KV heads)": llama, "Llama-3-8B as MHA (32 KV heads)": llama.with_(num_kv_heads=32),
          "DeepSeek-V2-Lite (MLA)": lite, "DeepSeek-V3 (MLA)": v3}
BUDGET = nb.pick(64 << 20, 1 << 30)  # bytes of pool
rows = []
for label, cfg in MODELS.items():
    specs = kv_cache_spec(cfg, torch.bfloat16)
    per_token = bytes_per_token(specs)
    if cfg.mla is not None:  # the formula: one latent per layer, L + R numbers of 2 bytes
        formula = cfg.num_layers * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 2
        m = cfg.mla  # what naive MLA would cache: each head's K (nope + rope) and V
        naive = cfg.num_layers * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2
    else:
        formula = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        naive = None
    assert per_token == formula, (label, per_token, formula)
    blocks = BUDGET // PagedKVCache.block_bytes(specs, 16)
    pool = PagedKVCache(specs, blocks, 16, dev)
    rows.append({"model": label, "layers": cfg.num_layers, "KiB_per_token": per_token / 1024,
                 "naive_KV_KiB": naive / 1024 if naive else float("nan"),
                 "naive_over_latent": naive / per_token if naive else float("nan"),
                 "pool_MiB": pool.nbytes / 2**20, "tokens_in_pool": blocks * 16})
    del pool
print_table(rows, title=f"KV cache per token (bf16) and tokens in a {BUDGET >> 20} MiB pool, allocated on {dev}")

# %%
fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
ax.barh([r["model"] for r in rows], [r["KiB_per_token"] for r in rows], color=["C0", "C0", "C2", "C2"])
for i, r in enumerate(rows):
    ax.annotate(f"{r['KiB_per_token']:.0f} KiB", (r["KiB_per_token"], i), va="center")
ax.set(xlabel="KV cache per token, KiB (bf16, all layers)", title="MLA caches one latent per token and layer")
ax.grid(True, axis="x", alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. The two kernels against their baselines
#
# `minillm bench moe` (`minillm/bench/moe.py`), in this process:
#
# - **fused MoE** — one layer's routed experts for M tokens at DeepSeek-V2-Lite's (64 experts of
#   2048 → 1408, top-6) and Qwen3-30B-A3B's (128 of 2048 → 768, top-8) shapes, against the per-expert
#   loop (Hugging Face's and DeepSeek's reference code) and against a dense GEMM pair with the same
#   FLOPs, the rate a perfect grouped GEMM would reach. At small M the experts' weights dominate:
#   `weight_gbps` is the bytes of the experts actually hit over the time.
# - **routing skew** — the same work with a growing share of the tokens on the same experts.
# - **paged MLA decode** — GB/s of latent cache read, against the measured copy bandwidth, and the
#   naive path (up-project every cached latent to every head's K and V, then attention).
#
# Targets for an H100 (chapter 10's kernel issue), printed beside the measurements, not asserted:
# fused MoE ≥ 45 % of the dense rate at M ≥ 4096 (and, at M ≤ 16, faster than the per-expert loop);
# MLA decode ≥ 80 % of copy bandwidth for V2-Lite's 16 heads and ≥ 250 TFLOP/s for V3's 128 heads, at
# batch ≥ 32 and context ≥ 4k (FlashMLA reports 3,000 GB/s and 660 TFLOP/s on an H800). On a CPU the
# interpreter runs tiny shapes:
# the numbers only show that the code runs.

# %%
gc.collect()
bench = moe_bench.run()

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4), dpi=100)
for ax, model in zip(axes, dict.fromkeys(r["model"] for r in bench["moe"])):
    rs = [r for r in bench["moe"] if r["model"] == model]
    nb.plot_lines([r["M"] for r in rs], {k: [r[f"{k}_tflops"] for r in rs] for k in ("fused", "loop", "dense")},
                  xlabel="tokens M", ylabel="TFLOP/s", title=f"routed experts, {model}", logx=True, logy=True, ax=ax)
plt.tight_layout()
plt.show()

# %%
small = [r for r in bench["moe"] if r["M"] <= 16]
large = [r for r in bench["moe"] if r["M"] >= 4096]
wide = [r for r in bench["mla"] if r["batch"] >= 32 and r["context"] >= 4096]
few_heads = [r for r in wide if r["heads"] <= 16]  # V2-Lite: memory-bound, so % of copy
many_heads = [r for r in wide if r["heads"] >= 128]  # V3: compute-bound, so TFLOP/s
targets = [
    {"measure": "fused / loop speed, M <= 16 (min)", "value": min((r["speedup_vs_loop"] for r in small),
                                                                  default=float("nan")), "target": "> 1x"},
    {"measure": "fused, % of dense, M >= 4096 (min)", "value": min((r["pct_of_dense"] for r in large),
                                                                   default=float("nan")), "target": ">= 45 %"},
    {"measure": "MLA decode, 16 heads, % of copy, batch >= 32, ctx >= 4k (min)",
     "value": min((r["pct_of_copy"] for r in few_heads), default=float("nan")), "target": ">= 80 %"},
    {"measure": "MLA decode, 128 heads, TFLOP/s, batch >= 32, ctx >= 4k (min)",
     "value": min((r["mla_tflops"] for r in many_heads), default=float("nan")), "target": ">= 250"},
]
where = torch.cuda.get_device_name() if nb.on_gpu() else "a CPU run: the targets are for an H100"
print_table(targets, title=f"measured on {where}, beside the targets")

# %% [markdown]
# ## 4. Absorbed or naive? Prefill and decode
#
# The absorbed form reads each cached latent once for all heads: decode, a matrix-vector product
# over the cache, is memory-bound and gains by the bytes (section 3's `speedup_vs_naive`). Prefill
# is compute-bound, and there the absorbed form does more work: every score is a dot product of width
# $L + R = 576$ instead of $P + R = 192$, and the values are 512 wide instead of 128. That is why vLLM
# runs the naive path for prefill and the absorbed one for decode. minillm's absorbed kernel serves
# prefill chunks too (one program per query row, so it also covers prefix hits and chunked prefill
# with nothing extra); one DeepSeek-V2-Lite attention layer on a prompt of S tokens shows the price.

# %%
dtype = nb.pick(torch.float32, torch.bfloat16)
attn_cfg = nb.pick(lite.with_(num_heads=4, num_kv_heads=4, hidden_size=64, head_dim=16, rope_scaling=None,
                              mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)),
                   lite)
with torch.device(dev):
    layer = MultiHeadLatentAttention(attn_cfg).to(dtype)
    rope = DeepseekRotaryEmbedding(attn_cfg.head_dim, 8192, attn_cfg.rope_theta, attn_cfg.rope_scaling)
with torch.no_grad():
    for pname, p in layer.named_parameters():
        p.copy_(torch.ones_like(p) if "norm" in pname else torch.randn_like(p) * p.shape[-1] ** -0.5)
prefill_rows = []
for S in nb.pick([32], [512, 2048]):
    x = torch.randn(S, attn_cfg.hidden_size, device=dev, dtype=dtype)
    pos = torch.arange(S, device=dev)
    cos_sin = rope.cos_sin(pos, dtype)
    plain = AttentionMetadata.from_seq_lens([S], dev)
    cached = AttentionMetadata.from_seq_lens([S], dev)
    cached.seq_lens = torch.tensor([S], dtype=torch.int32, device=dev)
    cached.block_table = torch.arange(S // 16, dtype=torch.int32, device=dev)[None]
    cached.slot_mapping = pos
    layer.attn.kv_cache = (torch.empty(S // 16, 16, 1, layer.L + layer.R, device=dev, dtype=dtype), None)
    with torch.inference_mode():
        naive_out, absorbed_out = layer(pos, x, plain, cos_sin), layer(pos, x, cached, cos_sin)
        err = ((naive_out.float() - absorbed_out.float()).norm() / naive_out.float().norm()).item()
        reps = dict(device=dev) if nb.on_gpu() else dict(device=dev, warmup=0, reps=1, inner=1)
        t_naive, t_abs = (time_it(lambda m=m: layer(pos, x, m, cos_sin), **reps)  # noqa: B023 (called at once)
                          for m in (plain, cached))
    assert err < nb.pick(1e-5, 3e-2), err
    prefill_rows.append({"prompt_tokens": S, "naive_ms": t_naive * 1e3, "absorbed_ms": t_abs * 1e3,
                         "absorbed_over_naive": t_abs / t_naive, "rel_diff": err})
layer.attn.kv_cache = None
print_table(prefill_rows, title=f"one MLA layer's prefill, naive (SDPA on up-projected K/V) vs absorbed (paged "
                                f"latent kernel), {str(dtype).removeprefix('torch.')} on {dev}")

# %% [markdown]
# ## 5. End to end: DeepSeek-V2-Lite's shapes through the engine
#
# The throughput workload (`minillm bench throughput`) on DeepSeek-V2-Lite-shaped dummy weights in
# bf16: 27 layers of MLA and 64 routed + 2 shared experts, 15.7 B parameters, 2.4 B active per token,
# the paged pool holding one 1,152-byte latent per token and layer. minillm's own numbers (no HF
# peer: its DeepSeek code runs the per-expert loop and would take far longer). On a CPU a tiny model
# of the same kind runs a few short requests.

# %%
gc.collect()
if nb.on_gpu():
    torch.cuda.empty_cache()
    e2e_model, e2e_args = "deepseek-v2-lite-dummy", dict(num_requests=128)
else:
    e2e_model = lite.with_(name="tiny MLA + MoE", num_layers=2, sliding_windows=[], hidden_size=64, num_heads=4, num_kv_heads=4,
                           intermediate_size=96, vocab_size=512, rope_scaling=None, head_dim=16,
                           moe=lite.moe.__class__(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                  num_shared_experts=1, dense_layers=(0,)),
                           mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16))
    e2e_args = dict(num_requests=4, min_input_len=8, max_input_len=32, min_output_len=4, max_output_len=16,
                    num_gpu_blocks=64)
tp = serving.throughput(e2e_model, hf=False, progress=False, **e2e_args)
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")
