"""Chapter 18's decode backend "pdl": a decode step's projections through our own GEMV
(`minillm.kernels.gemv`), launched with programmatic dependent launch, inside the CUDA graph.

A layer of the Llama family then runs, for a step of <= 8 tokens:

    h [T, hidden]  --gemv(RMSNorm prologue)-->              qkv [T, (Hq + 2 Hkv) D]
                   --RoPE + KV store, attention (chapter 13's kernels)--> a [T, Hq D]
                   --gemv(+ residual h epilogue)-->         h [T, hidden]   (o_proj)
                   --gemv(RMSNorm prologue, SiLU-mul epilogue)--> [T, I]   (gate_up_proj)
                   --gemv(+ residual h epilogue)-->         h [T, hidden]   (down_proj)

six kernels a layer, each launched with PDL: the GEMVs start their weight reads under the previous
kernel's tail, and RoPE + KV store and attention (which read only their predecessor's output) at
least overlap their launch with it.
The residual stream is one tensor: each residual add happens in the projection before it.

`enable_decode_gemv(model, pdl)` marks the model's layers (those that have the path: a `decode_gemv`
attribute); `decode_gemv_refusal` says why a model or device cannot have it, or None.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..kernels import gemv as _gemv
from .attention import Attention
from .backend import get_kernel_mode, use_triton
from .quantization.base import UnquantizedLinearMethod

DECODE_BACKENDS = ("graphs", "pdl")


def _linears(layer: nn.Module) -> list[nn.Module]:
    return [m for m in layer.modules() if hasattr(m, "quant_method")]


def decode_gemv_refusal(model: nn.Module, device: torch.device) -> str | None:
    """Why decode_backend="pdl" cannot run this model here (a sentence), or None."""
    layers = [m for m in model.modules() if hasattr(m, "decode_gemv")]
    if not layers or not all(layer.has_gemv_path() for layer in layers):
        return f"{type(model).__name__} has no GEMV decode path (the dense Llama/Qwen3 family has)"
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (9, 0):
            return "programmatic dependent launch needs a Hopper GPU or newer (compute capability 9.0)"
    elif not (get_kernel_mode() == "triton" and os.environ.get("TRITON_INTERPRET") == "1"):
        return ("it needs a CUDA GPU (on a CPU only Triton's interpreter runs the GEMV, without PDL: "
                "MINILLM_KERNELS=triton with TRITON_INTERPRET=1, for tests)")
    for layer in layers:
        for linear in _linears(layer):
            if type(linear.quant_method) is not UnquantizedLinearMethod:
                return (f"{linear.prefix or type(linear).__name__} is quantized "
                        f"({type(linear.quant_method).__name__}); the GEMV reads unquantized weights only")
            if getattr(linear, "tp_size", 1) > 1:
                return "tensor parallelism (TP > 1): the GEMV path has no all-reduce"
            if getattr(linear, "gather_output", False):
                return f"{linear.prefix or type(linear).__name__} gathers its output across ranks"
    return None


def enable_decode_gemv(model: nn.Module, mode: str | None) -> None:
    """Route the model's decode steps (<= 8 tokens) through the GEMV: mode "pdl" (launched with PDL),
    "gemv" (without: the interpreter), or None (the layers' own path: decode_backend="graphs")."""
    if mode not in (None, "gemv", "pdl"):
        raise ValueError(f"decode GEMV mode must be None, 'gemv' or 'pdl', not {mode!r}")
    for m in model.modules():
        if hasattr(m, "decode_gemv"):
            m.decode_gemv = mode
        elif isinstance(m, Attention):  # its RoPE + KV store and decode kernels, between the GEMVs
            m.pdl = mode == "pdl"


def gemv_fits(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether this step of this layer takes the GEMV path: the layer was enabled, a few tokens, the
    Triton path, and no forward pre-hooks (calibration reads a linear's input from them)."""
    return (layer.decode_gemv is not None and 1 <= x.shape[0] <= _gemv.MAX_M and use_triton(x)
            and not any(m._forward_pre_hooks for m in _linears(layer)))


def gemv_linear(layer: nn.Module, x: torch.Tensor, linear: nn.Module, *, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """linear(norm(x)) (+ residual), SwiGLU's silu(gate) * up of it with silu_mul; one launch.
    x [T, in] -> [T, out] ([T, out / 2] with silu_mul)."""
    return _gemv.gemv(x, linear.weight, linear.bias, norm_weight=None if norm is None else norm.weight,
                      eps=1e-6 if norm is None else norm.eps, residual=residual, silu_mul=silu_mul,
                      pdl=layer.decode_gemv == "pdl")
