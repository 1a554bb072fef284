"""Checks for lab 04: the online-softmax update, and the inner loop of a FlashAttention tile in Triton.

The Triton check runs the student's kernel natively on a CUDA GPU, or under Triton's CPU
interpreter (TRITON_INTERPRET=1, set before triton is imported) elsewhere, and compares it with
minillm's plain-PyTorch attention reference.
"""

from __future__ import annotations

import math
import os
import random

import torch

from ..kernels.flash_attn import flash_attn_varlen_ref
from .checker import check
from .hints import Hints


def check_online_softmax(fn, cases: int = 60):
    """fn(m, l, acc, s, v) -> (m, l, acc): fold one tile of scores s [M, N] and values v [N, D] into
    the running row max m [M], running sum l [M] (of exp(score - m)) and running output acc [M, D]
    (the sum of exp(score - m) * v, not yet divided by l). Checked by feeding a whole row of scores
    through it tile by tile, from m = -inf, l = 0, acc = 0: the state must end as max, sum and
    softmax(S) @ V times the sum."""

    def case(rng: random.Random):
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        M, N, D = rng.randint(1, 8), rng.randint(1, 90), rng.choice([1, 4, 16])
        scale = rng.choice([1.0, 5.0, 30.0])  # large scores: exp without the max would overflow
        return torch.randn(M, N, generator=g, dtype=torch.float64) * scale, torch.randn(N, D, generator=g, dtype=torch.float64), rng.randint(1, 17)

    def run(step):
        def over_tiles(s, v, tile):
            M, D = s.shape[0], v.shape[1]
            m = torch.full((M,), -math.inf, dtype=s.dtype)
            l, acc = torch.zeros(M, dtype=s.dtype), torch.zeros(M, D, dtype=s.dtype)
            for start in range(0, s.shape[1], tile):
                m, l, acc = step(m, l, acc, s[:, start:start + tile], v[start:start + tile])
            return m, l, acc / l[:, None]
        return over_tiles

    def reference(s, v, tile):
        m = s.amax(dim=1)  # [M]
        return m, torch.exp(s - m[:, None]).sum(dim=1), s.softmax(dim=1) @ v

    def close(got, want):
        return (isinstance(got, tuple) and len(got) == 3
                and all(isinstance(g, torch.Tensor) and g.shape == w.shape and torch.allclose(g, w, rtol=1e-9, atol=1e-9)
                        for g, w in zip(got, want)))

    return check("online_softmax", run(fn), reference, case, cases=cases, equal=close)


def launch_attention_tile(kernel, q, k, v, BLOCK_M: int = 16, BLOCK_N: int = 16):
    """Run kernel over one head: q [M, D], k, v [N, D] -> [M, D], non-causal softmax(q k^T / sqrt(D)) v.

    The kernel's arguments: Q, K, V, Out pointers, seqlen_q, seqlen_k, the scale times log2(e), the
    row strides of Q, K, V and Out, then BLOCK_M, BLOCK_N, HEAD_DIM as constexprs. One program per
    BLOCK_M queries.
    """
    import triton

    out = torch.empty_like(q)
    M, D = q.shape
    grid = (triton.cdiv(M, BLOCK_M),)
    kernel[grid](q, k, v, out, M, k.shape[0], D**-0.5 * math.log2(math.e), q.stride(0), k.stride(0), v.stride(0),
                 out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D)
    return out


def check_attention_tile(kernel, cases: int | None = None):
    """kernel: the @triton.jit FlashAttention tile of the lab (see launch_attention_tile)."""
    gpu = torch.cuda.is_available()
    if not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("no CUDA GPU: set TRITON_INTERPRET=1 before importing triton (the lab's first cell "
                           "does) so the kernel runs in Triton's CPU interpreter, then restart the kernel")
    device, dtype = ("cuda", torch.float16) if gpu else ("cpu", torch.float32)
    cases = cases or (40 if gpu else 8)

    def case(rng: random.Random):
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        M, D = rng.randint(1, 70), rng.choice([16, 32, 64])
        N = M + rng.randint(0, 100)  # at least as many keys as queries, as in any prefill
        q, k, v = (torch.randn(n, D, generator=g).to(device, dtype) for n in (M, N, N))
        return q, k, v

    def student(q, k, v):
        return launch_attention_tile(kernel, q, k, v)

    def reference(q, k, v):
        M, N = q.shape[0], k.shape[0]
        cu_q = torch.tensor([0, M], dtype=torch.int32, device=q.device)
        cu_k = torch.tensor([0, N], dtype=torch.int32, device=q.device)
        return flash_attn_varlen_ref(q[:, None], k[:, None], v[:, None], cu_q, M, cu_seqlens_k=cu_k,
                                     causal=False)[:, 0]  # [M, D]

    tol = 2e-3 if gpu else 1e-5

    def close(got, want):
        return (isinstance(got, torch.Tensor) and got.shape == want.shape
                and torch.allclose(got.float(), want.float(), atol=tol, rtol=tol))

    where = "natively on the GPU" if gpu else "in Triton's CPU interpreter"
    print(f"running the kernel {where}")
    return check("attention_tile", student, reference, case, cases=cases, equal=close)


hint = Hints("04", {
    "online_softmax_step": (
        'Keep a running maximum m, a running sum l and an unnormalized output acc; a new tile may raise m.',
        'm_new = max(m, row max of s). Everything accumulated so far was scaled by exp(-m); rescale it by alpha = exp(m - m_new). The tile adds p = exp(s - m_new): l += p.sum(1), acc += p @ v.',
        'm_new = torch.maximum(m, s.amax(1)); alpha = torch.exp(m - m_new); p = torch.exp(s - m_new[:, None])\nreturn m_new, l * alpha + p.sum(1), acc * alpha[:, None] + p @ v',
    ),
    "attention_tile": (
        'The kernel loops over key tiles of BLOCK_N rows; inside, it is exercise 1 in Triton.',
        'Per tile: load K and V rows start..start+BLOCK_N with a mask (rows < seqlen_k), s = tl.dot(q, tl.trans(k)) * qk_scale, set s to -inf past seqlen_k, then the online-softmax update with tl.exp2 (the scale is in log2 units) and acc += tl.dot(p.to(v.dtype), v).',
        "k = tl.load(K + rows[:, None] * stride_k + offs_d[None, :], mask=inside, other=0.0)\ns = tl.dot(q, tl.trans(k)) * qk_scale; s = tl.where(rows[None, :] < seqlen_k, s, float('-inf'))\nm_new = tl.maximum(m_i, tl.max(s, 1)); alpha = tl.exp2(m_i - m_new); p = tl.exp2(s - m_new[:, None])\nl_i = l_i * alpha + tl.sum(p, 1); acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v); m_i = m_new",
    ),
})
