"""Rotary position embedding (RoPE; Su et al., 2021), with Llama 3's frequency scaling.

RoPE encodes a token's position by rotating pairs of its query and key coordinates by angles
position x theta_i, with theta_i = base^(-2i / head_dim). The dot product of a rotated query and a
rotated key then depends only on their distance. Llama-family checkpoints pair coordinate i with
i + head_dim/2 (the "rotate half" layout):

    q' = q * cos + rotate_half(q) * sin,   rotate_half([a, b]) = [-b, a]

cos/sin for every position are computed once, in fp32, into a cache.

Llama 3.1 stretches the low frequencies for long contexts (rope_type "llama3"): wavelengths longer
than original_context / low_freq_factor are divided by `factor`, shorter than
original_context / high_freq_factor are kept, and the band between is interpolated smoothly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels import rotary as _kernel
from .backend import use_triton


def inverse_frequencies(head_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """theta_i = base^(-2i/head_dim) for i in [0, head_dim/2), with Llama 3 scaling if asked."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling and scaling.get("rope_type") == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.base, self.scaling = head_dim, max_positions, base, scaling
        self.compute_cache()

    def compute_cache(self, device: torch.device | str | None = None) -> None:
        """cos/sin of position x frequency for every position, in fp32 (a computed buffer, never loaded)."""
        inv_freq = inverse_frequencies(self.head_dim, self.base, self.scaling).to(device)  # [head_dim/2]
        freqs = torch.arange(self.max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, [T, 1, head_dim] in `dtype` (the model looks them up once
        per forward pass and hands them to every layer).

        One gather, from a [max_positions, 2, head_dim] table already in `dtype` (the fp32 cache rounded
        once): cos and sin are two views of its rows, token stride 2 * head_dim. A CUDA-graphed step
        then spends one kernel here, not four (two gathers, two casts)."""
        # Made on first use per dtype, and again whenever the fp32 cache is recomputed or moved.
        key = (dtype, self.cos_cache.device, self.cos_cache.data_ptr(), self.sin_cache.data_ptr())
        table = getattr(self, "_cos_sin_table", None)
        if table is None or table[0] != key:
            table = (key, torch.stack((self.cos_cache, self.sin_cache), dim=1).to(dtype))  # [max_pos, 2, D]
            self._cos_sin_table = table
        rows = table[1][positions]  # [T, 2, head_dim]
        return rows[:, 0:1, :], rows[:, 1:2, :]  # [T, 1, head_dim] each, views

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [T]; q: [T, num_heads, head_dim]; k: [T, num_kv_heads, head_dim]
        return apply_rotary(q, k, *self.cos_sin(positions, q.dtype))


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q and k ([T, heads, head_dim]) by angles whose cos/sin are [T, 1, head_dim].

    On a GPU the Triton kernel rotates both in place, in one launch (`minillm.kernels.rotary`).
    """
    if use_triton(q):
        return _kernel.apply_rotary_(q, k, cos, sin)
    return _kernel.apply_rotary_ref(q, k, cos, sin)
