"""The MLA decode kernel's many-heads path (kernels/mla_decode.py): head blocks of 32-64 query heads
per program equal the plain-PyTorch reference through a shuffled, NaN-filled block table, at head
counts that leave a partial head block, odd key counts and several split counts; the forced
16-head kernel agrees with it; the split rule fills whole waves.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_kernels_moe import DEVICE, DTYPES, INTERPRETED, TOL, rel
from test_mla import paged_latents

from minillm.kernels.flash_decode import SPLIT_GRAIN
from minillm.kernels.mla_decode import choose_num_splits, mla_decode, mla_decode_ref, program_slots


@pytest.mark.slow
@pytest.mark.parametrize("H", [40, 70] if INTERPRETED else [40, 128])
def test_many_heads_match_the_reference(seed, H):
    rng, g = random.Random(seed * 7 + H), torch.Generator().manual_seed(seed * 7 + H)
    L, R = (32, 16) if INTERPRETED else (512, 64)
    block_size = rng.choice([4, 16])
    B = rng.randint(2, 3)
    lens = [rng.randint(1, 45 if INTERPRETED else 3000) | 1 for _ in range(B)]  # odd lengths
    # the last sequence also has a prefill chunk's rows (causal: each row sees keys up to itself)
    rows = [(b, n) for b, n in enumerate(lens)] + [(B - 1, k) for k in range(max(1, lens[-1] - 3), lens[-1])]
    seq_idx = torch.tensor([b for b, _ in rows], dtype=torch.int32, device=DEVICE)
    kv_lens = torch.tensor([k for _, k in rows], dtype=torch.int32, device=DEVICE)
    # on a GPU fp16 is left out: one more dtype is a minute more of compiling and autotuning
    for dtype in DTYPES if INTERPRETED else [torch.float32, torch.bfloat16]:
        cache, table = paged_latents(g, lens, L + R, block_size, dtype)
        q = torch.randn(len(rows), H, L + R, generator=g).to(DEVICE, dtype)
        want = mla_decode_ref(q, cache, kv_lens, seq_idx, table, L, 0.15)
        assert not want.isnan().any()
        for splits in (None, 1, 2, 5):
            got = mla_decode(q, cache, kv_lens, seq_idx, table, L, 0.15, num_splits=splits)
            assert not got.isnan().any(), (dtype, splits)
            assert rel(got, want) < TOL[dtype], (dtype, splits, rel(got, want))
        few = mla_decode(q, cache, kv_lens, seq_idx, table, L, 0.15, num_splits=3, head_block=16)
        assert rel(few, want) < TOL[dtype], (dtype, rel(few, want))


def test_head_block_must_be_none_or_16():
    q = torch.randn(1, 40, 48, device=DEVICE)
    cache = torch.randn(2, 4, 1, 48, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head_block"):
        mla_decode(q, cache, one, one * 0, one[None] * 0, 32, 0.1, head_block=64)


def test_few_heads_fill_two_programs_an_sm():
    """V2-Lite's 16 heads: the 4-warp tiles fit two CTAs an SM, so the split rule fills twice the SMs
    (batch 32 at 4,096 keys on 132 SMs: 8 splits, where one program an SM gave 4)."""
    dev = torch.device(DEVICE)
    assert program_slots(dev, many_heads=False) == 2 * program_slots(dev, many_heads=True)
    assert choose_num_splits(32, 1, 4096, 2 * 132) == 8
    assert choose_num_splits(32, 1, 4096, 132) == 4


def test_split_rule():
    # the fewest splits whose programs fill >= 85 % of their last wave
    assert choose_num_splits(32, 2, 4096, 132, fill_waves=True) == 2  # 128 programs: one wave, 97 %
    assert choose_num_splits(3, 2, 8192, 132, fill_waves=True) == 19  # 114 programs, 86 %
    assert choose_num_splits(300, 2, 4096, 132, fill_waves=True) == 1
    assert choose_num_splits(1, 2, 2 * SPLIT_GRAIN, 132, fill_waves=True) == 2  # capped: no split shorter than a tile
    assert choose_num_splits(1, 2, 1 << 20, 132, fill_waves=True) == 57  # 114 programs
    assert choose_num_splits(1, 1, 1 << 20, 132, fill_waves=True) == 64  # 113 would be needed: the cap
    # the other rule: about two programs per SM, as flash_decode
    assert choose_num_splits(32, 1, 4096, 132, fill_waves=False) == 9
    for rows in range(2, 70):
        s = choose_num_splits(rows, 2, 1 << 20, 132, fill_waves=True)
        n = rows * 2 * s
        assert n / (-(-n // 132) * 132) >= 0.85
