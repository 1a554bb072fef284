"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm per head) and 128
routed experts, top-8, in every layer (or those `decoder_sparse_step` / `mlp_only_layers` choose).

Qwen3-30B-A3B: 48 layers, hidden 2048, experts of intermediate size 768: 30.5B parameters, 3.3B
active per token. The router's softmax weights are renormalised over the top 8 when the config's
norm_topk_prob says so (it does for the released models). The layers are Mixtral's
(models/mixtral.py) with the checkpoint's names: `mlp.gate`, `mlp.experts.{e}.gate_proj/up_proj/down_proj`.
"""

from __future__ import annotations

from .mixtral import MixtralDecoderLayer, MixtralForCausalLM, MixtralModel


class Qwen3MoeDecoderLayer(MixtralDecoderLayer):
    ckpt_moe = "mlp"
    ckpt_expert_names = ("gate_proj", "up_proj", "down_proj")


class Qwen3MoeModel(MixtralModel):
    decoder_layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    model_cls = Qwen3MoeModel
