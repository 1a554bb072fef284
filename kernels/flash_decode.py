"""FlashDecoding in Triton: one new token per sequence attending over its whole KV cache, split-KV.

A decode step has one query per sequence. Its attention is a matrix-vector product over the cache:
every cached key and value is read once and used for a handful of FLOPs, so the only question is
whether the kernel reads the cache at the memory's full speed. Two things stand in the way.

Too few programs. FlashAttention's grid (query tiles x heads) has one query tile per sequence here:
batch x heads programs. Eight sequences of a model with 8 KV heads make 64 programs for a GPU with
132 SMs, each walking 16k keys alone: half the machine idles. FlashDecoding (Dao et al., 2023) also
splits the keys: program (b, kv_head, split) takes one slice of sequence b's keys and computes a
partial result over it, as if those were the only keys:

    o_s = softmax(q K_s^T) V_s      lse_s = log sum_j exp(q.k_j), j in slice s

A second, tiny kernel merges the slices. The full softmax over all keys weighs each slice by its
share of the total denominator, exp(lse_s) / sum_t exp(lse_t), so

    out = sum_s w_s o_s,    w_s = exp(lse_s - M) / sum_t exp(lse_t - M),    M = max_s lse_s

(subtracting M is the same overflow guard as the online softmax). A slice that got no keys (a short
sequence in a batch of long ones) has lse = -inf and weight 0. choose_num_splits picks the number of
slices: enough programs for about two waves over the SMs, none when batch x heads already fills it.

The merge need not be a second launch (chapter 13). At batch 1 a launch costs as much as the work,
and a CUDA graph must size the grid from the block table's width, not from the sequence's length, so
it splits even a short context. So each program, having stored its partial, takes a ticket from an
atomic counter for its (sequence, KV head); the one that draws the last ticket knows every other
split's partial is written, merges them (the sum above, as an online merge over chunks of splits,
every query head of the group in one load per chunk) and resets the counter to 0 for the next launch.
The stores are ordered before the ticket by a barrier and the atomic's release; the merger's loads
after its acquire, bypassing L1.
The grid is fixed, but a sequence need not use all of it: it takes one split per SPLIT_GRAIN keys, up
to the grid's count, and the rest do nothing. A short context then runs in one split, which writes
the output itself: one kernel, no partials, no merge.

Reading each KV head once. With grouped-query attention, Hq / Hkv query heads share one KV head. A
program serves the whole group: it loads the group's query rows as one [BLOCK_H, D] tile (padded to
16 rows, the least tl.dot takes; the padding rows are zeros and never stored) and multiplies every
K/V tile it loads by all of them. Per-query-head programs would read the same cache bytes Hq / Hkv
times. Keys come from the cache [num_blocks, block_size, Hkv, D] through the block table, as in
flash_attn.py: key j of sequence b is row j % block_size of block block_table[b, j // block_size].

The new token is already in the cache (seqused_k[b] keys, itself the last, at position
seqused_k[b] - 1), so causality excludes nothing; a sliding window of W keeps the last W keys.

A quantized cache (fp8 e4m3 or int8, chapter 08) is read as it is stored, one byte a number: each
K/V tile is loaded, cast to q's dtype (exact: 3 mantissa bits or 8-bit integers fit bf16) and
dequantized by the KV head's scale (k_scale[h], v_scale[h], fp32) without ever writing a dequantized
copy. One scale per program, so the multiply moves out of the loop: q.(s_k k) = s_k (q.k) folds s_k
into the softmax scale, and sum_j p_j (s_v v_j) = s_v sum_j p_j v_j scales the output once. Decode
reads half the bytes of a bf16 cache, which is the whole point: it is memory-bound.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..checks import is_int
from .attention_ref import attention_ref, gather_kv
from .checks import INTERPRET, check_index, check_qkv, check_window
from .flash_attn import LOG2E, dot, prune_fp32

MAX_SPLITS = 64
# The smallest key tile of the configs below: a split shorter than one tile is pure overhead.
SPLIT_GRAIN = 16 if INTERPRET else 64


def _configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=1)]
    # Memory-bound: wide tiles and several loads in flight (num_stages) are what matter.
    shapes = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in shapes]


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "BLOCK_H", "SINGLE_SPLIT", "keys_bucket"],
                 prune_configs_by={"early_config_prune": prune_fp32})
@triton.jit(do_not_specialize=["num_splits"])  # one compiled kernel for every split count
def _flash_decode_split(
    Q, K, V, Out, O_part, Lse_part,  # q, out [B, Hq, D]; caches; partials [B, Hq, S, D], [B, Hq, S]
    seqused_k, block_table,  # int32 [B], [B, max_blocks]
    Counters,  # int32 [>= B * Hkv], zero between launches (FUSED_COMBINE): splits finished per (b, kv_head)
    K_scale, V_scale,  # fp32 [Hkv]: a quantized cache's scales (None otherwise)
    stride_q_seq, stride_q_head,
    stride_k_blk, stride_k_tok, stride_k_head,
    stride_v_blk, stride_v_tok, stride_v_head,
    stride_o_seq, stride_o_head, stride_bt,
    num_heads, group, block_size, window, num_splits, qk_scale,
    keys_bucket,  # not used by the kernel: part of the autotuning key only
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, HAS_WINDOW: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    IEEE: tl.constexpr, QUANT_KV: tl.constexpr, FUSED_COMBINE: tl.constexpr, SPLIT_GRAIN: tl.constexpr,
    GROUP: tl.constexpr, MERGE_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # chapter 18: launched under the previous kernel's tail (q and the new K/V are its output)
        gdc_wait()
        gdc_launch_dependents()  # the o_proj GEMV after it may start streaming its weights now
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2)
    v_scale = 1.0  # (unused unless QUANT_KV)
    if QUANT_KV:  # dequantize by folding the head's scales in: K's into the softmax scale, V's at the end
        qk_scale = qk_scale * tl.load(K_scale + kv_head)
        v_scale = tl.load(V_scale + kv_head)
    seqlen_k = tl.load(seqused_k + b)
    start = 0
    if HAS_WINDOW:  # the query at position seqlen_k - 1 sees the last `window` keys
        start = tl.maximum(seqlen_k - window, 0)
    # How many splits this sequence uses. The grid is sized for the longest sequence the block table
    # allows (a CUDA graph cannot resize it). With the merge in the kernel, a sequence takes only as many
    # splits as it has SPLIT_GRAIN-key slices: the others skip their loop and store nothing, and the
    # merge waits for and reads only the active ones. One active split writes the final output itself,
    # with no partials and no merge. Chapter 04's separate combine kernel reads every split, so without
    # FUSED_COMBINE every split takes part.
    span = seqlen_k - start
    n_active = num_splits
    if FUSED_COMBINE:
        n_active = tl.maximum(tl.minimum(num_splits, tl.cdiv(span, SPLIT_GRAIN)), 1)  # a padding row: 0 keys
    active = split < n_active
    # This split's slice of the visible keys [start, seqlen_k), whole tiles except at the end.
    # Split 0 is never empty; later active ones may be (lo >= hi: the loop runs zero times).
    per_split = tl.cdiv(tl.cdiv(span, n_active), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.where(active, tl.minimum(lo + per_split, seqlen_k), lo)

    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H] rows: the query heads of this KV head's group
    offs_d = tl.arange(0, HEAD_DIM)
    head_ok = offs_h < group
    heads = kv_head * group + offs_h
    q = tl.load(Q + b.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)  # [BLOCK_H, HEAD_DIM]; padding rows are 0
    K += kv_head.to(tl.int64) * stride_k_head
    V += kv_head.to(tl.int64) * stride_v_head
    bt_row = block_table + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, base 2 (flash_attn.py)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        in_range = offs_n < hi
        block = tl.load(bt_row + offs_n // block_size, mask=in_range, other=0).to(tl.int64)
        slot = (offs_n % block_size).to(tl.int64)
        k = tl.load(K + (block * stride_k_blk + slot * stride_k_tok)[None, :] + offs_d[:, None],
                    mask=in_range[None, :], other=0.0)  # [HEAD_DIM, BLOCK_N], K transposed
        v = tl.load(V + (block * stride_v_blk + slot * stride_v_tok)[:, None] + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
        if QUANT_KV:  # fp8/int8 -> q's dtype, exactly (the scales are applied outside the loop)
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)
        qk = dot(q, k, None, IEEE)  # [BLOCK_H, BLOCK_N]
        qk = tl.where(in_range[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: a tile holds at least one key in range
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new

    if QUANT_KV:
        acc = acc * v_scale  # a quantized V's scale, once per program
    if SINGLE_SPLIT:  # the whole sequence in one program: the result is final
        _store_final(Out, acc, l_i, b, heads, head_ok, offs_d, stride_o_seq, stride_o_head)
    elif n_active == 1:  # a short sequence in a many-split grid: split 0 had every key
        if split == 0:
            _store_final(Out, acc, l_i, b, heads, head_ok, offs_d, stride_o_seq, stride_o_head)
    elif active:
        # An empty split has l = 0: store o = 0 (not 0/0 = NaN, which a 0 weight would not cancel:
        # 0 * NaN is NaN) and lse = -inf, which gives it weight 0 in the merge.
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        row = (b * num_heads + heads).to(tl.int64) * num_splits + split  # [BLOCK_H] into [B, Hq, S]
        tl.store(O_part + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
                 mask=head_ok[:, None])
        tl.store(Lse_part + row, tl.where(empty, float("-inf"), m_i + tl.log2(l_safe)), mask=head_ok)
        if FUSED_COMBINE:  # the last split of (b, kv_head) to finish merges them all: no second kernel
            # Every thread's partial stores are issued before the counter moves (the barrier), and the
            # atomic's release/acquire orders them for the program that draws the last ticket.
            tl.debug_barrier()
            counter = Counters + b * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == n_active - 1:
                _merge_splits(O_part, Lse_part, Out, b, kv_head, group, num_heads, num_splits, n_active,
                              stride_o_seq, stride_o_head, HEAD_DIM, GROUP, MERGE_CHUNK)
                tl.store(counter, 0)  # zero again for the next launch (a CUDA graph replays this one)


@triton.jit
def _merge_splits(O_part, Lse_part, Out, b, kv_head, group, num_heads, num_splits, n_active,
                  stride_o_seq, stride_o_head, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr):
    """out = sum_s w_s o_s for the group's query heads over their n_active splits, as an online merge over
    chunks of CHUNK splits: a chunk of every head is one [GROUP, CHUNK, HEAD_DIM] load, so the merger
    waits for memory once per chunk, not once per split or head (an empty split's lse is -inf: weight
    0). The partials were written by other programs in this launch: loaded past L1 (.cg)."""
    offs_g = tl.arange(0, GROUP)  # GROUP: the group's size rounded up to a power of two
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    head_ok = offs_g < group
    heads = kv_head * group + offs_g
    rows = (b * num_heads + heads).to(tl.int64) * num_splits  # [GROUP] into [B, Hq, S]
    m = tl.full([GROUP], float("-inf"), tl.float32)  # running max, base 2
    l = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM], tl.float32)
    for s0 in range(0, n_active, CHUNK):
        ok = head_ok[:, None] & (s0 + offs_c < n_active)[None, :]  # [GROUP, CHUNK]
        idx = rows[:, None] + s0 + offs_c[None, :]  # [GROUP, CHUNK] into [B, Hq, S]
        lse = tl.load(Lse_part + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(O_part + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None], other=0.0,
                    cache_modifier=".cg")  # [GROUP, CHUNK, HEAD_DIM]
        # finite for a real head (its split 0 is never empty); 0 for the padding rows, which are not stored
        m_new = tl.where(head_ok, tl.maximum(m, tl.max(lse, 1)), 0.0)
        w = tl.exp2(lse - m_new[:, None])  # [GROUP, CHUNK]
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        m = m_new
    tl.store(Out + b.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :],
             (acc / l[:, None]).to(Out.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _store_final(Out, acc, l_i, b, heads, head_ok, offs_d, stride_o_seq, stride_o_head):
    out = acc / l_i[:, None]  # [BLOCK_H, HEAD_DIM]
    tl.store(Out + b.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _flash_decode_combine(
    O_part, Lse_part, Out,  # [B, Hq, S, D] fp32, [B, Hq, S] fp32 (base 2), out [B, Hq, D]
    stride_o_seq, stride_o_head, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,  # SPLITS: num_splits rounded up to a power of two
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = (b * num_heads + h).to(tl.int64) * num_splits
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, HEAD_DIM)
    split_ok = offs_s < num_splits
    lse = tl.load(Lse_part + row + offs_s, mask=split_ok, other=float("-inf"))  # [SPLITS]
    m = tl.max(lse, 0)  # finite: split 0 always has keys
    w = tl.exp2(lse - m)  # [SPLITS]: each slice's denominator relative to the largest; 0 for empty ones
    o = tl.load(O_part + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=split_ok[:, None],
                other=0.0)  # [SPLITS, HEAD_DIM]
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)  # [HEAD_DIM]
    tl.store(Out + b.to(tl.int64) * stride_o_seq + h * stride_o_head + offs_d, out.to(Out.dtype.element_ty))


def choose_num_splits(batch: int, num_kv_heads: int, max_seqlen_k: int, num_sms: int) -> int:
    """How many slices to cut each sequence's keys into: enough (batch x kv_heads x splits) programs
    for about two waves over the SMs (two programs per SM keep more loads in flight than one, and
    even out the tail), but no slice shorter than a key tile and at most MAX_SPLITS."""
    programs = batch * num_kv_heads
    if programs >= 2 * num_sms:  # the machine is already full without splitting
        return 1
    wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(wanted, triton.cdiv(max_seqlen_k, SPLIT_GRAIN), MAX_SPLITS))


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: any small number, so the tests exercise several splits


def _check_decode(q, k_cache, v_cache, seqused_k, block_table, sliding_window, num_splits, strict: bool,
                  k_scale=None, v_scale=None):
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be [batch, num_heads, head_dim], got {getattr(q, 'shape', q)!r}")
    check_qkv(q, k_cache, v_cache, 4, strict, k_scale, v_scale)
    B = q.shape[0]
    check_index("seqused_k", seqused_k, (B,), strict)
    check_index("block_table", block_table, (B, None), strict)
    check_window(sliding_window)
    if num_splits is not None and not (is_int(num_splits) and num_splits >= 1):
        raise ValueError(f"num_splits must be None (choose) or a positive int, got {num_splits!r}")


# Per device: one int32 counter per (sequence, KV head), zero between launches (the merging program
# zeroes its own again). Old buffers are kept: a captured CUDA graph holds their addresses.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters, made once per device (before any capture: the
    engine's warm-up runs each shape eagerly first) and reused by every layer and step after."""
    kept = _COUNTERS.setdefault(device, [])
    if not kept or kept[-1].numel() < n:
        kept.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return kept[-1]


