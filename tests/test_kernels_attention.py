"""Chapter 04's attention kernels against their plain-PyTorch references, and the references against
torch SDPA (so the oracle itself is anchored). On a CPU the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1) on small shapes that still cross several tiles; on a GPU
they run natively, on the same small shapes plus real model shapes in bf16."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F

from minillm.kernels.flash_attn import VARIANTS, _tma_ok, flash_attn_varlen, flash_attn_varlen_ref
from minillm.kernels.flash_decode import (
    MAX_SPLITS,
    SPLIT_GRAIN,
    choose_num_splits,
    flash_decode,
    flash_decode_ref,
    split_counters,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (runs on the GPU machine)")


# ---- inputs --------------------------------------------------------------------------------------


def cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)


def randn(gen: torch.Generator, *shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def qkv_views(gen, T: int, Hq: int, Hkv: int, D: int, dtype):
    """q, k, v as the model makes them: strided views into one fused [T, Hq + 2 Hkv, D] projection."""
    qkv = randn(gen, T, Hq + 2 * Hkv, D, dtype=dtype)
    return qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]


def make_cache(gen, k_lens: list[int], Hkv: int, D: int, dtype, block_size: int):
    """Random K/V caches [num_blocks, block_size, Hkv, D] and a block table giving each sequence
    ceil(len / block_size) blocks in shuffled order. block_size >= max(k_lens) is chapter 03's
    contiguous cache: one block (slot) per sequence. Table entries past a sequence's blocks point at
    random other blocks: a kernel that reads past seqused_k picks up someone else's keys."""
    n_blocks = [math.ceil(n / block_size) for n in k_lens]
    num_blocks = sum(n_blocks) + 2
    ids = torch.randperm(num_blocks, generator=gen)
    table = ids[torch.randint(0, num_blocks, (len(k_lens), max(n_blocks)), generator=gen)]
    for b, start in enumerate(itertools.accumulate([0, *n_blocks[:-1]])):
        table[b, :n_blocks[b]] = ids[start:start + n_blocks[b]]
    k_cache = randn(gen, num_blocks, block_size, Hkv, D, dtype=dtype)
    v_cache = randn(gen, num_blocks, block_size, Hkv, D, dtype=dtype)
    return k_cache, v_cache, table.to(DEVICE, torch.int32)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def check_prefill(gen, Hq, Hkv, D, q_lens, k_lens, *, causal=True, window=None, dtype=torch.float32,
                  block_size=None, max_seqlen_q=None, variant="tuned", kv_pad=0):
    """Kernel vs reference, output and lse; packed K/V, or a cache when block_size is given.
    kv_pad > 0: packed K/V rows padded by kv_pad numbers per head (no descriptor fits them)."""
    q, k, v = qkv_views(gen, sum(q_lens), Hq, Hkv, D, dtype)
    if block_size is None:
        _, k, v = qkv_views(gen, sum(k_lens), Hq, Hkv, D + kv_pad, dtype)
        k, v = k[..., :D], v[..., :D]  # [Tk, Hkv, D] views; head stride D + kv_pad
        kv_args = dict(cu_seqlens_k=cu_seqlens(k_lens))
    else:
        k, v, table = make_cache(gen, k_lens, Hkv, D, dtype, block_size)
        kv_args = dict(seqused_k=torch.tensor(k_lens, dtype=torch.int32, device=DEVICE), block_table=table)
    args = (q, k, v, cu_seqlens(q_lens), max_seqlen_q or max(q_lens))
    kw = dict(causal=causal, sliding_window=window, return_lse=True, **kv_args)
    out, lse = flash_attn_varlen(*args, **kw, variant=variant)
    want_out, want_lse = flash_attn_varlen_ref(*args, **kw)
    assert_close(out, want_out, dtype)
    assert_close(lse, want_lse, torch.float32 if dtype == torch.float32 else torch.float16)
    assert out.is_contiguous()
    return args, kw, out


# ---- the references are right: torch SDPA as the oracle -------------------------------------------


