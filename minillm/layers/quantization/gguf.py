"""GGUF's own block formats kept packed on the device: the file's bytes are the model's weights.

    LLM(quantization="gguf")                  # the embedded SmolLM2: Q4_1 linear layers, a Q8_0 embedding

Without it, minillm dequantizes a GGUF file to the model's dtype at load time (loader/dequant.py):
SmolLM2-135M then holds 270 MB of bf16 for a 98 MB file. With it, each Q4_1 or Q8_0 tensor is
repacked once into the W4A16/W8A16 kernels' layout (kernels/w4a16.py) and stays 5 or 8.5 bits per
weight; the kernels dequantize tiles in registers as they multiply, the way llama.cpp runs its files:

    Q4_1  blocks of 32 inputs, W = q * d + m, q in 0..15, d and m fp16   -> int4, group 32 (scales, mins)
    Q8_0  blocks of 32 inputs, W = q * d,     q in -127..127, d fp16     -> int8, group 32 (scales)

The 4-bit values and the fp16 scales are the file's, unchanged (only the nibble order moves), so the
packed layer computes with exactly the weights the dequantizing path builds: the two paths differ only
by where the rounding of a matmul happens. A layer whose parts (q, k and v of qkv_proj, say) are not
all of one packed type falls back to the dequantized weight, as does every F32/F16 tensor (the norms).
The embedding is packed too: a lookup dequantizes the rows it needs, and a tied LM head multiplies by
the same packed table.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ...kernels.w4a16 import (
    dequantize_int4,
    dequantize_int8,
    w4a16_gemm,
    w4a16_gemm_ref,
    w8a16_gemm,
    w8a16_gemm_ref,
)
from ..linear import LinearBase
from ..vocab_parallel_embedding import VocabParallelEmbedding
from .base import QuantizationConfig, QuantizeMethodBase, set_weight_attrs
from .weight_only import WeightOnlyLinearMethod, check_options

GROUP = 32  # GGUF's block: 32 weights of one row share a scale (and a min)
PACKED_KINDS = ("Q4_1", "Q8_0")


def packed_shapes(kind: str, rows: int, cols: int) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
    """The parameters a packed [rows, cols] tensor of `kind` becomes: name -> (shape, dtype)."""
    groups = (rows, cols // GROUP)
    if kind == "Q4_1":
        return {"qweight": ((rows, cols // 2), torch.uint8), "scales": (groups, torch.float16),
                "mins": (groups, torch.float16)}
    return {"qweight": ((rows, cols), torch.int8), "scales": (groups, torch.float16)}


def create_packed(layer: nn.Module, kind: str, rows: int, cols: int, weight_loader) -> None:
    if cols % GROUP:
        raise ValueError(f"quantization 'gguf': {layer.prefix or type(layer).__name__} has {cols} input features, "
                         f"not a multiple of GGUF's block of {GROUP}")
    if getattr(layer, "tp_size", 1) > 1:
        raise ValueError("quantization 'gguf' runs on one GPU only (tensor parallelism splits packed rows "
                         "and columns differently; not built yet)")
    for name, (shape, dtype) in packed_shapes(kind, rows, cols).items():
        p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        set_weight_attrs(p, {"output_dim": 0, "weight_loader": weight_loader})  # rows split/stack like W's
        layer.register_parameter(name, p)


def packed_matmul(kind: str, layer: nn.Module, x: torch.Tensor, triton: bool) -> torch.Tensor:
    """x [T, in] @ W^T -> [T, out] with W in the layer's packed tensors."""
    if kind == "Q4_1":
        gemm = w4a16_gemm if triton else w4a16_gemm_ref
        return gemm(x, layer.qweight, layer.scales, layer.mins, GROUP)
    gemm = w8a16_gemm if triton else w8a16_gemm_ref
    return gemm(x, layer.qweight, layer.scales, GROUP)


