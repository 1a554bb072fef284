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
