"""What the weight-only methods (int8, int4; AWQ and GPTQ later) share: load, then quantize.

A checkpoint holds full-precision weights. The layer first gets an ordinary [out, in] `weight`
(the unquantized method's, with the same `weight_loader`), so stacking q/k/v, gate/up and a
tensor-parallel split work exactly as they do unquantized. Once every shard is in,
`process_weights_after_loading` quantizes it, registers the quantized tensors as parameters and
deletes the full-precision weight: the model then holds only the packed weights and their scales.
A method says what quantizing produces (`quantize`) and how to multiply with it (`matmul`): the
Triton kernel on a GPU, its dequantize-then-matmul reference elsewhere (layers/backend.py).

The LM head is not a linear layer here (layers/vocab_parallel_embedding.py), but it is a matmul a
decode step reads in full: every weight-only config gives it int8 rows with one scale each
(lm_head.py; on Llama-3-8B its bf16 table is 22 % of an int4 step's bytes), and a tied embedding
looks its rows up in the same int8 table. The option `lm_head="none"` keeps both in the model's
dtype, as vLLM and llama.cpp's common formats do: the logits are where rounding shows most.
"""

from __future__ import annotations

import torch
from torch import nn

from ..backend import use_triton
from ..linear import LinearBase
from .base import LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod
from .lm_head import LM_HEAD_FORMATS, Int8EmbeddingMethod, is_vocab_table
from .utils import matmul_rows


def check_options(method: str, options: dict, allowed: tuple[str, ...]) -> None:
    """A quantization config's keyword options: only the ones it knows."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"quantization {method!r} has no option {unknown[0]!r} "
                         f"(its options: {', '.join(allowed) or 'none'})")


class WeightOnlyConfig(QuantizationConfig):
    """A config whose options are its constructor's keywords, and `lm_head`: every linear layer gets
    `method()`, the vocabulary tables int8 rows (lm_head="int8", the default) or none (lm_head="none")."""

    options: tuple[str, ...] = ()
    lm_head = "int8"  # the default; from_options sets it per config (one of lm_head.LM_HEAD_FORMATS)

    @classmethod
    def from_options(cls, **options) -> WeightOnlyConfig:
        check_options(cls.name, options, cls.options + ("lm_head",))
        lm_head = options.pop("lm_head", cls.lm_head)
        if not isinstance(lm_head, str) or lm_head not in LM_HEAD_FORMATS:
            raise ValueError(f"quantization {cls.name!r} lm_head must be one of "
                             f"{', '.join(map(repr, LM_HEAD_FORMATS))}, not {lm_head!r}")
        config = cls(**options)
        config.lm_head = lm_head
        return config

    def method(self) -> WeightOnlyLinearMethod:
        raise NotImplementedError

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, LinearBase):
            return self.method()
        if is_vocab_table(layer) and self.lm_head == "int8":
            # the embedding too: when it is built, whether an LM head will be tied to it (and take this very
            # method, tie_weights) is not known yet; an untied one stays full precision (lm_head.py)
            return Int8EmbeddingMethod()
        return None

    def __repr__(self) -> str:
        args = [f"{k}={getattr(self, k)!r}" for k in self.options]
        args += [f"lm_head={self.lm_head!r}"] if self.lm_head != type(self).lm_head else []
        return f"{type(self).__name__}({', '.join(args)})"


class WeightOnlyLinearMethod(LinearMethodBase):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        UnquantizedLinearMethod().create_weights(layer, input_size_per_partition, output_partition_sizes,
                                                 params_dtype, weight_loader)  # layer.weight [out, in]

    def quantize(self, weight: torch.Tensor, layer: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """[out, in] full-precision weight (this rank's shard) -> the tensors the layer keeps, by
        parameter name. layer: the layer it belongs to (a row-parallel one holds part of each row)."""
        raise NotImplementedError

    def matmul(self, layer: nn.Module, x: torch.Tensor, triton: bool) -> torch.Tensor:
        """x [T, in] -> [T, out] with the layer's quantized tensors (triton: the kernel, else the reference)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight" not in layer._parameters:  # already quantized
            return
        with torch.no_grad():
            tensors = self.quantize(layer.weight.data, layer)
        del layer.weight  # the full-precision copy goes: only the quantized tensors stay
        for name, t in tensors.items():
            layer.register_parameter(name, nn.Parameter(t, requires_grad=False))

    def apply(self, layer, x, bias=None):
        return matmul_rows(x, bias, lambda x2: self.matmul(layer, x2, use_triton(x2)))  # [..., out]
