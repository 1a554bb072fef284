"""int4 weight-only group quantization (W4A16): 4 bits per weight, a scale and a min per group.

    LLM(quantization="int4")                                  # group_size 128
    LLM(quantization={"method": "int4", "group_size": 64})

Each output row is cut into groups of `group_size` consecutive inputs (32, 64 or 128); each group
gets its own scale and min (asymmetric, utils.quantize_int4), both in the model's dtype. With bf16
scales that is 4 + 32 / group_size bits per weight: 4.25 at group 128, 3.76x fewer bytes than bf16;
smaller groups follow the weights more closely and cost more scale bytes (4.5 bits at 64, 5 at 32).
The group size must divide every quantized layer's input size (SmolLM2's 576 takes 32 or 64, not 128).
"""

from __future__ import annotations

from ...kernels.w4a16 import w4a16_gemm, w4a16_gemm_ref
from .utils import quantize_int4
from .weight_only import WeightOnlyConfig, WeightOnlyLinearMethod

GROUP_SIZES = (32, 64, 128)


class Int4Config(WeightOnlyConfig):
    name = "int4"
    options = ("group_size",)

    def __init__(self, group_size: int = 128):
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
            raise ValueError(f"quantization 'int4' group_size must be one of "
                             f"{', '.join(map(str, GROUP_SIZES))}, not {group_size!r}")
        self.group_size = group_size

    def method(self):
        return Int4LinearMethod(self.group_size)


class Int4LinearMethod(WeightOnlyLinearMethod):
    """qweight uint8 [out, in/2] (two 4-bit values per byte), scales and mins [out, in/group_size]."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        K, G = input_size_per_partition, self.group_size
        if K % G:
            fits = [str(g) for g in GROUP_SIZES if K % g == 0]
            raise ValueError(f"quantization 'int4' group_size {G} does not divide the {K} input features of "
                             f"{layer.prefix or type(layer).__name__}; group sizes that do: "
                             f"{', '.join(fits) or 'none'}")
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader)

    def quantize(self, weight):
        qweight, scales, mins = quantize_int4(weight, self.group_size)
        return {"qweight": qweight, "scales": scales, "mins": mins}

    def matmul(self, layer, x, triton):
        gemm = w4a16_gemm if triton else w4a16_gemm_ref
        return gemm(x, layer.qweight, layer.scales, layer.mins, self.group_size)
