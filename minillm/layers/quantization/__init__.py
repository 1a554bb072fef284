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
    {"method": "int4", "lm_head": "none"}    the LM head in the model's dtype (the default, "int8":
                                             int8 rows, lm_head.py; every weight-only method has it)
    Int4Config(group_size=32)                a config object
    "gguf"                                   a .gguf file's Q4_1/Q8_0 blocks kept packed (gguf.py)

The layers import only `base.py` (the interface and the unquantized methods). A method's file is
imported the first time its name is asked for (`QUANTIZATION_METHODS[name]`, or a class name such
as `Int8Config` from this package), as the model registry (models/registry.py) loads model files. So
this package never imports the methods at import time, and a method file may import the layers it
quantizes (`..linear`, `..attention`) at its top: the imports run one way, layers -> base, methods
-> layers, with no circle.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping

from .base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
    set_weight_attrs,
)

# method name -> "module:Class" in this package (or a class, once registered or loaded)
_METHODS: dict[str, str | type[QuantizationConfig]] = {
    "int8": "int8:Int8Config",
    "int4": "int4:Int4Config",
    "fp8": "fp8:Fp8Config",  # W8A8: fp8 weights and activations, torch._scaled_mm (fp8.py)
    "gguf": "gguf:GGUFConfig",
    "awq": "awq:AWQConfig",  # calibrated on text at load (awq.py)
    "gptq": "gptq:GPTQConfig",  # calibrated on text at load (gptq.py)
}


def _load(entry: str | type[QuantizationConfig]) -> type[QuantizationConfig]:
    if isinstance(entry, type):
        return entry
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


class _MethodRegistry(MutableMapping):
    """The methods by name, a dict whose classes are imported on first lookup. Assigning
    `QUANTIZATION_METHODS["mine"] = MyConfig` (or "module:Class" in this package) adds one."""

    def __getitem__(self, name: str) -> type[QuantizationConfig]:
        cls = _METHODS[name] = _load(_METHODS[name])
        return cls

    def __setitem__(self, name: str, cls) -> None:
        if not (isinstance(cls, type) and issubclass(cls, QuantizationConfig)) and \
                not (isinstance(cls, str) and cls.count(":") == 1):
            raise TypeError(f"a quantization method is a QuantizationConfig subclass or 'module:Class', not {cls!r}")
        _METHODS[name] = cls

    def __contains__(self, name) -> bool:  # without importing the method's file
        return name in _METHODS

    def __delitem__(self, name: str) -> None:
        del _METHODS[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_METHODS)

    def __len__(self) -> int:
        return len(_METHODS)

    def __repr__(self) -> str:
        return f"QUANTIZATION_METHODS({list(_METHODS)})"


QUANTIZATION_METHODS = _MethodRegistry()

# the config classes this package names, each imported from its method's file on first use (PEP 562)
_CLASSES = {"Int8Config": "int8", "Int4Config": "int4", "Fp8Config": "fp8", "GGUFConfig": "gguf",
            "AWQConfig": "awq", "GPTQConfig": "gptq"}


def __getattr__(name: str):
    if name in _CLASSES:
        return QUANTIZATION_METHODS[_CLASSES[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_CLASSES))


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
    if not isinstance(name, str) or name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be None or one of {names}, not {name!r}")
    return QUANTIZATION_METHODS[name].from_options(**options)


__all__ = ["QUANTIZATION_METHODS", "AWQConfig", "Fp8Config", "GGUFConfig", "GPTQConfig", "Int4Config", "Int8Config",
           "LinearMethodBase", "QuantizationConfig", "QuantizeMethodBase", "UnquantizedEmbeddingMethod",
           "UnquantizedLinearMethod", "get_quantization_config", "set_weight_attrs"]
