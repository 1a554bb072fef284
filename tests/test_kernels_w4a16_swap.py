"""The swapped tensor-core W4A16 kernel (M <= 16) against the fp32 product with the fp32-dequantized
weight, on fresh random inputs with odd N and groups whose half is not a power of two: under Triton's
interpreter on a CPU (fp32 and fp16), natively on a GPU at Llama-3-8B's shapes (bf16 and fp16).

The tolerance is the arithmetic's, element by element (test_kernels_w4a16.assert_within_rounding).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels_w4a16 import assert_within_rounding, int4_weight

from minillm.kernels import w4a16 as w4a16_module
from minillm.kernels.w4a16_swap import MAX_ROWS, choose_swap_tiles, swap_supports, w4a16_swap

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16] if INTERPRETED else [torch.bfloat16, torch.float16]
needs_cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,group_size", [(1, 45, 96, 32), (2, 77, 384, 64), (5, 33, 384, 96),
                                              (16, 19, 256, 128), (3, 50, 192, 32)])
def test_swap_matches_the_dequantized_product(M, N, K, group_size, dtype, g):
    qweight, scales, mins = int4_weight(g, N, K, group_size, dtype)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    bn, _, warps, stages = choose_swap_tiles(N, K, group_size, x.device)
    for split in (None, 2):  # chosen, and a split whose last slice is short where K / G is odd
        tiles = None if split is None else (bn, split, warps, stages)
        y = w4a16_swap(x, qweight, scales, mins, group_size, tiles=tiles)
        assert y.dtype == dtype and y.shape == (M, N)
        assert_within_rounding(y, x, qweight, scales, mins, group_size)


def test_w4a16_gemm_runs_the_swap_kernel_at_decode_sizes(g):
    qweight, scales, mins = int4_weight(g, 24, 128, 32)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # fp32 keeps the tiles on a GPU
    for M in (1, MAX_ROWS):
        x = torch.randn(M, 128, generator=g).to(dtype).to(DEVICE)
        assert torch.equal(w4a16_module.w4a16_gemm(x, qweight, scales, mins, 32),
                           w4a16_swap(x, qweight, scales, mins, 32))
    assert not swap_supports(torch.randn(MAX_ROWS + 1, 128), 32)
    with pytest.raises(ValueError, match=f"w4a16_swap takes at most {MAX_ROWS} rows, got 17"):
        w4a16_swap(torch.randn(17, 128).to(DEVICE), qweight, scales, mins, 32)


@needs_cuda
def test_fp32_activations_take_the_tiles_on_a_gpu():
    """An IEEE fp32 dot is exact but slow on a GPU: fp32 decode keeps the tiles there."""
    assert not swap_supports(torch.randn(1, 128, device="cuda"), 32)
    assert swap_supports(torch.randn(1, 128, device="cuda", dtype=torch.bfloat16), 32)


@needs_cuda
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])  # Llama-3-8B
def test_llama3_shapes_on_gpu(M, N, K, g):
    for dtype in DTYPES:
        for group_size in (32, 128):
            qweight, scales, mins = int4_weight(g, N, K, group_size, dtype)
            x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
            y = w4a16_swap(x, qweight, scales, mins, group_size)
            assert_within_rounding(y, x, qweight, scales, mins, group_size)
            assert torch.equal(w4a16_swap(x[:1].contiguous(), qweight, scales, mins, group_size), y[:1])
