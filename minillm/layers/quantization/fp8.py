"""FP8: weights in fp8 e4m3; at large M the activations too (W8A8, the GPU's FP8 tensor cores).

    LLM(quantization="fp8")                                            # per-channel weights, per-token activations
    LLM(quantization={"method": "fp8", "weight_scale": "per_tensor", "activation_scale": "per_tensor"})

The weight-only formats (int8.py, int4.py) shrink what a GEMM reads, which is what a memory-bound
decode step needs; the arithmetic still runs in bf16. W8A8 also halves the *arithmetic*'s operand
width: an H100 multiplies fp8 at twice its bf16 rate (989 vs 1979 dense TFLOP/s), so a large,
compute-bound GEMM (prefill, big batches) can run up to 2x faster, and the weights are half as big.

    weight  W [N, K]: s_w = max |W| / 448 per output row (or one for the tensor); W_q = fp8(W / s_w)  (at load)
    input   x [M, K]: s_x = max |x| / 448 per token (or one for the tensor);      x_q = fp8(x / s_x)  (every call)
    output  y = (x_q W_q^T) * s_x * s_w^T                  fp32 accumulation, one rescale per output element

torch._scaled_mm does the last line in one cuBLAS(Lt) call on GPUs with FP8 matrix units (compute
capability >= 8.9: Ada, Hopper); the activation quantization is minillm's Triton kernel
(kernels/quant_fp8.py).

That pays only where the GEMM is compute-bound. A decode step's few rows make it memory-bound: the
time is the weight's bytes, one per weight with or without fp8 activations, and quantizing x is one
more kernel. So up to WEIGHT_ONLY_MAX_M rows the layer runs weight-only instead: the same fp8 weight,
x kept in bf16/fp16, each weight tile decoded to x's dtype in registers (kernels/w8a16_fp8.py).
That path needs no FP8 matrix units, so a CPU or an older GPU (A100) runs fp8 mode as weight-only at
every M (above the threshold: the weight dequantized once, then a bf16 matmul, as int8 prefill does),
with a warning, as vLLM runs FP8 checkpoints on Ampere. `emulate=True` asks for the plain-PyTorch
references of both paths (weight-only up to the threshold, W8A8 with dequantize -> fp32 matmul above):
an FP8 GPU's arithmetic on any device, what the tests run on a CPU and what the kernels are checked
against on a GPU.
"""

from __future__ import annotations

import functools
import logging

import torch

from ...kernels.quant_fp8 import (
    FP8_E4M3_MAX,
    MIN_SCALE,
    quantize_fp8_ref,
    scaled_fp8_quant,
    scaled_fp8_quant_ref,
)
from ...kernels.w8a16_fp8 import fp8_w8a16_gemm, fp8_w8a16_gemm_ref
from .weight_only import WeightOnlyConfig, WeightOnlyLinearMethod

SCALES = ("per_channel", "per_tensor")  # weights; activations: "per_token" or "per_tensor"
ACT_SCALES = ("per_token", "per_tensor")

# Up to this many rows (tokens) per GEMM: weight-only (fp8 weights, bf16/fp16 x); above: W8A8
# (_scaled_mm). PROVISIONAL, not a measurement: no GPU was available when this was written, so 16
# is the decode range where the W8A16 tiles run (kernels/w4a16.py DECODE_M), the case where the extra
# quantize kernel and the FP8 GEMM are least likely to win. Replace it with the crossover that
# scripts/gpu/fp8_crossover.py measures (bf16 cuBLAS vs weight-only vs W8A8, Llama-3-8B shapes).
# Between DECODE_M and this threshold the weight-only path is dequantize-then-cuBLAS (w8a16_fp8.py).
WEIGHT_ONLY_MAX_M = 16

logger = logging.getLogger(__name__)


@functools.cache
def has_fp8_gemm(device: torch.device) -> bool:
    """torch._scaled_mm's FP8 GEMM: a CUDA GPU of compute capability >= 8.9 (Ada, Hopper)."""
    device = torch.device(device)
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


@functools.cache
def warn_weight_only(device: torch.device) -> None:
    """Once per device: fp8 mode without FP8 matrix units is weight-only (large M: dequantize, then matmul)."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    logger.warning("quantization='fp8' on %s (no FP8 matrix units: compute capability < 8.9 or no CUDA): "
                   "weight-only, the fp8 weights multiply bf16/fp16 activations at every batch size", where)


def quantize_weight_fp8(w: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (fp8 e4m3 [N, K], fp32 scales [N] per output row, or [] for the whole tensor)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1) if per_channel else wf.abs().amax()
    scale = (amax / FP8_E4M3_MAX).clamp_min(MIN_SCALE)  # [N] or []
    return quantize_fp8_ref(wf, scale[:, None] if per_channel else scale), scale


def fp8_gemm_ref(q_x: torch.Tensor, s_x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """_scaled_mm's math in plain PyTorch: (x_q W_q^T) in fp32, times s_x [M, 1] or [], times s_w [N] or []."""
    acc = q_x.float() @ q_w.float().T  # [M, N], products of fp8 values are exact in fp32
    s_w = s_w[None, :] if s_w.dim() == 1 else s_w  # [1, N]: one scale per output column
    return (acc * s_x * s_w).to(out_dtype)


