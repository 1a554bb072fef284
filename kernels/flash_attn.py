"""FlashAttention forward (prefill) in Triton: attention that never writes the score matrix to memory.

Plain attention for one head computes S = q k^T * scale ([Lq, Lk]), P = softmax(S) and P v. For a
16k-token prompt and 32 heads, S alone is 16k x 16k x 32 x 2 bytes = 17 GB, written once and read
back twice, while the useful inputs and outputs are a few MB. FlashAttention (Dao et al., 2022)
computes the same numbers without ever storing S:

Tiling. One program owns BLOCK_M query rows of one head and keeps them in registers. It walks the
keys in tiles of BLOCK_N: loads K and V for the tile, computes the [BLOCK_M, BLOCK_N] scores with
tl.dot, folds them into its running result, and forgets them. HBM traffic is q, K, V and the output.

Online softmax. softmax needs each row's maximum and sum over all keys, before any tile is seen.
Keep instead, per row, the maximum so far m, the sum so far l = sum exp(s - m), and the output so far
acc = sum exp(s - m) v. When a new tile raises the maximum to m', everything kept was computed
relative to the old m and is rescaled by alpha = exp(m - m'):

    m' = max(m, max_j s_j)     l' = l * alpha + sum_j exp(s_j - m')     acc' = acc * alpha + P_tile v_tile

After the last tile, out = acc / l. In exact arithmetic this is softmax(S) v; subtracting the running
maximum keeps exp() from overflowing. The kernel uses exp2, which the GPU evaluates natively:
exp(x) = 2^(x * log2 e), so log2(e) is folded into the score scale once and every m, l, acc is in
base-2 units. The natural-log "log-sum-exp" of each row, lse = ln(sum_j exp(s_j)) = (m + log2 l) * ln 2,
is returned on request: FlashDecoding (flash_decode.py) uses the same quantity to merge partial
results.

Which key tiles a query tile visits. Queries are bottom-right aligned (FlashAttention's convention):
with Lq new queries and Lk keys, query i sits at position Lk - Lq + i, so a sequence whose first
Lk - Lq keys come from a cache (a cached prefix, a chunk of a chunked prefill) needs nothing special.
For a tile of queries at positions first..last the keys split into ranges of tiles:

    keys:  0 ..... lo ............ full_lo ............. full_hi ........ hi ........ Lk
           | never |  window edge  |   every key visible  |  diagonal     |  future   |
           | read  |  (masked)     |   (no mask at all)   |  (masked)     |  skipped  |

Causal attention stops at hi = last + 1: the upper-right triangle is never loaded, which halves the
work. A sliding window of W also skips everything before lo = first - W + 1. Only the tiles that
straddle a boundary pay for a mask; the full tiles in the middle, nearly all of them for a long
prompt, run a loop with no mask at all (the two-stage structure of Triton's fused-attention tutorial).

Batches without padding. Sequences are packed into one [T, H, D] stream (cu_seqlens_q marks where
each starts); the grid covers the query tiles of the longest sequence for every sequence and head
(in the order below), and a program whose tile lies past its sequence's end returns at once. K and V come either packed the same way
(cu_seqlens_k) or from a KV cache [num_blocks, block_size, Hkv, D] through a block table: key j of
sequence b is row j % block_size of block block_table[b, j // block_size], looked up per key inside
the kernel. Grouped-query attention costs nothing extra: query head h reads KV head h // (Hq // Hkv).

From a quantized cache (fp8 e4m3 or int8, one scale per KV head: chapter 08) each K/V tile is loaded
as stored, cast to q's dtype (exact) and dequantized inside the kernel; as in flash_decode.py the
head's K scale is folded into the softmax scale and its V scale into the output, since a program
serves one head. No dequantized copy of the cache is ever written.

Grid order. The grid is one axis of (query tile, sequence, KV head, query head of its group), the
last fastest. Grouped-query attention gives the `group` query heads of one KV head the same K and V:
those programs run side by side, so the group's second to last reads of each tile hit L2. Query
tiles go longest first across the whole launch (the last queries of a causal prompt see the most
keys), so the short ones fill in at the end, whatever the heads; a short prompt's one or two waves
finish together instead of one head's long tiles trailing.

Tensor descriptors (TMA). With packed K/V on a Hopper GPU (and in the interpreter, so the CPU tests
run this path) each tile is one bulk copy through a host-built descriptor over K seen as
[Tk, Hkv * D]: the copy engine computes the addresses and writes shared memory directly, where
pointer loads have every thread compute its addresses and issue its own asynchronous copies.
Rows past the sequence's end belong to the next sequence (or are zero past the tensor): the masked
diagonal tile hides them. A block table scatters keys over 16-token blocks, smaller than a tile, so
the cache path keeps pointer loads (Hopper's TMA cannot gather rows).

Tile sizes are autotuned per (length bucket, head_dim, GQA group, path) and the choice is cached,
in memory and on disk (Triton's autotune cache). `variant` selects the ablations the benchmark
compares (`VARIANTS`): the same kernel without TMA, with the old head-major grid, or with all the
old settings (pointer loads, head-major grid, the old tile list) as the baseline.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .attention_ref import attention_ref, flash_attn_varlen_ref, gather_kv  # noqa: F401  (the reference, beside)
from .checks import INTERPRET, check_varlen

LOG2E = math.log2(math.e)

# (BLOCK_M, BLOCK_N, num_warps, num_stages). "tuned": for Hopper's wgmma, 8 warps (two warpgroups of
# 64 rows) at BLOCK_M = 128, 4 at 64 (short prompts: more, shorter programs fill the SMs; at 2 stages
# a 64 x 64 tile's 83 KB of shared memory lets two programs share an SM). Every one compiles without
# spills for D = 128 (scripts/gpu/prefill_ptxas.py). V0: the list before TMA and the GQA grid, kept as
# the benchmark's baseline.
TUNED_TILES = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
               (64, 64, 4, 2), (64, 32, 4, 4)]
V0_TILES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 4),
            (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 4), (128, 128, 8, 2)]
# variant: (tile list, TMA for packed K/V, GQA-grouped grid)
VARIANTS = {"tuned": ("tuned", True, True), "no-tma": ("tuned", False, True),
            "head-grid": ("tuned", True, False), "v0": ("v0", False, False)}


def _set_block_shape(nargs):
    """Autotune pre-hook: a descriptor's tile is the config's [BLOCK_N, HEAD_DIM] (K and V alike)."""
    for name in ("K", "V"):
        if isinstance(nargs[name], TensorDescriptor):
            nargs[name].block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]


def _configs(tiles) -> list[triton.Config]:
    if INTERPRET:  # one small config: CPU tests stay fast and still cross several tiles
        tiles = [(32, 16, 4, 1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=_set_block_shape)
            for m, n, w, s in tiles]


def prune_fp32(configs, named_args, **kwargs):
    """The autotuner's early prune: fp32 inputs (IEEE dots, used to check exactness, not for speed)
    keep only the smallest tile. Wide fp32 tiles take minutes to compile (85 s for this file's eight
    configs on an H100), and the small one is what the autotuner picked for them anyway."""
    if named_args["Q"].dtype != torch.float32:
        return configs
    return [min(configs, key=lambda c: math.prod(v for k, v in c.kwargs.items() if k.startswith("BLOCK_")))]


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """a @ b (+ acc) in fp32. fp32 inputs would run as TF32 (10-bit mantissa) unless told otherwise."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _kv_rows(offs_n, seqlen_k, k_start, bt_row, block_size, stride_k_blk, stride_k_tok, stride_v_blk,
             stride_v_tok, PAGED: tl.constexpr):
    """Offsets (int64, [BLOCK_N]) of the K and V rows of the keys at positions offs_n of a sequence."""
    if PAGED:
        # Key j lives in row j % block_size of block block_table[b, j // block_size]. Positions past
        # the sequence would index past its row of the table: read block 0 for them (masked later).
        block = tl.load(bt_row + offs_n // block_size, mask=offs_n < seqlen_k, other=0).to(tl.int64)
        slot = (offs_n % block_size).to(tl.int64)
        return block * stride_k_blk + slot * stride_k_tok, block * stride_v_blk + slot * stride_v_tok
    else:
        tok = (k_start + offs_n).to(tl.int64)  # packed: the sequence's keys are consecutive rows
        return tok * stride_k_tok, tok * stride_v_tok


@triton.jit
def _load_tile(X, rows, row0, kv_col, in_seq, MASK: tl.constexpr, USE_TMA: tl.constexpr,
               TRANSPOSED: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One K or V tile of BLOCK_N keys: [BLOCK_N, HEAD_DIM], or [HEAD_DIM, BLOCK_N] if TRANSPOSED (K,
    for q k^T). Pointer loads use `rows` (int64 [BLOCK_N] row offsets, _kv_rows); a descriptor is read
    at row row0, columns kv_col:kv_col + HEAD_DIM. With MASK, keys past the sequence (in_seq False)
    read as zero: pointer loads never touch them, and a descriptor's rows there (the next sequence's,
    or zeros past the tensor) are zeroed in V, since p = 0 times whatever is stored must stay 0."""
    if USE_TMA:
        x = X.load([row0, kv_col])  # [BLOCK_N, HEAD_DIM], one bulk copy
        if TRANSPOSED:
            x = x.T  # K's rows past the sequence only make scores that the caller masks to -inf
        elif MASK:
            x = tl.where(in_seq[:, None], x, 0.0)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        if TRANSPOSED:  # each column one key's contiguous row
            ptrs = X + rows[None, :] + offs_d[:, None]
            mask = in_seq[None, :]
        else:
            ptrs = X + rows[:, None] + offs_d[None, :]
            mask = in_seq[:, None]
        if MASK:  # a boundary tile may run past the last key
            x = tl.load(ptrs, mask=mask, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, q_pos, K, V, start, end, seqlen_k, k_start, kv_col, bt_row, block_size,
                  stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok, qk_scale, window,
                  MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr,
                  IEEE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT_KV: tl.constexpr,
                  USE_TMA: tl.constexpr):
    """Fold the key tiles [start, end) into the running (acc, l_i, m_i). MASK=False is the fast path:
    the caller promises every key of every tile is visible to every query row."""
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions in the sequence
        in_seq = offs_n < seqlen_k
        if USE_TMA:  # (row offsets unused by descriptors)
            k_rows, v_rows = offs_n, offs_n
        else:
            k_rows, v_rows = _kv_rows(offs_n, seqlen_k, k_start, bt_row, block_size, stride_k_blk, stride_k_tok,
                                      stride_v_blk, stride_v_tok, PAGED)
        k = _load_tile(K, k_rows, k_start + start_n, kv_col, in_seq, MASK, USE_TMA, True, HEAD_DIM)
        if QUANT_KV:  # fp8/int8 -> q's dtype, exactly; the head's scale is in qk_scale
            k = k.to(tl.float32).to(q.dtype)
        qk = dot(q, k, None, IEEE)  # [BLOCK_M, BLOCK_N] raw scores q.k, fp32
        if MASK:
            visible = in_seq[None, :]  # [1, BLOCK_N], broadcast to [BLOCK_M, BLOCK_N] below
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (q_pos[:, None] - offs_n[None, :] < window)
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
            # A row may have seen no visible key yet (m_new = -inf); exp2(-inf - -inf) would be NaN.
            # Subtracting 0 instead gives p = 0 and alpha = 0, which is right: nothing to keep.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # finite: every score here is real
            m_sub = m_new
            p = tl.exp2(qk * qk_scale - m_sub[:, None])  # scale and shift in one multiply-add
        v = _load_tile(V, v_rows, k_start + start_n, kv_col, in_seq, MASK, USE_TMA, False, HEAD_DIM)
        if QUANT_KV:  # the V scale multiplies the output once, at the end
            v = v.to(tl.float32).to(q.dtype)
        alpha = tl.exp2(m_i - m_sub)  # [BLOCK_M] how much the old state shrinks (0 on the first tile)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)  # [BLOCK_M, HEAD_DIM]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_seqs"])  # one binary for any batch size (1 and 16k would be special)
def _flash_attn_fwd(
    Q, K, V, Out, Lse,  # q [Tq, Hq, D]; K, V packed [Tk, Hkv, D] (or descriptors over it) or caches; Out [Tq, Hq, D]; Lse [Hq, Tq]
    cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,  # int32 [B+1]; [B+1] | None; [B], [B, n] | None
    K_scale, V_scale,  # fp32 [Hkv]: a quantized cache's per-head scales (None otherwise)
    stride_q_tok, stride_q_head,
    stride_k_blk, stride_k_tok, stride_k_head,  # packed: stride_k_blk unused
    stride_v_blk, stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head, stride_lse_head, stride_bt,
    num_seqs, num_kv_heads, group, block_size, window, qk_scale,
    seqlen_bucket,  # not used by the kernel: part of the autotuning key only
    HEAD_DIM: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    RETURN_LSE: tl.constexpr, IEEE: tl.constexpr, QUANT_KV: tl.constexpr, USE_TMA: tl.constexpr,
    GQA_GRID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Longest causal tiles (the last queries see the most keys) get the lowest program ids, so they
    # start first and the short ones fill in at the end of the launch.
    if GQA_GRID:  # one axis: query tile (longest first), then sequence, KV head, and the group's heads
        per_tile = num_seqs * num_kv_heads * group  # programs per query-tile index
        m_block = tl.num_programs(0) // per_tile - 1 - tl.program_id(0) // per_tile
        rest = tl.program_id(0) % per_tile
        b = rest // (num_kv_heads * group)
        kv_head = rest // group % num_kv_heads
        h = kv_head * group + rest % group
    else:  # grid (query tiles, sequences x query heads): one head's tiles side by side
        m_block = tl.num_programs(0) - 1 - tl.program_id(0)
        b = tl.program_id(1) // (num_kv_heads * group)
        h = tl.program_id(1) % (num_kv_heads * group)
        kv_head = h // group  # GQA: the KV head of this query head's group
    q_start = tl.load(cu_seqlens_q + b)
    seqlen_q = tl.load(cu_seqlens_q + b + 1) - q_start
    if m_block * BLOCK_M >= seqlen_q:  # this sequence is shorter than the longest one
        return
    if PAGED:
        k_start = 0
        seqlen_k = tl.load(seqused_k + b)
        bt_row = block_table + b.to(tl.int64) * stride_bt
    else:
        k_start = tl.load(cu_seqlens_k + b)
        seqlen_k = tl.load(cu_seqlens_k + b + 1) - k_start
        bt_row = block_table  # unused
    kv_col = kv_head * HEAD_DIM  # descriptors: the head's columns in a [Tk, Hkv * D] view
    if not USE_TMA:
        K += kv_head.to(tl.int64) * stride_k_head
        V += kv_head.to(tl.int64) * stride_v_head
    v_scale = 1.0  # (unused unless QUANT_KV)
    if QUANT_KV:  # q.(s_k k) = s_k (q.k): the head's K scale joins the softmax scale
        qk_scale = qk_scale * tl.load(K_scale + kv_head)
        v_scale = tl.load(V_scale + kv_head)

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the sequence
    offs_d = tl.arange(0, HEAD_DIM)
    q_pos = seqlen_k - seqlen_q + offs_m  # bottom-right aligned positions
    row_ok = offs_m < seqlen_q  # the last tile of a sequence may run into the next one
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_q_tok + h * stride_q_head + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM], stays on chip

    # The key ranges of the module docstring, every boundary a multiple of BLOCK_N except hi.
    first = seqlen_k - seqlen_q + m_block * BLOCK_M  # position of the tile's first query
    last = seqlen_k - seqlen_q + tl.minimum((m_block + 1) * BLOCK_M, seqlen_q) - 1  # and of its last
    if CAUSAL:
        hi = last + 1
        full_hi = (first + 1) // BLOCK_N * BLOCK_N  # tiles wholly at or before the first query
    else:
        hi = seqlen_k
        full_hi = seqlen_k // BLOCK_N * BLOCK_N
    lo = 0
    full_lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.minimum(tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N, hi)
        full_hi = tl.maximum(full_hi, full_lo)  # a window narrower than a tile: no full tiles at all

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of 2^(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of 2^(s - m) v
    if HAS_WINDOW:  # the window's left edge, masked
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, K, V, lo, full_lo, seqlen_k, k_start, kv_col,
                                      bt_row, block_size, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
                                      qk_scale, window, True, CAUSAL, HAS_WINDOW, PAGED, IEEE, BLOCK_N,
                                      HEAD_DIM, QUANT_KV, USE_TMA)
    # The full tiles, no mask; then the diagonal (or the ragged end of the keys), masked.
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, K, V, full_lo, full_hi, seqlen_k, k_start, kv_col,
                                  bt_row, block_size, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
                                  qk_scale, window, False, CAUSAL, HAS_WINDOW, PAGED, IEEE, BLOCK_N, HEAD_DIM,
                                  QUANT_KV, USE_TMA)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, K, V, full_hi, hi, seqlen_k, k_start, kv_col,
                                  bt_row, block_size, stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok,
                                  qk_scale, window, True, CAUSAL, HAS_WINDOW, PAGED, IEEE, BLOCK_N, HEAD_DIM,
                                  QUANT_KV, USE_TMA)

    # Rows past the sequence's end may have seen no key at all (l = 0): divide them by 1, not 0. They
    # are never stored; the guard only keeps NaNs out of registers.
    l_i = tl.where(row_ok, l_i, 1.0)
    out = acc / l_i[:, None]
    if QUANT_KV:
        out = out * v_scale  # a quantized V's scale, once
    tl.store(Out + q_rows[:, None] * stride_o_tok + h * stride_o_head + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # back from base 2 to natural log: * ln 2
        tl.store(Lse + h * stride_lse_head + q_start + offs_m, lse, mask=row_ok)


# One autotuner per tile list, both over the same kernel; each caches its choice per key.
_TUNE_KEY = ["HEAD_DIM", "PAGED", "CAUSAL", "HAS_WINDOW", "USE_TMA", "GQA_GRID", "seqlen_bucket", "group"]
_KERNELS = {name: triton.autotune(configs=_configs(tiles), key=_TUNE_KEY, cache_results=True,
                                  prune_configs_by={"early_config_prune": prune_fp32})(_flash_attn_fwd)
            for name, tiles in (("tuned", TUNED_TILES), ("v0", V0_TILES))}


def chosen_tiles(variant: str = "tuned") -> str:
    """The tile the autotuner picked at the variant's last launch, "BLOCK_MxBLOCK_N wW sS" (for the benchmark)."""
    config = getattr(_KERNELS[VARIANTS[variant][0]], "best_config", None)
    if config is None:
        return "-"
    return f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']} w{config.num_warps} s{config.num_stages}"


# ---- the kernel's entry point ------------------------------------------------------------------


def _tma_ok(q: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether packed K or V [Tk, Hkv, D] can be read through a descriptor over [Tk, Hkv * D]: heads
    adjacent in a row, 16-byte aligned base and row stride (TMA's rules), on Hopper or newer (or the
    interpreter)."""
    if not INTERPRET and (q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] < 9):
        return False
    Tk, _, D = t.shape
    size = t.element_size()
    return (Tk > 0 and t.stride(2) == 1 and t.stride(1) == D and t.data_ptr() % 16 == 0
            and t.stride(0) * size % 16 == 0 and D * size >= 16)


def _descriptor(t: torch.Tensor) -> TensorDescriptor:
    Tk, Hkv, D = t.shape  # the tile shape is set per config by _set_block_shape
    return TensorDescriptor(t, [Tk, Hkv * D], [t.stride(0), 1], [16, D])


def flash_attn_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, *, cu_seqlens_k=None, seqused_k=None,
                      block_table=None, softmax_scale=None, causal=True, sliding_window=None,
                      return_lse=False, k_scale=None, v_scale=None, variant="tuned"):
    """softmax(q k^T * softmax_scale + mask) v for every sequence of a packed batch, in one launch.

    q: [Tq, Hq, D], sequence b's queries at rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; max_seqlen_q >= the
    longest. K/V either packed, k, v [Tk, Hkv, D] with cu_seqlens_k [B+1], or a cache
    [num_blocks, block_size, Hkv, D] with seqused_k [B] (keys per sequence) and block_table [B, n].
    Query i of Lq sits at position Lk - Lq + i (Lk >= Lq). Returns out [Tq, Hq, D] in q's dtype, and
    with return_lse also lse [Hq, Tq] fp32 (natural log of each row's softmax denominator).
    An fp8/int8 cache needs k_scale, v_scale (fp32 [Hkv]). variant: one of VARIANTS (the benchmark's
    ablations; every one computes the same thing).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    paged = check_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, cu_seqlens_k, seqused_k, block_table,
                          sliding_window, True, k_scale, v_scale)
    tiles, tma, gqa_grid = VARIANTS[variant]
    Tq, Hq, D = q.shape
    Hkv, B = k.shape[-2], cu_seqlens_q.numel() - 1
    group = Hq // Hkv
    scale = D**-0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.empty((Tq, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((Hq, Tq), dtype=torch.float32, device=q.device) if return_lse else None
    if Tq == 0:
        return (out, lse) if return_lse else out
    if paged:  # [num_blocks, block_size, Hkv, D]
        k_strides, v_strides, block_size = k.stride()[:3], v.stride()[:3], k.shape[1]
    else:  # [Tk, Hkv, D]: no block dimension
        k_strides, v_strides, block_size = (0, *k.stride()[:2]), (0, *v.stride()[:2]), 1
    use_tma = tma and not paged and _tma_ok(q, k) and _tma_ok(q, v)
    k_arg, v_arg = (_descriptor(k), _descriptor(v)) if use_tma else (k, v)
    if gqa_grid:
        grid = lambda meta: (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]) * B * Hq,)
    else:
        grid = lambda meta: (triton.cdiv(max_seqlen_q, meta["BLOCK_M"]), B * Hq)
    _KERNELS[tiles][grid](
        q, k_arg, v_arg, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, k_scale, v_scale,
        q.stride(0), q.stride(1), *k_strides, *v_strides, out.stride(0), out.stride(1), Tq,
        block_table.stride(0) if paged else 0,
        B, Hkv, group, block_size, sliding_window or 0, scale * LOG2E,
        min(max(16, triton.next_power_of_2(max_seqlen_q)), 8192),  # tile sizes differ for short chunks
        HEAD_DIM=D, PAGED=paged, CAUSAL=bool(causal), HAS_WINDOW=sliding_window is not None,
        RETURN_LSE=return_lse, IEEE=q.dtype == torch.float32, QUANT_KV=k_scale is not None,
        USE_TMA=use_tma, GQA_GRID=gqa_grid,
    )
    return (out, lse) if return_lse else out
