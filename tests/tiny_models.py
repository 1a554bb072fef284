"""Tiny random checkpoints of every supported family, written by transformers' own save_pretrained
(so the HF-folder loader reads real files), each with a small BPE tokenizer minillm trained."""

from __future__ import annotations

import random
from pathlib import Path

import torch

VOCAB = 320
_BASE = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5)

FAMILIES = {
    # Llama 3.1-style: llama3 RoPE scaling, biases on, untied head
    "llama3": ("LlamaConfig", dict(rope_theta=500000.0, attention_bias=True, mlp_bias=True,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama2-tied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=8)),  # a window shorter than the test sequences
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, num_attention_heads=6, num_key_value_heads=2)),
}
# chapter 10: routed experts, latent attention (kv_lora_rank a power of two for the Triton kernel)
_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
            moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1)
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48)),
    # head_dim 32, not hidden / heads = 16 (Qwen3's explicit head_dim), and a power of two: chapter 04's
    # Triton attention kernels, which the GPU test runs, hold a whole head in one tile (Qwen3-MoE's: 128)
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                         norm_topk_prob=True, mlp_only_layers=[1])),
    # V2: softmax routing inside the 2 best of 4 groups, no q LoRA, YaRN RoPE with mscale
    "deepseek_v2": ("DeepseekV2Config", _MLA | dict(
        n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=None, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 64})),
    # V3: sigmoid scores with a correction bias, groups, renormalised and scaled; q LoRA
    "deepseek_v3": ("DeepseekV3Config", _MLA | dict(
        n_routed_experts=8, num_experts_per_tok=3, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5)),
}



def make_tiny(family: str, folder: Path, max_shard_size: str | None = None, **config) -> Path:
    """config: fields of the HF config to change (max_position_embeddings=4096, ...)."""
    import transformers

    from minillm.tokenizer import save_tokenizer_json, train_bpe
    from minillm.tokenizer.samples import FIXED

    cls_name, extra = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**(_BASE | extra | config))
    if cls_name == "Qwen3Config":
        cfg.hidden_size = 64
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF initialises with std 0.02; larger weights make the test less forgiving
        for p in model.parameters():
            if p.dim() >= 1:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.5).add_(1.0 if p.dim() == 1 else 0.0)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias: nonzero, so that it matters
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tok = train_bpe("\n".join(FIXED) * 2, vocab_size=VOCAB, special_tokens=["<|end|>"])
    save_tokenizer_json(tok, folder / "tokenizer.json")
    return folder


def hf_model(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def random_model(rng: random.Random, **overrides):
    """A small model of a random shape (GQA ratio, head_dim, window, qk-norm) with random weights."""
    kv_heads = rng.choice([1, 2, 3])
    heads = kv_heads * rng.choice([1, 2, 3])
    arch = rng.choice(["llama", "mistral", "qwen3"])
    head_dim = rng.choice([16, 32])
    fields = dict(architecture=arch, vocab_size=97, hidden_size=48, intermediate_size=64, num_layers=2,
                  num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=256,
                  qk_norm=arch == "qwen3", qkv_bias=arch == "llama",
                  sliding_windows=[rng.choice([5, None]), 7] if arch == "mistral" else [])
    from minillm.config import ModelConfig
    from minillm.loader import load_model

    config = ModelConfig(**(fields | overrides))
    model, _, _ = load_model(config, load_format="dummy")
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    with torch.no_grad():  # weights large enough that the logits have clear winners and losers
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.3, generator=gen)
    return model, config
