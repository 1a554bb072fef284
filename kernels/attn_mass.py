"""Attention mass per cached token, in Triton: what H2O (chapter 15) ranks a sequence's KV blocks by.

H2O (Zhang et al., 2023) keeps the "heavy hitters": the cached tokens that have received the most
attention so far. For one attention layer and one step, the mass of key j of sequence b is the
probability every query of the step gave it, summed over the step's queries and the query heads:

    mass[b, j] = sum_{query i of b} sum_{head h} softmax_j(q_ih . k_j * scale)     (j visible to i)

Query i of a step of n queries over L keys sees keys j <= L - n + i (queries aligned to the end of
the keys: the step's own tokens are already in the cache, as in flash_attn.py). The attention kernels
never write their probabilities, so this recomputes them after the layer's attention, in two kernels:

  1. `_lse_kernel`, one program per (query token, KV head): the log of each query head's softmax
     denominator, lse = m + log(sum_j exp(s_j - m)) (an online max and sum over the row's key blocks,
     as in flash_decode.py), every query head of the KV head's group in one [G, D] tile.
  2. `_mass_kernel`, one program per (sequence, key block): for each KV head and each of the
     sequence's queries, p_j = exp(s_j - lse) for the block's keys, summed into mass[b, keys of the
     block]. Each program owns its keys, so it adds to what earlier layers left there (load, add,
     store) with no atomics: the sums come out in the same order on every run.

Keys are read through the block table as everywhere ([num_blocks, block_size, Hkv, D]; key j of row b
is row j % block_size of block block_table[b, j // block_size]), so the table may be compacted
(worker/kv_compaction.py): mass[b, j] is then per compacted key. A float cache only (the caller
refuses a quantized one). `attention_mass_ref` is the plain-PyTorch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lse_kernel(q_ptr, k_ptr, table_ptr, lens_ptr, row_ptr, limit_ptr, lse_ptr, scale,
                stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb,
                G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    t, h = tl.program_id(0), tl.program_id(1)
    b = tl.load(row_ptr + t)
    limit = tl.load(limit_ptr + t)  # keys [0, limit) are visible to this query
    g, d, s = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_S)
    q = tl.load(q_ptr + t * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=(g[:, None] < G) & (d[None, :] < D), other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_G], tl.float32)
    for blk in range(0, tl.cdiv(limit, BS)):
        block = tl.load(table_ptr + b * stride_tb + blk)
        k = tl.load(k_ptr + block * stride_kb + s[:, None] * stride_ks + h * stride_kh + d[None, :],
                    mask=(s[:, None] < BS) & (d[None, :] < D), other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_S]
        scores = tl.where(((blk * BS + s) < limit)[None, :] & (s < BS)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        acc = acc * tl.exp(m - m_new) + tl.sum(tl.exp(scores - m_new[:, None]), axis=1)
        m = m_new
    tl.store(lse_ptr + t * (G * tl.num_programs(1)) + h * G + g, m + tl.log(acc), mask=g < G)


@triton.jit
def _mass_kernel(q_ptr, k_ptr, table_ptr, lens_ptr, cu_ptr, lse_ptr, mass_ptr, scale, num_kv_heads,
                 stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_mb,
                 G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b, blk = tl.program_id(0), tl.program_id(1)
    L = tl.load(lens_ptr + b)
    if blk * BS >= L:
        return
    first, last = tl.load(cu_ptr + b), tl.load(cu_ptr + b + 1)
    n = last - first
    block = tl.load(table_ptr + b * stride_tb + blk)
    g, d, s = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_S)
    key = blk * BS + s  # [BLOCK_S] this program's keys
    total = tl.zeros([BLOCK_S], tl.float32)
    for h in range(0, num_kv_heads):
        k = tl.load(k_ptr + block * stride_kb + s[:, None] * stride_ks + h * stride_kh + d[None, :],
                    mask=(s[:, None] < BS) & (d[None, :] < D), other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_D]
        for i in range(0, n):
            t = first + i
            q = tl.load(q_ptr + t * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                        mask=(g[:, None] < G) & (d[None, :] < D), other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_D]
            lse = tl.load(lse_ptr + t * (G * num_kv_heads) + h * G + g, mask=g < G, other=float("inf"))
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_S]
            seen = (key <= L - n + i) & (s < BS)  # [BLOCK_S] causal: queries aligned to the end of the keys
            p = tl.where(seen[None, :] & (g < G)[:, None], tl.exp(scores - lse[:, None]), 0.0)
            total += tl.sum(p, axis=0)
    ptrs = mass_ptr + b * stride_mb + key
    keep = (s < BS) & (key < L)
    tl.store(ptrs, tl.load(ptrs, mask=keep, other=0.0) + total, mask=keep)


def _query_rows(cu_seqlens: torch.Tensor, seq_lens: torch.Tensor):
    """Each query token's sequence, and how many keys it sees: -> ([T], [T]) int32."""
    n = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [B] queries per sequence
    row = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n)  # [T]
    t = torch.arange(row.numel(), device=n.device)
    limit = seq_lens.long()[row] - (cu_seqlens[1:].long()[row] - t) + 1  # [T] keys [0, limit) visible
    return row.to(torch.int32), limit.to(torch.int32)


def attention_mass(mass: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Add this layer's attention mass to `mass` [B, >= max seq_len] fp32, in place; -> mass.
    q: [T, Hq, D] (as the attention kernels got it); k_cache: [num_blocks, block_size, Hkv, D]."""
    T, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    row, limit = _query_rows(cu_seqlens, seq_lens)
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device)  # [T, Hq]
    table = block_table.to(torch.int32).contiguous()
    sizes = dict(G=G, D=D, BS=BS, BLOCK_G=triton.next_power_of_2(G), BLOCK_D=triton.next_power_of_2(D),
                 BLOCK_S=triton.next_power_of_2(BS))
    _lse_kernel[(T, Hkv)](q, k_cache, table, seq_lens, row, limit, lse, scale, q.stride(0), q.stride(1),
                          k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table.stride(0), **sizes)
    _mass_kernel[(seq_lens.numel(), table.shape[1])](
        q, k_cache, table, seq_lens, cu_seqlens, lse, mass, scale, Hkv, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table.stride(0), mass.stride(0), **sizes)
    return mass


def attention_mass_ref(mass: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """The plain-PyTorch reference of attention_mass: each sequence's keys gathered, softmax, summed."""
    _, BS, Hkv, D = k_cache.shape
    G = q.shape[1] // Hkv
    for b in range(seq_lens.numel()):
        L, first, last = int(seq_lens[b]), int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        n = last - first
        blocks = block_table[b, : -(-L // BS)].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:L].float().repeat_interleave(G, 1)  # [L, Hq, D]
        s = torch.einsum("qhd,khd->hqk", q[first:last].float(), k) * scale  # [Hq, n, L]
        visible = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]  # [n, L]
        p = s.masked_fill(~visible.to(s.device)[None], float("-inf")).softmax(-1)  # [Hq, n, L]
        mass[b, :L] += p.sum((0, 1))
    return mass
