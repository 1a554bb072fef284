"""The plain-PyTorch reference of flash_attn.py: attention one sequence at a time, the whole score
matrix in fp32. It is the oracle the Triton kernels are tested against (and what the layers run
on a CPU), so it is written for clarity, not speed: gather each sequence's keys (from a packed
stream or through a block table), mask, softmax, multiply.
"""

from __future__ import annotations

import torch

from .checks import check_varlen
from .store_kv import dequantize_kv_ref


def gather_kv(k, v, b: int, seqlen_k: int, *, cu_seqlens_k=None, block_table=None, k_scale=None, v_scale=None):
    """Sequence b's first seqlen_k keys and values as [seqlen_k, Hkv, D] copies (reference only); from
    a quantized cache (k_scale, v_scale given), dequantized to fp32: only these rows, never the cache."""
    if block_table is None:
        start = int(cu_seqlens_k[b])
        return k[start:start + seqlen_k], v[start:start + seqlen_k]
    j = torch.arange(seqlen_k, device=k.device)  # key positions
    block_size = k.shape[1]
    rows = block_table[b].long()[j // block_size] * block_size + j % block_size  # [seqlen_k] flat cache rows
    # one index into the cache seen flat (a view): indexing [blocks, offsets] with two index tensors
    # costs PyTorch's CPU ~250x more on a big pool (5 ms against 20 us for 40 keys of a 512 MiB cache)
    k_b, v_b = k.flatten(0, 1)[rows], v.flatten(0, 1)[rows]  # [seqlen_k, Hkv, D]
    if k_scale is not None:
        k_b, v_b = dequantize_kv_ref(k_b, k_scale), dequantize_kv_ref(v_b, v_scale)  # [seqlen_k, Hkv, D] fp32
    return k_b, v_b


def attention_ref(q, k, v, scale: float, causal: bool, sliding_window):
    """One sequence: q [Lq, Hq, D], k, v [Lk, Hkv, D] -> (out [Lq, Hq, D] fp32, lse [Hq, Lq] fp32)."""
    Lq, Hq, _ = q.shape
    Lk, Hkv, _ = k.shape
    k = k.float().repeat_interleave(Hq // Hkv, dim=1)  # [Lk, Hq, D]: query head h uses KV head h // group
    v = v.float().repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [Hq, Lq, Lk]
    q_pos = torch.arange(Lk - Lq, Lk, device=q.device)[:, None]  # [Lq, 1] bottom-right aligned
    k_pos = torch.arange(Lk, device=q.device)[None, :]  # [1, Lk]
    visible = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Lq]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)  # [Lq, Hq, D]
    return out, lse


def flash_attn_varlen_ref(q, k, v, cu_seqlens_q, max_seqlen_q, *, cu_seqlens_k=None, seqused_k=None,
                          block_table=None, softmax_scale=None, causal=True, sliding_window=None,
                          return_lse=False, k_scale=None, v_scale=None):
    """flash_attn_varlen in plain PyTorch: one sequence at a time, the whole score matrix in fp32."""
    paged = check_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, seqused_k, block_table,
                          sliding_window, False, k_scale, v_scale)
    Tq, Hq, D = q.shape
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.empty((Tq, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((Hq, Tq), dtype=torch.float32, device=q.device)
    cu_q = cu_seqlens_q.tolist()
    for b in range(len(cu_q) - 1):
        q_b = q[cu_q[b]:cu_q[b + 1]]  # [Lq, Hq, D]
        Lk = int(seqused_k[b]) if paged else int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        if Lk < q_b.shape[0]:
            raise ValueError(f"sequence {b} has {q_b.shape[0]} queries but only {Lk} keys (need Lk >= Lq)")
        k_b, v_b = gather_kv(k, v, b, Lk, cu_seqlens_k=cu_seqlens_k,
                             block_table=block_table if paged else None, k_scale=k_scale,
                             v_scale=v_scale)  # [Lk, Hkv, D]
        o_b, lse_b = attention_ref(q_b, k_b, v_b, scale, causal, sliding_window)
        out[cu_q[b]:cu_q[b + 1]] = o_b.to(q.dtype)
        lse[:, cu_q[b]:cu_q[b + 1]] = lse_b
    return (out, lse) if return_lse else out
