"""How a linear layer stores its weight and multiplies by it: one `quant_method` per layer.

A linear layer (layers/linear.py) owns the *shape* of its weight and how a checkpoint's tensors fill
it; its quant_method owns the *storage* (which parameters, which dtype, packed or not) and the
*matmul*. Unquantized, that is one [out, in] weight and F.linear. Chapter 08 adds methods that
store int8/int4/fp8 weights with their scales and multiply with their own kernels; a model file
never changes for it, it only passes a QuantizationConfig down to its layers.

Choosing one (`LLM(quantization=...)`, `load_model(..., quantization=...)`):

    "int8"                                   int8 weights, one scale per output channel (int8.py)
    "int4"                                   int4 weights in groups of 128 inputs (int4.py)
    {"method": "int4", "group_size": 64}     a method with its options
    Int4Config(group_size=32)                a config object
    "gguf"                                   a .gguf file's Q4_1/Q8_0 blocks kept packed (gguf.py)
"""

from .awq import AWQConfig
from .base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
    set_weight_attrs,
)
from .fp8 import Fp8Config
from .gguf import GGUFConfig
from .gptq import GPTQConfig
from .int4 import Int4Config
from .int8 import Int8Config

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {"int8": Int8Config, "int4": Int4Config}
QUANTIZATION_METHODS["fp8"] = Fp8Config  # W8A8: fp8 weights and activations, torch._scaled_mm (fp8.py)
QUANTIZATION_METHODS["gguf"] = GGUFConfig
QUANTIZATION_METHODS["awq"] = AWQConfig  # calibrated on text at load (awq.py)
QUANTIZATION_METHODS["gptq"] = GPTQConfig  # calibrated on text at load (gptq.py)


def get_quantization_config(spec) -> QuantizationConfig | None:
    """None (unquantized), a method name, {"method": name, **options} or a QuantizationConfig -> the
    config. Unknown names and options are ValueErrors that say what is allowed."""
    if spec is None or isinstance(spec, QuantizationConfig):
        return spec
    names = ", ".join(repr(n) for n in QUANTIZATION_METHODS)
    if isinstance(spec, dict):
        options = dict(spec)
        name = options.pop("method", None)
        if name is None:
            raise ValueError(f"a quantization dict needs a 'method' ({names}), got keys {sorted(spec)}")
    elif isinstance(spec, str):
        name, options = spec, {}
    else:
        raise TypeError(f"quantization must be None, a method name ({names}), a dict with a 'method' or a "
                        f"QuantizationConfig, not {type(spec).__name__}")
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {names}, not {name!r}")
    return QUANTIZATION_METHODS[name].from_options(**options)


__all__ = ["QUANTIZATION_METHODS", "Fp8Config", "GGUFConfig", "Int4Config", "Int8Config", "LinearMethodBase", "QuantizationConfig",
           "QuantizeMethodBase", "UnquantizedEmbeddingMethod", "UnquantizedLinearMethod", "get_quantization_config",
           "set_weight_attrs"]