def sdpa_oracle(q, k, v, scale: float, causal: bool, window):
    """One sequence in float64 through torch SDPA: KV heads repeated, and a mask built entry by entry
    from the rules (query i at position Lk - Lq + i). Returns out [Lq, Hq, D] and lse [Hq, Lq]."""
    (Lq, Hq, _), (Lk, Hkv, _) = q.shape, k.shape
    mask = torch.tensor([[(not causal or j <= Lk - Lq + i) and (window is None or Lk - Lq + i - j < window)
                          for j in range(Lk)] for i in range(Lq)], device=q.device)  # [Lq, Lk]
    qh = q.double().transpose(0, 1)  # [Hq, Lq, D]
    kh = k.double().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)  # [Hq, Lk, D]
    vh = v.double().repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)  # [Hq, Lq, D]
    lse = torch.logsumexp((qh @ kh.transpose(1, 2) * scale).masked_fill(~mask, float("-inf")), dim=-1)
    return out.transpose(0, 1), lse


@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (False, None), (False, 4)])
def test_references_match_sdpa(seed, causal, window):
    gen = torch.Generator().manual_seed(seed)
    Hq, Hkv, D, scale = 6, 2, 16, 0.3
    q_lens, k_lens = [7, 1, 12], [7, 9, 20]  # the 2nd and 3rd sequences have a cached prefix
    q, k, v = randn(gen, sum(q_lens), Hq, D), randn(gen, sum(k_lens), Hkv, D), randn(gen, sum(k_lens), Hkv, D)
    cu_q, cu_k = cu_seqlens(q_lens), cu_seqlens(k_lens)
    out, lse = flash_attn_varlen_ref(q, k, v, cu_q, 12, cu_seqlens_k=cu_k, softmax_scale=scale, causal=causal,
                                     sliding_window=window, return_lse=True)
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want_out, want_lse = sdpa_oracle(q[qs], k[ks], v[ks], scale, causal, window)
        torch.testing.assert_close(out[qs].double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, qs].double(), want_lse, atol=1e-5, rtol=1e-5)

    # The same keys through a paged cache give the same answer: the block-table gather is right.
    k_cache, v_cache, table = make_cache(gen, k_lens, Hkv, D, torch.float32, block_size=4)
    for b in range(3):
        rows = [(int(table[b, j // 4]), j % 4) for j in range(k_lens[b])]  # key j's (block, slot), one by one
        for j, (blk, slot) in enumerate(rows):
            k_cache[blk, slot], v_cache[blk, slot] = k[cu_k[b] + j], v[cu_k[b] + j]
    seqused = torch.tensor(k_lens, dtype=torch.int32, device=DEVICE)
    paged = flash_attn_varlen_ref(q, k_cache, v_cache, cu_q, 12, seqused_k=seqused, block_table=table,
                                  softmax_scale=scale, causal=causal, sliding_window=window)
    torch.testing.assert_close(paged, out, atol=1e-6, rtol=1e-6)

    # Decode: one query per sequence at position len - 1.
    q1 = randn(gen, 3, Hq, D)
    dec = flash_decode_ref(q1, k_cache, v_cache, seqused, table, softmax_scale=scale, sliding_window=window)
    for b in range(3):
        ks = slice(cu_k[b], cu_k[b + 1])
        want, _ = sdpa_oracle(q1[b:b + 1], k[ks], v[ks], scale, True, window)
        torch.testing.assert_close(dec[b].double(), want[0], atol=1e-5, rtol=1e-5)


# ---- FlashAttention (prefill) ---------------------------------------------------------------------


@pytest.mark.parametrize("Hq,Hkv,D,q_lens,k_lens,causal,window,dtype", [
    pytest.param(2, 2, 64, [37, 1, 16], [37, 1, 16], True, None, torch.float32, id="mha-odd-lengths"),
    pytest.param(6, 2, 128, [20, 3, 1], [45, 3, 30], True, None, torch.float32, id="gqa3-d128-prefix"),
    pytest.param(8, 1, 64, [33, 9], [33, 40], True, 6, torch.float32, id="gqa8-window"),
    pytest.param(3, 1, 64, [17, 30], [17, 30], False, None, torch.float32, id="noncausal"),
    pytest.param(3, 3, 64, [17, 30], [40, 30], False, 8, torch.float32, id="noncausal-window-prefix"),
    pytest.param(4, 2, 64, [40, 5], [40, 21], True, 19, torch.float16, id="fp16-window"),
])
def test_flash_attn_packed(seed, Hq, Hkv, D, q_lens, k_lens, causal, window, dtype):
    args, kw, out = check_prefill(torch.Generator().manual_seed(seed), Hq, Hkv, D, q_lens, k_lens,
                                  causal=causal, window=window, dtype=dtype)
    if Hq == Hkv == 2:  # once: without return_lse, the same output alone (on a GPU the autotuner
        # may pick another tile shape for this variant, so equal up to rounding, not bitwise)
        assert_close(flash_attn_varlen(*args, **{**kw, "return_lse": False}), out, dtype)


@pytest.mark.parametrize("block_size,Hq,Hkv,D,q_lens,k_lens,window", [
    pytest.param(64, 3, 1, 64, [5, 1, 33], [40, 17, 33], None, id="contiguous-gqa3-prefix"),
    pytest.param(16, 8, 1, 128, [20, 2], [52, 2], None, id="paged16-gqa8-d128-prefix"),
    pytest.param(16, 4, 4, 64, [30, 7], [61, 7], 12, id="paged16-window-prefix"),
    pytest.param(7, 6, 2, 64, [9, 1, 25], [30, 10, 25], None, id="paged7-gqa3"),
])
def test_flash_attn_cache(seed, block_size, Hq, Hkv, D, q_lens, k_lens, window):
    check_prefill(torch.Generator().manual_seed(seed), Hq, Hkv, D, q_lens, k_lens, window=window,
                  block_size=block_size)


@pytest.mark.parametrize("window,block_size", [(None, None), (None, 16), (9, None), (21, 16)])
def test_flash_attn_every_prefix_offset(seed, window, block_size):
    """A cached prefix of every length from 0 to past two key tiles, so every residue of the query
    positions modulo BLOCK_N meets the tile boundaries (diagonal, window edge, full tiles)."""
    n = 130 if GPU else 34  # BLOCK_N is at most 128 on a GPU, 16 in the interpreter
    q_lens = [1 + i % 5 for i in range(n)]
    k_lens = [prefix + L for prefix, L in enumerate(q_lens)]
    check_prefill(torch.Generator().manual_seed(seed), 1, 1, 16, q_lens, k_lens, window=window,
                  block_size=block_size)


def test_flash_attn_random_case(seed):
    """One case with every knob drawn from the seed; max_seqlen_q may overstate the longest sequence."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    Hkv = rng.choice([1, 2])
    Hq = Hkv * rng.choice([1, 3, 8])
    q_lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 3))]
    k_lens = [n + rng.choice([0, rng.randint(1, 30)]) for n in q_lens]
    block_size = rng.choice([None, 5, 16, max(k_lens)])
    causal = rng.random() < 0.7
    window = rng.choice([None, None, 1, rng.randint(2, 40)])
    check_prefill(gen, Hq, Hkv, 64, q_lens, k_lens, causal=causal, window=window, block_size=block_size,
                  max_seqlen_q=max(q_lens) + rng.choice([0, 17]))


@pytest.mark.parametrize("group,variant", [(1, "tuned"), (4, "tuned"), (8, "tuned"),
                                           *((4, v) for v in sorted(VARIANTS) if v != "tuned")])
def test_flash_attn_variants_and_gqa_groups(seed, group, variant):
    """Every variant (descriptor or pointer loads, GQA-grouped or head-major grid, tile list) at GQA
    groups 1, 4 and 8: odd lengths, one sequence with a cached prefix, causal. In the interpreter
    (and on Hopper) the packed K/V here go through tensor descriptors unless the variant says not."""
    check_prefill(torch.Generator().manual_seed(seed), 2 * group, 2, 64, [37, 1, 19], [37, 6, 50],
                  variant=variant)


def test_flash_attn_descriptor_fallback(seed):
    """K/V whose heads are not adjacent in a row (a padded buffer) cannot be one descriptor: the
    kernel takes pointer loads for them and still matches the reference."""
    gen = torch.Generator().manual_seed(seed)
    _, k, _ = qkv_views(gen, 9, 4, 2, 64, torch.float32)
    assert _tma_ok(k, k) == (DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9)
    assert not _tma_ok(k, k[..., :32])  # head stride 64 != head_dim 32
    check_prefill(gen, 8, 2, 32, [21, 3], [21, 40], kv_pad=32, window=9)


def test_flash_attn_rejects_unknown_variant():
    with pytest.raises(ValueError, match="variant must be one of"):
        flash_attn_varlen(**_varlen_args(), variant="fast")


# ---- FlashDecoding ------------------------------------------------------------------------------


def check_decode(gen, block_size, Hq, Hkv, D, seq_lens, window, num_splits, dtype=torch.float32,
                 fused_combine=True):
    k_cache, v_cache, table = make_cache(gen, seq_lens, Hkv, D, dtype, block_size)
    q = randn(gen, len(seq_lens), Hq, D, dtype=dtype)
    seqused = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    kw = dict(sliding_window=window, num_splits=num_splits)
    assert_close(flash_decode(q, k_cache, v_cache, seqused, table, fused_combine=fused_combine, **kw),
                 flash_decode_ref(q, k_cache, v_cache, seqused, table, **kw), dtype)
    # The merging programs left every counter at zero for the next launch.
    assert not split_counters(q.device, 1).any()


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("block_size,Hq,Hkv,D,seq_lens,window", [
    pytest.param(80, 2, 2, 64, [1, 37, 70], None, id="contiguous-mha"),
    pytest.param(16, 6, 2, 64, [1, 37, 70], None, id="paged16-gqa3"),
    pytest.param(16, 8, 1, 128, [19, 64, 3], None, id="paged16-gqa8-d128"),
    pytest.param(64, 9, 3, 64, [50, 1], 20, id="contiguous-gqa3-window"),
    pytest.param(5, 4, 1, 64, [33, 8], 7, id="paged5-gqa4-window"),
])
def test_flash_decode(seed, num_splits, block_size, Hq, Hkv, D, seq_lens, window):
    # A 1-key sequence with 3 splits, or 8 keys in 16-key tiles, leaves splits with no keys at all.
    check_decode(torch.Generator().manual_seed(seed), block_size, Hq, Hkv, D, seq_lens, window, num_splits)


@pytest.mark.parametrize("fused_combine", [True, False])
def test_flash_decode_merge_in_kernel_or_apart(seed, fused_combine):
    # The last split to finish merges (one launch), or chapter 04's combine kernel does (two).
    check_decode(torch.Generator().manual_seed(seed), 16, 6, 2, 64, [45, 3, 29], None, num_splits=3,
                 fused_combine=fused_combine)


def test_flash_decode_more_splits_than_tiles(seed):
    check_decode(torch.Generator().manual_seed(seed), 16, 3, 1, 64, [40, 2, 17], None, num_splits=16)


def test_flash_decode_uses_only_the_splits_a_sequence_needs(seed):
    # A 16-split grid, as a graph sized for a long block table has it: 300 keys take all 16 splits, 40
    # keys take 3 (one of them empty after rounding to key tiles), 20 keys take 2, 5 keys take one split,
    # which writes the output itself. With 8 query heads of 128 dims a group, the merge reads 8 splits a
    # chunk: two chunks.
    check_decode(torch.Generator().manual_seed(seed), 16, 6, 2, 64, [300, 40, 20, 5], None, num_splits=16)
    check_decode(torch.Generator().manual_seed(seed), 16, 8, 1, 128, [300, 5], None, num_splits=16)
    check_decode(torch.Generator().manual_seed(seed), 16, 8, 1, 128, [5], 3, num_splits=16)


def test_flash_decode_fp16(seed):
    check_decode(torch.Generator().manual_seed(seed), 16, 6, 2, 64, [45, 3], None, num_splits=2,
                 dtype=torch.float16)


def test_choose_num_splits(seed):
    assert choose_num_splits(64, 8, 16384, 132) == 1  # 512 programs already fill 132 SMs twice
    assert choose_num_splits(16, 8, 16384, 132) == 3  # 128 programs: one wave, not quite full
    assert choose_num_splits(1, 8, 16384, 132) == 33  # 8 x 33 programs: two waves
    assert choose_num_splits(1, 1, 1 << 20, 132) == MAX_SPLITS
    assert choose_num_splits(2, 8, 3 * SPLIT_GRAIN, 132) == 3  # no split shorter than a tile
    rng = random.Random(seed)
    for _ in range(200):
        B, H, L, sms = rng.randint(1, 256), rng.randint(1, 16), rng.randint(1, 1 << 17), rng.randint(1, 200)
        s = choose_num_splits(B, H, L, sms)
        assert 1 <= s <= MAX_SPLITS and (s == 1 or s <= math.ceil(L / SPLIT_GRAIN))
        assert s == 1 or B * H * (s - 1) < 2 * sms  # no more splits than it takes to reach two waves


# ---- bad input ----------------------------------------------------------------------------------


def _on_device(args: dict) -> dict:
    """Everything on the test device: on a GPU, CPU tensors would be refused for that reason alone."""
    return {name: a.to(DEVICE) if isinstance(a, torch.Tensor) else a for name, a in args.items()}


def _varlen_args(**change):
    q, k, v = torch.randn(5, 4, 64), torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32), max_seqlen_q=3,
                cu_seqlens_k=torch.tensor([0, 2, 5], dtype=torch.int32))
    return _on_device({**args, **change})


@pytest.mark.parametrize("change,error,match", [
    (dict(q=torch.randn(5, 256)), ValueError, "q must be"),
    (dict(k=torch.randn(5, 2, 64, dtype=torch.float16)), TypeError, "share a dtype"),
    (dict(q=torch.randn(5, 3, 64)), ValueError, "multiple of the number of KV heads"),
    (dict(q=torch.randn(5, 4, 48), k=torch.randn(5, 2, 48), v=torch.randn(5, 2, 48)), ValueError, "head_dim"),
    (dict(v=torch.randn(5, 2, 32)), ValueError, "k and v"),
    (dict(q=torch.randn(5, 64, 4).transpose(1, 2)), ValueError, "contiguous"),
    (dict(cu_seqlens_k=None), ValueError, "give cu_seqlens_k"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "not both"),
    (dict(cu_seqlens_k=None, block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     "both block_table"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 5])), TypeError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32)), ValueError, "cu_seqlens_k must have shape"),
    (dict(max_seqlen_q=0), ValueError, "max_seqlen_q"),
    (dict(max_seqlen_q=True), ValueError, "max_seqlen_q must be a positive int"),  # a bool is no size
    (dict(sliding_window=0), ValueError, "sliding_window"),
])
def test_flash_attn_rejects_bad_input(change, error, match):
    args = _varlen_args(**change)
    with pytest.raises(error, match=match):
        flash_attn_varlen(**args)


def test_flash_attn_cache_mode_checks_shapes():
    q, cache = randn(torch.Generator(), 3, 4, 64), randn(torch.Generator(), 4, 16, 2, 64)
    cu_q, table = cu_seqlens([3]), torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="4-D"):  # a cache must be [num_blocks, block_size, Hkv, D]
        flash_attn_varlen(q, cache[0], cache[0], cu_q, 3, seqused_k=cu_q[1:], block_table=table)
    with pytest.raises(ValueError, match="seqused_k must have shape"):
        flash_attn_varlen(q, cache, cache, cu_q, 3, seqused_k=cu_q, block_table=table)


@pytest.mark.parametrize("change,error,match", [
    (dict(q=torch.randn(2, 1, 4, 64)), ValueError, "q must be"),
    (dict(seqused_k=torch.tensor([3], dtype=torch.int32)), ValueError, "seqused_k must have shape"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int64)), TypeError, "block_table must be int32"),
    (dict(k_cache=torch.randn(4, 16, 3, 64)), ValueError, "k and v"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(num_splits=True), ValueError, "num_splits"),
    (dict(sliding_window=-3), ValueError, "sliding_window"),
])
def test_flash_decode_rejects_bad_input(change, error, match):
    args = dict(q=torch.randn(2, 4, 64), k_cache=torch.randn(4, 16, 2, 64), v_cache=torch.randn(4, 16, 2, 64),
                seqused_k=torch.tensor([3, 20], dtype=torch.int32),
                block_table=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(error, match=match):
        flash_decode(**_on_device({**args, **change}))


def test_reference_rejects_more_queries_than_keys():
    q, k = torch.randn(4, 1, 16), torch.randn(3, 1, 16)
    cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="Lk >= Lq"):
        flash_attn_varlen_ref(q, k, k, cu_q, 4, cu_seqlens_k=cu_k)


# ---- real shapes, natively on a GPU ------------------------------------------------------------

MODEL_SHAPES = [pytest.param(9, 3, 64, id="smollm2"), pytest.param(32, 8, 128, id="llama3-8b")]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("Hq,Hkv,D", MODEL_SHAPES)
@pytest.mark.parametrize("mode", ["packed", "paged", "contiguous", "window"])
def test_flash_attn_real_shapes_gpu(seed, Hq, Hkv, D, mode):
    gen = torch.Generator().manual_seed(seed)
    if mode == "packed":  # a whole prompt of 3k tokens, beside short ones
        check_prefill(gen, Hq, Hkv, D, [1024, 3001, 77, 1], [1024, 3001, 77, 1], dtype=torch.bfloat16)
    elif mode == "window":
        check_prefill(gen, Hq, Hkv, D, [2500, 130], [2500, 1000], window=700, dtype=torch.bfloat16,
                      block_size=16)
    else:  # chunked prefill / prefix-cache hits: new tokens after 1-3k cached ones
        block_size = 16 if mode == "paged" else 4096
        check_prefill(gen, Hq, Hkv, D, [1000, 513, 1, 2048], [4000, 1537, 2049, 2048], dtype=torch.bfloat16,
                      block_size=block_size)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("Hq,Hkv,D", MODEL_SHAPES)
@pytest.mark.parametrize("block_size,num_splits,window", [(16, None, None), (4096, None, None), (16, 1, None),
                                                         (16, 5, None), (4096, None, 1000)])
@pytest.mark.parametrize("fused_combine", [True, False])
def test_flash_decode_real_shapes_gpu(seed, Hq, Hkv, D, block_size, num_splits, window, fused_combine):
    rng = random.Random(seed)
    seq_lens = [1, 4096] + [rng.randint(1000, 4096) for _ in range(6)]
    check_decode(torch.Generator().manual_seed(seed), block_size, Hq, Hkv, D, seq_lens, window, num_splits,
                 dtype=torch.bfloat16, fused_combine=fused_combine)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("Hq,Hkv,D", MODEL_SHAPES)
def test_flash_decode_merge_in_a_cuda_graph_gpu(seed, Hq, Hkv, D):
    # Batch 1 over a 4096-key table, as a graphed decode step has it: many splits, merged in-kernel.
    # Replayed for new lengths and queries, each replay must equal the reference: the counters reset.
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = make_cache(gen, [4096], Hkv, D, torch.bfloat16, 16)
    q = randn(gen, 1, Hq, D, dtype=torch.bfloat16)
    seqused = torch.tensor([4096], dtype=torch.int32, device=DEVICE)
    flash_decode(q, k_cache, v_cache, seqused, table)  # compile and autotune outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_decode(q, k_cache, v_cache, seqused, table)
    for n in [1, 37, 700, 4096, 2049]:
        seqused.fill_(n)
        q.copy_(randn(gen, 1, Hq, D, dtype=torch.bfloat16))
        graph.replay()
        assert_close(out, flash_decode_ref(q, k_cache, v_cache, seqused, table), torch.bfloat16)
    assert not split_counters(q.device, 1).any()


def test_fp32_autotuning_keeps_only_the_smallest_tile():
    import triton

    from minillm.kernels.flash_attn import prune_fp32

    shapes = [(128, 64), (64, 128), (64, 32), (128, 128)]
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}) for m, n in shapes]
    random.shuffle(configs)
    kept = prune_fp32(configs, {"Q": torch.zeros(2, dtype=torch.float32)}, IEEE=True)
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in kept] == [(64, 32)]
    for dtype in (torch.bfloat16, torch.float16):  # the fast dtypes keep every configuration
        assert prune_fp32(configs, {"Q": torch.zeros(2, dtype=dtype)}) == configs


@pytest.mark.skipif(GPU, reason="the CPU smoke run of the benchmark (on a GPU the bench itself runs)")
def test_bench_attention_prefill_rows(tmp_path, capsys):
    """`minillm bench attention --only prefill --variants v0 --json`: every row has the kernel's time, the
    peer's, their ratio and the ablation's speedup, and the JSON holds the same rows with a header."""
    import json

    from minillm.bench import attention

    out = attention.run("cpu", only="prefill", prefill_lengths="16", variants="v0", json=str(tmp_path / "a.json"),
                        paged=5)
    assert [r["seqs"] for r in out["prefill"]] == ["1x16", "4x4", "1x16 paged5"] and not out["decode"]
    for r in out["prefill"]:
        assert r["ratio"] == pytest.approx(r["sdpa_ms"] / r["minillm_ms"])
        assert "paged" in r["seqs"] or r["speedup_vs_v0"] == pytest.approx(r["v0_ms"] / r["minillm_ms"])
    saved = json.loads((tmp_path / "a.json").read_text())
    assert saved["prefill"] == out["prefill"] and "triton" in saved["header"]
    for bad in (dict(variants="fast"), dict(only="everything"), dict(prefill_lengths="10"), dict(paged=0)):
        with pytest.raises(ValueError):
            attention.run("cpu", **bad)
