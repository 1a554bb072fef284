"""Mixtral (Jiang et al., 2024): Llama's attention, and a mixture of 8 expert MLPs in place of the MLP.

    x [T, H] --RMSNorm--> attention (GQA, RoPE) --> + x
    x [T, H] --RMSNorm--> router [T, 8] --softmax, top-2, renormalise--> 2 of 8 SwiGLU experts --> + x

Mixtral-8x7B holds 47B parameters but a token runs through 13B of them: the experts are most of the
weights, and each token reads two of eight. Everything but the MLP is Llama's (models/llama.py); this
file swaps the block after attention for layers/moe.py's SparseMoeBlock and says where a checkpoint's
per-expert tensors go (`block_sparse_moe.experts.{e}.w1/w3/w2` -> the stacked `mlp.experts.w13/w2`).
Qwen3-MoE (models/qwen3_moe.py) is the same with other names.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.moe import SparseMoeBlock, expert_params_mapping
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from .utils import load_weights


def check_moe(config: ModelConfig) -> None:
    if config.moe is None:
        raise ValueError(f"architecture {config.architecture!r} needs a MoE config (config.moe: num_experts, "
                         f"num_experts_per_tok, ...), got none")


class MixtralDecoderLayer(LlamaDecoderLayer):
    ckpt_moe = "block_sparse_moe"  # where the checkpoint keeps the router and the experts
    ckpt_expert_names = ("w1", "w3", "w2")  # gate, up, down

    def make_mlp(self, config: ModelConfig, layer: int, quant_config, prefix: str) -> nn.Module:
        if layer in config.moe.dense_layers:
            return LlamaMLP(config, quant_config, prefix)
        return SparseMoeBlock(config, quant_config, prefix, ckpt_prefix=f"{self.ckpt_moe}.experts",
                              ckpt_names=self.ckpt_expert_names)


class MixtralModel(LlamaModel):
    decoder_layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel

    def __init__(self, config: ModelConfig, quant_config=None):
        check_moe(config)
        super().__init__(config, quant_config)
        layer = self.model_cls.decoder_layer_cls
        # expert rows first: ".gate_proj." alone would also match an expert's gate_proj
        self.stacked_params_mapping = (
            *expert_params_mapping(config.moe.num_experts, f"{layer.ckpt_moe}.experts", "mlp.experts",
                                   layer.ckpt_expert_names),
            *((("mlp.gate", f"{layer.ckpt_moe}.gate", None),) if layer.ckpt_moe != "mlp" else ()),
            *LlamaForCausalLM.stacked_params_mapping)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights, self.stacked_params_mapping)