def fp8_gemm(q_x: torch.Tensor, s_x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm: x_q [M, K] row-major times W_q^T (the [N, K] weight seen column-major, no copy).

    cuBLAS takes one scale per operand, or (rowwise) [M, 1] and [1, N] together, with a bf16 output;
    a per-tensor scale beside a per-row one is broadcast to rows, and a rowwise result in another dtype
    is cast afterwards."""
    M, N = q_x.shape[0], q_w.shape[0]
    if s_x.dim() == 0 and s_w.dim() == 0:
        return torch._scaled_mm(q_x, q_w.t(), scale_a=s_x, scale_b=s_w, out_dtype=out_dtype)
    s_a = s_x.expand(M, 1).contiguous() if s_x.dim() == 0 else s_x  # [M, 1]
    s_b = (s_w.expand(N) if s_w.dim() == 0 else s_w).reshape(1, N).contiguous()  # [1, N]
    y = torch._scaled_mm(q_x, q_w.t(), scale_a=s_a, scale_b=s_b, out_dtype=torch.bfloat16)
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


class Fp8Config(WeightOnlyConfig):
    name = "fp8"
    options = ("weight_scale", "activation_scale", "emulate")

    def __init__(self, weight_scale: str = "per_channel", activation_scale: str = "per_token", emulate: bool = False):
        if weight_scale not in SCALES:
            raise ValueError(f"fp8 weight_scale must be one of {', '.join(SCALES)}, not {weight_scale!r}")
        if activation_scale not in ACT_SCALES:
            raise ValueError(f"fp8 activation_scale must be one of {', '.join(ACT_SCALES)}, not {activation_scale!r}")
        if not isinstance(emulate, bool):
            raise TypeError(f"fp8 emulate must be True or False, not {emulate!r}")
        self.weight_scale, self.activation_scale, self.emulate = weight_scale, activation_scale, emulate

    def method(self):
        return Fp8LinearMethod(self)


class Fp8LinearMethod(WeightOnlyLinearMethod):
    """weight fp8 e4m3 [N, K] with weight_scale fp32 ([N] or []) (vLLM's names). Up to WEIGHT_ONLY_MAX_M
    rows y = x (e4m3(W) s_w)^T, x as it is; above, where the device has an FP8 GEMM (or emulate),
    activations quantized per call and y = _scaled_mm(...); (+ b)."""

    def __init__(self, config: Fp8Config):
        self.config = config

    def quantize(self, weight, layer=None):
        if not self.config.emulate and has_fp8_gemm(weight.device):
            N, K = weight.shape
            if N % 16 or K % 16:  # cuBLAS's FP8 GEMM (the W8A8 path at large M) wants 16-aligned dims
                raise ValueError(f"quantization='fp8' needs a weight's dims to be multiples of 16, got [{N}, {K}]")
        elif not self.config.emulate:
            warn_weight_only(weight.device)
        q, scale = quantize_weight_fp8(weight, self.config.weight_scale == "per_channel")
        return {"weight": q, "weight_scale": scale}

    def process_weights_after_loading(self, layer):
        if layer.weight.dtype != torch.float8_e4m3fn:  # not yet quantized (the weight keeps its name)
            super().process_weights_after_loading(layer)

    def matmul(self, layer, x, triton):
        emulate = self.config.emulate
        if x.shape[0] <= WEIGHT_ONLY_MAX_M or not (emulate or has_fp8_gemm(x.device)):
            gemm = fp8_w8a16_gemm if triton and not emulate else fp8_w8a16_gemm_ref
            return gemm(x, layer.weight, layer.weight_scale)  # [M, N], x never quantized
        per_token = self.config.activation_scale == "per_token"
        if emulate:
            q_x, s_x = scaled_fp8_quant_ref(x, per_token=per_token)  # [M, K] fp8, [M, 1] or []
            return fp8_gemm_ref(q_x, s_x, layer.weight, layer.weight_scale, x.dtype)
        q_x, s_x = scaled_fp8_quant(x, per_token=per_token)  # one Triton launch (+ an amax per tensor)
        return fp8_gemm(q_x, s_x, layer.weight, layer.weight_scale, x.dtype)  # [M, N]
