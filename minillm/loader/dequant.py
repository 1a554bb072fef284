"""GGUF's block quantization, undone in PyTorch (on whatever device the bytes are on).

llama.cpp stores most weights in blocks of 32 values that share a scale:

    Q8_0  34 bytes per block: d (fp16), then 32 int8 q          x = d * q
    Q4_1  20 bytes per block: d (fp16), m (fp16), 16 bytes of   x = d * q + m
          4-bit q: byte j holds value j in its low nibble and value j + 16 in its high nibble

So Q4_1 costs 5 bits per weight (4 + 32 bits of scales / 32) and Q8_0 8.5. Dequantizing on the
target device means the host never holds an fp32 copy of the model. Chapter 08 keeps the weights
quantized and does this inside the matmul kernel instead.
"""

from __future__ import annotations

import torch

from ..kernels.w4a16 import pack_int4

BLOCK = 32
BYTES_PER_BLOCK = {"Q8_0": 34, "Q4_1": 20}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [..., 1] float32, reading little-endian fp16."""
    return raw.contiguous().view(torch.float16).float()


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 34] uint8 -> [n_blocks, 32] float32."""
    d = _f16(blocks[:, :2])  # [n, 1]
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]
    return d * q


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 20] uint8 -> [n_blocks, 32] float32."""
    d, m = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # [n, 1] each
    qs = blocks[:, 4:]  # [n, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()  # low nibbles are values 0..15, high 16..31
    return d * q + m


def dequantize(raw: torch.Tensor, kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF tensor bytes (uint8, one row per output row) -> float32 tensor of `shape`."""
    if kind not in BYTES_PER_BLOCK:
        raise ValueError(f"GGUF tensor type {kind} is not supported (supported: F32, F16, BF16, Q8_0, Q4_1)")
    blocks = raw.reshape(-1, BYTES_PER_BLOCK[kind])
    values = dequantize_q8_0(blocks) if kind == "Q8_0" else dequantize_q4_1(blocks)
    return values.reshape(shape)


# ---- kept packed: the same bytes in the W4A16/W8A16 kernels' layout (chapter 08) -------------------


def repack_q4_1(raw: torch.Tensor, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Raw Q4_1 bytes of an [N, K] tensor -> {"qweight": uint8 [N, K/2], "scales", "mins": fp16 [N, K/32]}.

    The 4-bit values and both fp16 numbers of each block are kept exactly; only the nibble order moves:
    GGUF pairs value j with j + 16 in a byte, kernels/w4a16.py pairs 2j with 2j + 1 (so a tile of K
    reads its bytes contiguously). Dequantizing either gives the same d * q + m, bit for bit."""
    N, K = shape
    blocks = raw.reshape(N, K // BLOCK, BYTES_PER_BLOCK["Q4_1"])  # [N, K/32, 20]
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [N, K/32, 1] each
    qs = blocks[..., 4:]  # [N, K/32, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, K/32, 32] in GGUF's value order
    return {"qweight": pack_int4(q.reshape(N, K)), "scales": d[..., 0].half(), "mins": m[..., 0].half()}


def repack_q8_0(raw: torch.Tensor, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Raw Q8_0 bytes of an [N, K] tensor -> {"qweight": int8 [N, K], "scales": fp16 [N, K/32]}."""
    N, K = shape
    blocks = raw.reshape(N, K // BLOCK, BYTES_PER_BLOCK["Q8_0"])  # [N, K/32, 34]
    q = blocks[..., 2:].contiguous().view(torch.int8)  # [N, K/32, 32]
    return {"qweight": q.reshape(N, K), "scales": _f16(blocks[..., :2])[..., 0].half()}


def repack(raw: torch.Tensor, kind: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Raw GGUF bytes -> the packed tensors a quantized layer keeps (by parameter name)."""
    if kind not in PACKED or len(shape) != 2:
        raise ValueError(f"GGUF tensor type {kind} of shape {shape} cannot be kept packed "
                         f"(packed: 2-D {', '.join(PACKED)})")
    return PACKED[kind](raw, shape)


PACKED = {"Q4_1": repack_q4_1, "Q8_0": repack_q8_0}
