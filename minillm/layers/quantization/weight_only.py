"""What the weight-only methods (int8, int4; AWQ and GPTQ later) share: load, then quantize.

A checkpoint holds full-precision weights. The layer first gets an ordinary [out, in] `weight`
(the unquantized method's, with the same `weight_loader`), so stacking q/k/v, gate/up and a
tensor-parallel split work exactly as they do unquantized. Once every shard is in,
`process_weights_after_loading` quantizes it, registers the quantized tensors as parameters and
deletes the full-precision weight: the model then holds only the packed weights and their scales.
A method says what quantizing produces (`quantize`) and how to multiply with it (`matmul`): the
Triton kernel on a GPU, its dequantize-then-matmul reference elsewhere (layers/backend.py).

Only the linear layers are quantized. The embedding and the LM head are not linear layers here
(layers/vocab_parallel_embedding.py): they stay in the model's dtype, as in vLLM and llama.cpp's
common formats, because the logits are where rounding shows most.
"""

from __future__ import annotations

import torch
from torch import nn

from ..backend import use_triton
from ..linear import LinearBase
from .base import LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod


def check_options(method: str, options: dict, allowed: tuple[str, ...]) -> None:
    """A quantization config's keyword options: only the ones it knows."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"quantization {method!r} has no option {unknown[0]!r} "
                         f"(its options: {', '.join(allowed) or 'none'})")


class WeightOnlyConfig(QuantizationConfig):
    """A config whose options are its constructor's keywords; every linear layer gets `method()`."""

    options: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, **options) -> WeightOnlyConfig:
        check_options(cls.name, options, cls.options)
        return cls(**options)

    def method(self) -> WeightOnlyLinearMethod:
        raise NotImplementedError

    def get_quant_method(self, layer, prefix):
        return self.method() if isinstance(layer, LinearBase) else None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.options)
        return f"{type(self).__name__}({args})"


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
        x2 = x.reshape(-1, x.shape[-1])  # [T, in], a contiguous last dim as the kernels take it
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        y = self.matmul(layer, x2, use_triton(x2))  # [T, out]
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])
