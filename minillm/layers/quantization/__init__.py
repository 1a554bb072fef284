"""How a linear layer stores its weight and multiplies by it: one `quant_method` per layer.

A linear layer (layers/linear.py) owns the *shape* of its weight and how a checkpoint's tensors fill
it; its quant_method owns the *storage* (which parameters, which dtype, packed or not) and the
*matmul*. Unquantized, that is one [out, in] weight and F.linear. Chapter 08 adds methods that
store int8/int4/fp8 weights with their scales and multiply with their own kernels; a model file
never changes for it, it only passes a QuantizationConfig down to its layers.
"""

from .base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
    set_weight_attrs,
)

__all__ = ["LinearMethodBase", "QuantizationConfig", "QuantizeMethodBase", "UnquantizedEmbeddingMethod",
           "UnquantizedLinearMethod", "set_weight_attrs"]
