"""int8 weight-only quantization (W8A16): one int8 per weight and one scale per output channel.

    LLM(quantization="int8")

Half the bytes of a bf16 weight (8 bits + 16 per row of K), so a memory-bound decode step can be up to
2x faster; 255 levels per row keep the layer's output at 40-50 dB SQNR, so greedy tokens rarely move.
Activations stay in the model's dtype. The LM head is int8 too, one scale per vocabulary row (lm_head.py),
unless the option lm_head="none" keeps it in the model's dtype (weight_only.py).
"""

from __future__ import annotations

from ...distributed import get_tp_group
from ...kernels.w4a16 import w8a16_gemm, w8a16_gemm_ref
from .utils import quantize_int8
from .weight_only import WeightOnlyConfig, WeightOnlyLinearMethod


class Int8Config(WeightOnlyConfig):
    name = "int8"

    def method(self):
        return Int8LinearMethod()


class Int8LinearMethod(WeightOnlyLinearMethod):
    """qweight int8 [out, in], scales [out] (the model's dtype); y = x (q * s)^T + b."""

    def quantize(self, weight, layer=None):
        amax = None
        if getattr(layer, "input_is_parallel", False) and layer.tp_size > 1:
            # chapter 11: a row-parallel rank holds a slice of every row; the scale comes from the whole
            # row (the ranks' maxima, reduced), so each rank's int8 weights are TP = 1's, sliced
            amax = get_tp_group().all_reduce_max(weight.float().abs().amax(dim=1))  # [out]
        q, scales = quantize_int8(weight, amax=amax)
        return {"qweight": q, "scales": scales}

    def matmul(self, layer, x, triton):
        gemm = w8a16_gemm if triton else w8a16_gemm_ref
        return gemm(x, layer.qweight, layer.scales)