def flash_decode(q, k_cache, v_cache, seqused_k, block_table, *, softmax_scale=None, sliding_window=None,
                 num_splits=None, k_scale=None, v_scale=None, fused_combine=True, pdl=False):
    """One query per sequence over its cached keys: q [B, Hq, D] -> out [B, Hq, D] in q's dtype.

    Caches [num_blocks, block_size, Hkv, D]; seqused_k [B] int32 counts each sequence's keys, the new
    token's included; block_table [B, max_blocks] int32. num_splits: None chooses (choose_num_splits).
    An fp8/int8 cache needs k_scale, v_scale (fp32 [Hkv]). fused_combine: with several splits, the
    last split of each (sequence, KV head) to finish merges them (one launch; launches on one device
    must then not run concurrently on two streams, as they share the counters); False launches
    chapter 04's separate combine kernel. pdl: launched with programmatic dependent launch (chapter 18;
    a Hopper GPU, not the interpreter; the separate combine kernel is launched without).
    """
    _check_decode(q, k_cache, v_cache, seqused_k, block_table, sliding_window, num_splits, True, k_scale, v_scale)
    B, Hq, D = q.shape
    Hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    # The longest a sequence can be, from shapes alone: reading seqused_k would wait for the GPU.
    max_keys = block_table.shape[1] * block_size
    if sliding_window is not None:
        max_keys = min(max_keys, sliding_window)
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, max_keys, sm_count(q.device))
    single = num_splits == 1
    o_part = lse_part = None
    if not single:
        o_part = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    group = Hq // Hkv
    fused = fused_combine and not single
    counters = split_counters(q.device, B * Hkv) if fused else None
    _flash_decode_split[(num_splits, Hkv, B)](
        q, k_cache, v_cache, out, o_part, lse_part, seqused_k, block_table, counters, k_scale, v_scale,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        block_table.stride(0), Hq, group, block_size, sliding_window or 0, num_splits, scale * LOG2E,
        min(max(16, triton.next_power_of_2(triton.cdiv(max_keys, num_splits))), 8192),
        HEAD_DIM=D, BLOCK_H=max(16, triton.next_power_of_2(group)), HAS_WINDOW=sliding_window is not None,
        SINGLE_SPLIT=single, IEEE=q.dtype == torch.float32, QUANT_KV=k_scale is not None, FUSED_COMBINE=fused,
        # the merge's [GROUP, MERGE_CHUNK, D] fp32 tile: about 8k numbers, no more splits than the grid has
        SPLIT_GRAIN=SPLIT_GRAIN, GROUP=triton.next_power_of_2(group),
        MERGE_CHUNK=min(triton.next_power_of_2(num_splits), max(1, 8192 // (triton.next_power_of_2(group) * D))),
        **({"PDL": True, "launch_pdl": True} if pdl else {}),
    )
    if not single and not fused:
        _flash_decode_combine[(B, Hq)](o_part, lse_part, out, out.stride(0), out.stride(1), Hq, num_splits,
                                       HEAD_DIM=D, SPLITS=triton.next_power_of_2(num_splits))
    return out


def flash_decode_ref(q, k_cache, v_cache, seqused_k, block_table, *, softmax_scale=None, sliding_window=None,
                     num_splits=None, k_scale=None, v_scale=None, fused_combine=True, pdl=False):
    """flash_decode in plain PyTorch: each sequence's keys gathered (and dequantized, for an fp8/int8
    cache), then flash_attn's reference, fp32. num_splits is accepted for a matching signature;
    splitting does not change the result."""
    _check_decode(q, k_cache, v_cache, seqused_k, block_table, sliding_window, num_splits, False, k_scale, v_scale)
    D = q.shape[-1]
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.empty_like(q)
    for b in range(q.shape[0]):  # the new token is the last of its sequence: prefill's reference, Lq = 1
        k, v = gather_kv(k_cache, v_cache, b, int(seqused_k[b]), block_table=block_table,
                         k_scale=k_scale, v_scale=v_scale)  # [Lk, Hkv, D]
        o, _ = attention_ref(q[b][None], k, v, scale, causal=True, sliding_window=sliding_window)  # [1, Hq, D]
        out[b] = o[0].to(q.dtype)
    return out
