"""Counter-based random numbers: a uniform for every (seed, step, token) computed, not drawn.

A batched sampler serves many requests at once, and a request with a seed must get the same tokens
whatever else shares its batch. A shared random stream cannot promise that (the other rows consume
numbers from it), and one torch.Generator per row means a Python loop over rows. Instead, as Philox
does in cuRAND and JAX, we *hash* the coordinates: the uniform for token v of a sequence at output
step t is a fixed function of (seed, t, v). Any row can be computed alone or in any batch, on any
device, and gives the same number.

The hash is MurmurHash3's 32-bit finalizer, done in int64 tensors and masked to 32 bits after each
multiply, so it runs as a handful of elementwise GPU ops over a [rows, vocab] grid.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's fmix32 on int64 tensors holding 32-bit values: a bijection that scrambles bits."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32  # the product may wrap in int64; its low 32 bits are still right
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[rows] int64 seeds (any non-negative int64) and steps -> [rows] 32-bit keys."""
    k = mix32(seeds ^ 0x5BD1E995)
    k = mix32(k ^ (seeds >> 32))
    return mix32(k ^ mix32(steps ^ 0x27D4EB2F))


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, n: int) -> torch.Tensor:
    """[rows, n] float32 uniforms in (0, 1), a pure function of (seed, step, column)."""
    key = row_keys(seeds.long(), steps.long())[:, None]  # [rows, 1]
    col = torch.arange(n, device=seeds.device, dtype=torch.int64)[None, :]  # [1, n]
    h = mix32(mix32(key ^ (col * 0x9E3779B9)) + key)  # [rows, n]
    return to_unit(h)


def to_unit(h: torch.Tensor) -> torch.Tensor:
    """32-bit integers -> float32 in the open interval (0, 1), evenly spaced.

    Keep 23 bits and add one half: (k + 0.5) / 2^23 needs 24 significant bits, exactly what float32
    has, so the largest value is 1 - 2^-24, never 1 (with 24 bits, k + 0.5 would round up to 2^24).
    """
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))
