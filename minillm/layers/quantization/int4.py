"""int4 weight-only group quantization (W4A16): 4 bits per weight, a scale and a min per group.

    LLM(quantization="int4")                                  # group 128, else 64, else 32, per layer
    LLM(quantization={"method": "int4", "group_size": 64})    # exactly 64, or a ValueError

Each output row is cut into groups of `group_size` consecutive inputs (32, 64 or 128); each group
gets its own scale and min (asymmetric, utils.quantize_int4), both in the model's dtype. With bf16
scales that is 4 + 32 / group_size bits per weight: 4.25 at group 128, 3.76x fewer bytes than bf16;
smaller groups follow the weights more closely and cost more scale bytes (4.5 bits at 64, 5 at 32).

A group must divide its layer's input size. Left unset, each layer takes the largest of 128, 64 and
32 that divides its inputs: SmolLM2's 576-input layers get 64, its down_proj (1536 inputs) 128, so
`LLM(quantization="int4")` runs on the embedded model. A group size asked for is used as asked, and a
layer it does not divide is a ValueError naming the sizes that would.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.w4a16 import w4a16_gemm, w4a16_gemm_ref
from .utils import quantize_int4
from .weight_only import WeightOnlyConfig, WeightOnlyLinearMethod

GROUP_SIZES = (32, 64, 128)


class Int4Config(WeightOnlyConfig):
    name = "int4"
    options = ("group_size",)

    def __init__(self, group_size: int | None = None):
        if group_size is not None and (isinstance(group_size, bool) or group_size not in GROUP_SIZES):
            raise ValueError(f"quantization 'int4' group_size must be one of "
                             f"{', '.join(map(str, GROUP_SIZES))}, not {group_size!r}")
        self.adaptive = group_size is None  # unset: the largest group that divides each layer
        self.group_size = group_size or max(GROUP_SIZES)

    def method(self):
        return Int4LinearMethod(self.group_size, adaptive=self.adaptive)


class Int4LinearMethod(WeightOnlyLinearMethod):
    """qweight uint8 [out, in/2] (two 4-bit values per byte), scales and mins [out, in/group_size]."""

    def __init__(self, group_size: int, adaptive: bool = False):
        self.group_size = group_size  # one method per layer: this layer's group once create_weights ran
        self.adaptive = adaptive

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        K, G = input_size_per_partition, self.group_size
        fits = [g for g in GROUP_SIZES if K % g == 0]
        if self.adaptive and fits:
            G = self.group_size = max(g for g in fits if g <= self.group_size)
        if K % G:
            fits = [str(g) for g in fits]
            raise ValueError(f"quantization 'int4' group_size {G} does not divide the {K} input features of "
                             f"{layer.prefix or type(layer).__name__}; group sizes that do: "
                             f"{', '.join(fits) or 'none'}" + (" (int4 needs a multiple of 32)" if not fits else ""))
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader)

    def quantize(self, weight, layer=None):
        qweight, scales, mins = quantize_int4(weight, self.group_size)
        return {"qweight": qweight, "scales": scales, "mins": mins}

    def matmul(self, layer, x, triton):
        gemm = w4a16_gemm if triton else w4a16_gemm_ref
        return gemm(x, layer.qweight, layer.scales, layer.mins, self.group_size)


def become_int4(layer: nn.Module, tensors: dict[str, torch.Tensor], group_size: int) -> None:
    """Turn a layer that holds a full-precision weight into an `int4` layer (AWQ/GPTQ after calibrating,
    a saved folder after loading): the weight goes, the packed tensors (qweight, scales, mins) and the
    int4 method (the W4A16 kernel on a GPU) take its place."""
    del layer.weight
    for name, t in tensors.items():
        layer.register_parameter(name, nn.Parameter(t, requires_grad=False))
    layer.quant_method = Int4LinearMethod(group_size)
