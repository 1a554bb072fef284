"""Checks for lab 02: rotary embeddings, grouped-query attention and top-p filtering."""

from __future__ import annotations

import random

import torch

from ..layers import Attention, AttentionMetadata, RotaryEmbedding
from ..sampling import SamplingParams, filtered_probs
from ..sampling.sampler import SamplingMetadata
from .checker import check
from .hints import Hints


def _close(atol: float):
    def equal(got, want):
        return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, atol=atol)
    return equal


def _pair_close(atol: float):
    inner = _close(atol)
    return lambda got, want: isinstance(got, tuple) and len(got) == 2 and all(inner(g, w) for g, w in zip(got, want))


def check_rope(fn, cases: int = 50):
    """fn(q, k, positions, base) -> (q', k'): q [T, Hq, D], k [T, Hkv, D] rotated, HF's rotate-half layout."""

    def case(rng: random.Random):
        T, D = rng.randint(1, 40), rng.choice([8, 16, 64])
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        q = torch.randn(T, rng.choice([1, 4]), D, generator=g)
        k = torch.randn(T, rng.choice([1, 2]), D, generator=g)
        positions = torch.randint(0, 500, (T,), generator=g)
        return q, k, positions, rng.choice([10000.0, 100000.0])

    def reference(q, k, positions, base):
        return RotaryEmbedding(q.shape[-1], 512, base)(positions, q, k)

    return check("rope", fn, reference, case, cases=cases, equal=_pair_close(1e-5))


def check_gqa_attention(fn, cases: int = 50):
    """fn(q, k, v) -> [T, Hq * D]: causal attention of one sequence, each KV head shared by Hq/Hkv query heads."""

    def case(rng: random.Random):
        T, D, Hkv = rng.randint(1, 33), rng.choice([8, 16]), rng.choice([1, 2, 3])
        Hq = Hkv * rng.choice([1, 2, 3])
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        return torch.randn(T, Hq, D, generator=g), torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g)

    def reference(q, k, v):
        T, Hq, D = q.shape
        meta = AttentionMetadata.from_seq_lens([T])
        return Attention(Hq, D, k.shape[1])(q, k, v, torch.arange(T), meta)

    return check("gqa_attention", fn, reference, case, cases=cases, equal=_close(1e-5))


def check_top_p(fn, cases: int = 100):
    """fn(logits [V], top_p) -> probabilities [V]: the smallest set of most likely tokens whose
    probability reaches top_p, renormalised; every other token 0."""

    def case(rng: random.Random):
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        return torch.randn(rng.randint(2, 300), generator=g) * rng.uniform(0.5, 4), rng.choice([0.1, 0.5, 0.8, 0.95, 1.0])

    def reference(logits, top_p):
        meta = SamplingMetadata.build([SamplingParams(top_p=top_p)], [[]], [[]], [0], [[]], logits.numel(), "cpu")
        return filtered_probs(logits[None], meta)[0]

    return check("top_p", fn, reference, case, cases=cases, equal=_close(1e-6))


hint = Hints("02", {
    "rope": (
        'Each pair of dimensions (i, i + D/2) is rotated by an angle that grows with the position.',
        "inv_freq = base^(-2i/D) for i < D/2; angle = position × inv_freq, repeated to D columns. x' = x·cos + rotate_half(x)·sin, with rotate_half(x) = cat(-x2, x1) of the two halves.",
        'inv_freq = 1 / base ** (torch.arange(0, D, 2).float() / D)\nangles = positions.float()[:, None] * inv_freq\nemb = torch.cat([angles, angles], -1); cos, sin = emb.cos()[:, None], emb.sin()[:, None]\nreturn q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin',
    ),
    "gqa_attention": (
        'Make each KV head serve Hq/Hkv query heads, then it is ordinary causal attention.',
        'repeat_interleave K and V along the head dim by group = Hq // Hkv (head h uses KV head h // group). Scores [Hq, T, T] scaled by 1/sqrt(D); mask the upper triangle with -inf before the softmax.',
        "k = k.repeat_interleave(group, 1); v = v.repeat_interleave(group, 1)\ns = torch.einsum('thd,shd->hts', q, k) / D**0.5\ns = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -inf)\nreturn torch.einsum('hts,shd->thd', s.softmax(-1), v).reshape(T, Hq * D)",
    ),
    "top_p_filter": (
        'Sort the probabilities; keep the most likely tokens until their mass reaches top_p.',
        'A token is kept if the mass ranked strictly above it is below top_p (so the token that crosses top_p stays). cumsum - itself gives that mass. Scatter back to the original order and renormalise.',
        'sp, order = probs.sort(descending=True)\nbefore = sp.cumsum(-1) - sp\nsp = sp.masked_fill(before >= top_p, 0)\nkept = torch.zeros_like(probs).scatter(0, order, sp); return kept / kept.sum()',
    ),
})
