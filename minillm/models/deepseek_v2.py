"""DeepSeek-V2, V2-Lite and V3: latent attention (layers/mla.py) and routed + shared experts (layers/moe.py).

    x [T, H] --RMSNorm--> MLA: cache [c, k_pe] (L + R per token), absorbed attention --> + x
    x [T, H] --RMSNorm--> dense MLP (the first first_k_dense_replace layers)
                          or router -> top-k of E routed experts + n_shared_experts always --> + x

DeepSeek-V2-Lite: 27 layers, hidden 2048, 16 heads, kv_lora_rank 512 + rope 64, no q LoRA; 64 routed
experts (6 per token, softmax, no renormalisation) and 2 shared ones of width 1408; 15.7B parameters,
2.4B active. V3 (671B): q LoRA 1536, 256 experts (8 per token) chosen by sigmoid scores inside the 4
best of 8 groups, with a bias correcting the choice, weights renormalised and scaled by 2.5. The
layer code is one; the config says which router (MoEConfig.topk_method), which RoPE pairing
(MLAConfig.rope_interleave) and whether q has a LoRA.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..config import ModelConfig
from ..layers import RMSNorm
from ..layers.mla import DeepseekRotaryEmbedding, MultiHeadLatentAttention
from ..layers.moe import SparseMoeBlock, expert_params_mapping
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from .utils import load_weights


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    """Llama's residual layout (forward inherited) around MLA and a MoE (or dense) MLP."""

    def __init__(self, config: ModelConfig, layer: int, quant_config=None, prefix: str = ""):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(config, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.moe is None or layer in config.moe.dense_layers:
            self.mlp = LlamaMLP(config, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = SparseMoeBlock(config, quant_config, f"{prefix}.mlp",
                                      shared_experts=make_shared_experts(config, quant_config, f"{prefix}.mlp"))


def make_shared_experts(config: ModelConfig, quant_config, prefix: str) -> LlamaMLP | None:
    """The experts every token runs: one gated MLP num_shared_experts times as wide. Column-parallel
    up, row-parallel down without its own all-reduce: the MoE block sums it with the routed experts'
    partial sums and all-reduces once."""
    moe = config.moe
    if not moe.num_shared_experts:
        return None
    shared = config.with_(intermediate_size=moe.moe_intermediate_size * moe.num_shared_experts)
    return LlamaMLP(shared, quant_config, f"{prefix}.shared_experts", reduce_results=False)


class DeepseekV2Model(LlamaModel):
    decoder_layer_cls = DeepseekV2DecoderLayer
    rotary_emb_cls = DeepseekRotaryEmbedding  # over qk_rope_head_dim (config.head_dim), with YaRN


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekV2Model

    def __init__(self, config: ModelConfig, quant_config=None):
        if config.mla is None:
            raise ValueError(f"architecture {config.architecture!r} needs an MLA config (config.mla: kv_lora_rank, "
                             f"qk_nope_head_dim, qk_rope_head_dim, v_head_dim), got none")
        if config.head_dim != config.mla.qk_rope_head_dim:
            raise ValueError(f"config.head_dim ({config.head_dim}) must equal mla.qk_rope_head_dim "
                             f"({config.mla.qk_rope_head_dim}): it is the width RoPE rotates")
        super().__init__(config, quant_config)
        experts = expert_params_mapping(config.moe.num_experts, "experts", "experts") if config.moe else []
        self.stacked_params_mapping = (*experts, ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # V3 checkpoints carry a multi-token-prediction layer after the last one; minillm does not run it
        n = self.config.num_layers
        return load_weights(self, ((k, t) for k, t in weights if not k.startswith(f"model.layers.{n}.")),
                            self.stacked_params_mapping)
