"""Paged attention over MLA's latent cache, in Triton: every query head shares one latent "KV head".

DeepSeek's multi-head latent attention caches, per token and layer, one vector: the normalised
latent c (kv_lora_rank numbers, 512 in V2/V3) followed by the rotated shared key part k_pe
(qk_rope_head_dim, 64). With W_UK folded into the query (layers/mla.py, the absorbed path), head h's
attention is ordinary attention with a single KV head of width L + R that serves as the key, whose
first L numbers also serve as the value:

    q_h = [q_nope_h W_UK_h, q_pe_h]   [L + R]       score_hj = q_h . [c_j, k_pe_j] * scale
    o_h = sum_j softmax_j(score_h) c_j   [L]        (W_UV and o_proj come after, layers/mla.py)

So a program loads a tile of latents once and uses it for every query head in its head block, as
K (transposed) and as V: the bytes read per step are the latent cache, nothing per head. Keys are
found through the block table as in flash_decode.py (key j of sequence b: row j % block_size of
block block_table[b, j // block_size]), and the keys are split across programs (split-KV, merged by
flash_decode's combine kernel) when batch x head blocks alone cannot fill the GPU.

How many heads a program takes decides what limits it. Per key the kernel reads L + R = 576
numbers (1,152 bytes in bf16) and does 2 H (L + R + L) FLOP: 30 FLOP per byte at V2-Lite's 16
heads, far below an H100's ridge (about 265), so that case is a copy and a head block of 16 (the
smallest tl.dot) suffices. At V3's 128 heads it is 242 FLOP per byte, at the ridge: with 16 heads
per program the latent cache would be read 8 times and every MMA would be 16 rows tall. So above 16
heads a program takes 32 or 64 (tuned): one latent tile feeds an MMA of M = 64, and the head blocks
of one (row, split) are launched side by side so the second one's reads hit L2.

One query row per program, with its own number of visible keys: a decode token sees its whole
sequence, a prompt token of a prefill chunk only the keys up to itself. So the same kernel serves
decode and (absorbed) prefill, and it runs inside CUDA graphs: nothing is read back to the host.
The latent write (`store_latent`) and the references beside each kernel are plain PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, INTERPRET, check_device, check_float_tensor, check_index
from .flash_attn import LOG2E, dot, prune_fp32
from .flash_decode import MAX_SPLITS, SPLIT_GRAIN, _flash_decode_combine, sm_count

FEW_HEADS = 16  # at most this many heads: one head block of 16, the fewest rows tl.dot takes
FEW_HEADS_FILL_WAVES = True  # the split rule at few heads (choose_num_splits; bench moe times both)
# Programs an SM runs at once, by head count. Few heads: a 4-warp tile of 32 keys needs 224 registers a
# thread and 55 KB of shared memory, so two fit an SM, and filling both slots keeps twice the loads in
# flight (V2-Lite, batch 32, 4,096 keys, CUDA-graph timing on an H100: 8 splits 73.7 us against 4 splits'
# 81.2, scripts/gpu/mla_configs.py). Many heads: the 64-head tiles take one SM each (255 registers, 216 KB).
FEW_HEADS_CTAS_PER_SM = 2


def _configs(many_heads: bool) -> list[triton.Config]:
    """(BLOCK_H, BLOCK_N, warps, stages). Few heads (V2-Lite's 16): memory-bound, so the tuner picks
    how many keys a tile holds and how many loads stay in flight. Many heads (V3's 128): each latent
    tile feeds BLOCK_H = 32 or 64 query rows, an MMA of M = 64 (a Hopper warpgroup's wgmma height), so
    a KV byte is read once per 64 heads instead of once per 16; the fp32 output [BLOCK_H, 512] is
    spread over 8 warps (64 x 512 x 4 B / 256 threads = 128 registers each), never over 4."""
    if INTERPRET:
        return [triton.Config({"BLOCK_H": 32 if many_heads else 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    if many_heads:
        shapes = [(64, 32, 8, 2), (64, 64, 8, 2), (64, 16, 8, 3), (32, 32, 4, 2), (32, 64, 8, 2)]
    else:
        shapes = [(16, 16, 4, 2), (16, 32, 4, 2), (16, 32, 8, 2), (16, 64, 8, 2), (16, 32, 4, 3), (16, 64, 4, 2)]
    return [triton.Config({"BLOCK_H": h, "BLOCK_N": n}, num_warps=w, num_stages=st) for h, n, w, st in shapes]


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_split(
    Q, KV, Out, O_part, Lse_part,  # q [T, H, L + R]; cache [blocks, block_size, 1, L + R]; out [T, H, L]
    kv_lens, seq_idx, block_table,  # int32 [T] keys each row sees, [T] its sequence, [B, max_blocks]
    stride_q_tok, stride_q_head, stride_kv_blk, stride_kv_tok, stride_o_tok, stride_o_head, stride_bt,
    num_heads, rope_dim, block_size, num_splits, qk_scale,
    keys_bucket,  # not used by the kernel: part of the autotuning key only
    LAT: tl.constexpr, ROPE: tl.constexpr,  # kv_lora_rank; rope_dim padded to a power of two >= 16
    SINGLE_SPLIT: tl.constexpr, IEEE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Head blocks vary fastest: the programs that run side by side are the head blocks of one
    # (row, split), which read the same latent tiles, so every read after the first hits L2.
    head_block = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.program_id(2)
    seqlen = tl.load(kv_lens + t)
    per_split = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seqlen)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    offs_l = tl.arange(0, LAT)
    offs_r = tl.arange(0, ROPE)
    r_ok = offs_r < rope_dim
    q_row = Q + t.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head
    q_lat = tl.load(q_row + offs_l[None, :], mask=head_ok[:, None], other=0.0)  # [BLOCK_H, LAT]
    q_pe = tl.load(q_row + LAT + offs_r[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_H, ROPE]
    bt_row = block_table + tl.load(seq_idx + t).to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, base 2
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LAT], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_range = offs_n < hi
        block = tl.load(bt_row + offs_n // block_size, mask=in_range, other=0).to(tl.int64)
        row = KV + block * stride_kv_blk + (offs_n % block_size).to(tl.int64) * stride_kv_tok  # [BLOCK_N]
        lat = tl.load(row[:, None] + offs_l[None, :], mask=in_range[:, None], other=0.0)  # [BLOCK_N, LAT]
        pe = tl.load(row[:, None] + LAT + offs_r[None, :], mask=in_range[:, None] & r_ok[None, :], other=0.0)
        # two MMAs of M = BLOCK_H rows: the latent part (K = LAT) and the rope part (K = ROPE)
        qk = dot(q_lat, tl.trans(lat), None, IEEE)  # [BLOCK_H, BLOCK_N]: the latent as K ...
        qk = dot(q_pe, tl.trans(pe), qk, IEEE)
        qk = tl.where(in_range[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot(p.to(lat.dtype), lat, acc * alpha[:, None], IEEE)  # ... and, the same tile, as V
        m_i = m_new

    if SINGLE_SPLIT:
        tl.store(Out + t.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + offs_l[None, :],
                 (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=head_ok[:, None])
    else:  # partials for flash_decode's combine: an empty split stores o = 0 and lse = -inf (weight 0)
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        prow = (t * num_heads + heads).to(tl.int64) * num_splits + split  # [BLOCK_H] into [T, H, S]
        tl.store(O_part + prow[:, None] * LAT + offs_l[None, :], acc / l_safe[:, None], mask=head_ok[:, None])
        tl.store(Lse_part + prow, tl.where(empty, float("-inf"), m_i + tl.log2(l_safe)), mask=head_ok)


def _prune(configs, named_args, **kwargs):
    """fp32 inputs (IEEE dots: exactness checks, not speed) run one small config: fp32 tiles of a
    [64, 512] query block would not fit in shared memory, and wide ones compile for minutes."""
    if named_args["Q"].dtype != torch.float32 or INTERPRET:
        return configs
    if configs[0].kwargs["BLOCK_H"] == FEW_HEADS:
        return prune_fp32(configs, named_args)
    return [triton.Config({"BLOCK_H": 32, "BLOCK_N": 16}, num_warps=8, num_stages=1)]


# One kernel, two tuned launchers: the head-block width is part of each config.
_KEY = ["LAT", "ROPE", "SINGLE_SPLIT", "keys_bucket"]
_mla_few_heads = triton.autotune(configs=_configs(False), key=_KEY,
                                 prune_configs_by={"early_config_prune": _prune})(_mla_decode_split)
_mla_many_heads = triton.autotune(configs=_configs(True), key=_KEY,
                                  prune_configs_by={"early_config_prune": _prune})(_mla_decode_split)


def program_slots(device: torch.device, many_heads: bool) -> int:
    """How many decode programs the GPU runs side by side: the `num_sms` that choose_num_splits fills."""
    return sm_count(device) * (1 if many_heads else FEW_HEADS_CTAS_PER_SM)


def choose_num_splits(rows: int, head_blocks: int, max_keys: int, num_sms: int, fill_waves: bool = True) -> int:
    """How many slices to cut each row's keys into (no slice shorter than a key tile, at most MAX_SPLITS).

    fill_waves: the fewest splits whose programs leave their last wave over the SMs at least 85 %
    full. Every split costs a [H, 512] fp32 partial written and read again by the combine, and a
    wave that is mostly empty costs a whole program's time: 288 programs on 132 SMs run as 3 waves
    with the third 18 % full. Else flash_decode's rule: about two programs per SM."""
    limit = max(1, min(triton.cdiv(max_keys, SPLIT_GRAIN), MAX_SPLITS))
    programs = rows * head_blocks
    if not fill_waves:
        return max(1, min(triton.cdiv(2 * num_sms, programs), limit))
    for s in range(1, limit + 1):
        n = programs * s
        if n / (triton.cdiv(n, num_sms) * num_sms) >= 0.85:
            return s
    return limit


def _check(q, kv_cache, kv_lens, seq_idx, block_table, kv_lora_rank, strict: bool) -> None:
    check_float_tensor("q", q, FLOAT_DTYPES if strict else None, dims=3, layout="[tokens, heads, L + R]")
    check_float_tensor("kv_cache", kv_cache, FLOAT_DTYPES if strict else None, dims=4,
                       layout="[blocks, block_size, 1, L + R]")
    if kv_cache.shape[2] != 1 or kv_cache.shape[3] != q.shape[2]:
        raise ValueError(f"kv_cache must be [blocks, block_size, 1, {q.shape[2]}] (one latent head as wide as q), "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"q and kv_cache must share a dtype, got {q.dtype} and {kv_cache.dtype}")
    if not 0 < kv_lora_rank < q.shape[2]:
        raise ValueError(f"kv_lora_rank must be in 1..{q.shape[2] - 1} (q's width is L + R), got {kv_lora_rank}")
    T = q.shape[0]
    check_index("kv_lens", kv_lens, (T,), strict)
    check_index("seq_idx", seq_idx, (T,), strict)
    check_index("block_table", block_table, (None, None), strict)
    if strict:
        check_device("q", q)
        if kv_lora_rank < 16 or kv_lora_rank & (kv_lora_rank - 1):
            raise ValueError(f"the Triton MLA kernel needs kv_lora_rank a power of two >= 16, got {kv_lora_rank}")
        if INTERPRET and q.dtype == torch.bfloat16:
            raise TypeError("Triton's CPU interpreter gets bfloat16 tl.dot wrong: use float32 or float16 on a CPU")


def mla_decode(q, kv_cache, kv_lens, seq_idx, block_table, kv_lora_rank: int, softmax_scale: float,
               num_splits: int | None = None, head_block: int | None = None):
    """Absorbed MLA attention from the paged latent cache: q [T, H, L + R] -> [T, H, L] in q's dtype.

    Row t attends to the first kv_lens[t] keys of sequence seq_idx[t] (int32, each >= 1), found
    through block_table [B, max_blocks] int32. num_splits: None chooses. head_block: None chooses
    (16 heads per program up to 16 heads, 32 or 64 above, tuned); 16 forces the few-heads kernel
    at any head count (the benchmark's old-kernel peer)."""
    _check(q, kv_cache, kv_lens, seq_idx, block_table, kv_lora_rank, strict=True)
    if head_block not in (None, FEW_HEADS):
        raise ValueError(f"head_block must be None (choose) or {FEW_HEADS}, got {head_block!r}")
    T, H, width = q.shape
    L = kv_lora_rank
    out = torch.empty((T, H, L), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    many = H > FEW_HEADS and head_block is None
    kernel = _mla_many_heads if many else _mla_few_heads
    block_size = kv_cache.shape[1]
    max_keys = block_table.shape[1] * block_size  # from shapes: reading kv_lens would wait for the GPU
    if num_splits is None:  # head blocks counted at the widest config, 64 (or 16 for few heads)
        num_splits = choose_num_splits(T, triton.cdiv(H, 64 if many else FEW_HEADS), max_keys,
                                       program_slots(q.device, many), fill_waves=many or FEW_HEADS_FILL_WAVES)
    single = num_splits == 1
    o_part = lse_part = None
    if not single:
        o_part = torch.empty((T, H, num_splits, L), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((T, H, num_splits), dtype=torch.float32, device=q.device)
    kernel[lambda meta: (triton.cdiv(H, meta["BLOCK_H"]), num_splits, T)](
        q, kv_cache, out, o_part, lse_part, kv_lens, seq_idx, block_table,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), out.stride(0), out.stride(1),
        block_table.stride(0), H, width - L, block_size, num_splits, float(softmax_scale) * LOG2E,
        min(max(16, triton.next_power_of_2(triton.cdiv(max_keys, num_splits))), 8192),
        LAT=L, ROPE=max(16, triton.next_power_of_2(width - L)), SINGLE_SPLIT=single, IEEE=q.dtype == torch.float32)
    if not single:
        _flash_decode_combine[(T, H)](o_part, lse_part, out, out.stride(0), out.stride(1), H, num_splits,
                                      HEAD_DIM=L, SPLITS=triton.next_power_of_2(num_splits))
    return out


def mla_decode_ref(q, kv_cache, kv_lens, seq_idx, block_table, kv_lora_rank: int, softmax_scale: float,
                   num_splits: int | None = None):
    """mla_decode in plain PyTorch, fp32: per sequence, its keys gathered from its blocks once, then
    each of its rows' scores over the keys it sees, softmax, and the latents as values."""
    _check(q, kv_cache, kv_lens, seq_idx, block_table, kv_lora_rank, strict=False)
    block_size = kv_cache.shape[1]
    flat = kv_cache.view(-1, kv_cache.shape[-1])  # [blocks * block_size, L + R]
    out = torch.empty(q.shape[:2] + (kv_lora_rank,), dtype=q.dtype, device=q.device)
    for b in seq_idx.unique().tolist():
        rows = (seq_idx == b).nonzero()[:, 0]  # this sequence's query rows
        lens = kv_lens[rows].long()  # [t] keys each sees
        pos = torch.arange(int(lens.max()), device=q.device)
        kv = flat[block_table[b, pos // block_size].long() * block_size + pos % block_size].float()  # [n, L + R]
        scores = torch.einsum("thd,nd->thn", q[rows].float(), kv) * softmax_scale  # [t, H, n]
        scores.masked_fill_(pos[None, None, :] >= lens[:, None, None], float("-inf"))
        out[rows] = (torch.softmax(scores, dim=-1) @ kv[:, :kv_lora_rank]).to(q.dtype)  # [t, H, L]
    return out


@triton.jit
def _store_latent(X, Cache, slot_mapping, width, stride_x, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:  # a padding token of a CUDA-graph batch: writes nothing
        return
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + t.to(tl.int64) * stride_x + cols, mask=cols < width)
    tl.store(Cache + slot * width + cols, x, mask=cols < width)


def store_latent(x: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each new token's [c, k_pe] ([T, L + R]) to its cache row (slot_mapping [T]; < 0: none)."""
    width = kv_cache.shape[-1]
    if x.dim() != 2 or x.shape[1] != width or not kv_cache.is_contiguous():
        raise ValueError(f"store_latent needs x [T, {width}] and a contiguous cache, got {tuple(x.shape)}")
    _store_latent[(x.shape[0],)](x, kv_cache, slot_mapping, width, x.stride(0),
                                 BLOCK=triton.next_power_of_2(width))


def store_latent_ref(x: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping[keep].long(), x[keep].to(kv_cache.dtype))