class GGUFLinearMethod(WeightOnlyLinearMethod):
    """A linear layer whose weight stays in the file's Q4_1 or Q8_0 blocks (repacked, loader/dequant.py)."""

    def __init__(self, kind: str):
        self.kind = kind

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        create_packed(layer, self.kind, sum(output_partition_sizes), input_size_per_partition, weight_loader)

    def matmul(self, layer, x, triton):
        return packed_matmul(self.kind, layer, x, triton)


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """A [vocab, hidden] table in Q8_0 or Q4_1 blocks: a lookup dequantizes the rows it reads; as a
    (tied) LM head it multiplies with the packed kernel."""

    def __init__(self, kind: str):
        self.kind = kind
        self.linear = GGUFLinearMethod(kind)  # the LM head's matmul is a packed linear layer's

    def create_weights(self, layer, num_embeddings_per_partition, embedding_dim, params_dtype, weight_loader):
        self.dtype = params_dtype  # the model's dtype: what a looked-up row becomes
        create_packed(layer, self.kind, num_embeddings_per_partition, embedding_dim, weight_loader)

    def embedding(self, layer, ids: torch.Tensor) -> torch.Tensor:
        q, s = layer.qweight[ids], layer.scales[ids]  # [T, hidden (/2)], [T, hidden/32]: only these rows
        if self.kind == "Q4_1":
            return dequantize_int4(q, s, layer.mins[ids], GROUP, self.dtype)  # [T, hidden]
        return dequantize_int8(q, s, self.dtype)

    def apply(self, layer, x, bias=None):
        return self.linear.apply(layer, x, bias)  # [N, hidden] -> [N, vocab]


class GGUFConfig(QuantizationConfig):
    """Which layers of one GGUF file stay packed. `LLM(quantization="gguf")` makes an unbound config;
    the loader binds it to the file it opens (`bind`), which is when the tensor types are known."""

    name = "gguf"

    def __init__(self, packed_modules: dict[str, str] | None = None, path: str | None = None):
        self.packed_modules = packed_modules  # our module name -> "Q4_1" | "Q8_0"; None until bound
        self.path = path

    @classmethod
    def from_options(cls, **options) -> GGUFConfig:
        check_options(cls.name, options, ())
        return cls()

    def bind(self, path: str | Path, tensor_types: dict[str, str],
             stacked_params_mapping: Iterable[tuple[str, str, object]]) -> GGUFConfig:
        """tensor_types: the file's tensors in HF naming ("model.layers.0.self_attn.q_proj.weight" ->
        "Q4_1"). A module of ours is packed when every checkpoint tensor stacked into it has one packed type."""
        mapping = list(stacked_params_mapping)
        parts: dict[str, set[str]] = {}
        for name, kind in tensor_types.items():
            if not name.endswith(".weight"):
                continue
            parts.setdefault(self.module_of(name, mapping), set()).add(kind)
        packed = {m: kinds.pop() for m, kinds in parts.items() if len(kinds) == 1 and kinds <= set(PACKED_KINDS)}
        return GGUFConfig(packed, str(path))

    @staticmethod
    def module_of(tensor_name: str, mapping) -> str:
        """'model.layers.0.self_attn.k_proj.weight' -> 'model.layers.0.self_attn.qkv_proj' (our module)."""
        module = tensor_name.rsplit(".", 1)[0]
        for param_name, weight_name, _ in mapping:
            if module.endswith(f".{weight_name}"):
                return module[: -len(weight_name)] + param_name
        return module

    def packs(self, tensor_name: str, mapping) -> str | None:
        """The packed type a checkpoint tensor keeps, or None (it is dequantized)."""
        if self.packed_modules is None or not tensor_name.endswith(".weight"):
            return None
        return self.packed_modules.get(self.module_of(tensor_name, mapping))

    def get_quant_method(self, layer, prefix):
        if self.packed_modules is None:
            raise ValueError("quantization 'gguf' keeps a GGUF file's own blocks: it needs a .gguf model file")
        kind = self.packed_modules.get(prefix)
        if kind is None:
            return None
        if isinstance(layer, LinearBase):
            return GGUFLinearMethod(kind)
        if isinstance(layer, VocabParallelEmbedding):
            return GGUFEmbeddingMethod(kind)
        return None

    def __repr__(self) -> str:
        n = None if self.packed_modules is None else len(self.packed_modules)
        return f"GGUFConfig(path={self.path!r}, packed_modules={n})"
