"""The quant_method interface (vLLM's names) and its unquantized implementations.

    layer.quant_method.create_weights(layer, ...)   # registers layer.weight (and scales, zeros, ...)
    y = layer.quant_method.apply(layer, x, bias)     # [T, in] -> [T, out]
    layer.quant_method.process_weights_after_loading(layer)   # repack once the checkpoint is in

Parameters carry what the loader needs as attributes (`set_weight_attrs`): `weight_loader`, the
layer's function that copies a checkpoint tensor (or one shard of it) into the parameter, and
`output_dim`/`input_dim`, which dimension of the parameter a tensor-parallel split cuts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def set_weight_attrs(param: nn.Parameter, attrs: dict) -> None:
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


class QuantizeMethodBase:
    """Creates a layer's parameters and computes with them."""

    def create_weights(self, layer: nn.Module, *args, **kwargs) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after the checkpoint is loaded (repacking, transposing, computing scales)."""


class LinearMethodBase(QuantizeMethodBase):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       params_dtype: torch.dtype, weight_loader: Callable) -> None:
        """output_partition_sizes: this rank's output features of each fused part (q, k, v or gate, up)."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    """One [out, in] weight in the model's dtype; y = x W^T + b."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)  # [out, in]
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)  # [T, in] -> [T, out]


class UnquantizedEmbeddingMethod(QuantizeMethodBase):
    """A [vocab, hidden] table: looked up by the embedding, multiplied by the LM head."""

    def create_weights(self, layer, num_embeddings_per_partition: int, embedding_dim: int,
                       params_dtype: torch.dtype, weight_loader: Callable) -> None:
        weight = nn.Parameter(torch.empty(num_embeddings_per_partition, embedding_dim, dtype=params_dtype),
                              requires_grad=False)  # [vocab, hidden]
        set_weight_attrs(weight, {"output_dim": 0, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)

    def embedding(self, layer, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)  # [T] -> [T, hidden]

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)  # [N, hidden] -> [N, vocab]: the LM head


class QuantizationConfig:
    """What a checkpoint's quantization says (bits, group size, ...) and which method each layer gets.

    `get_quant_method(layer, prefix)` returns the method for one layer (prefix: its dotted name, so a
    config can leave some layers, e.g. the LM head, unquantized) or None for the unquantized one."""

    name = "none"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        raise NotImplementedError
