"""The W4A16 decode GEMV (M <= 4) against the fp32 product with the fp32-dequantized weight, on fresh
random inputs with odd N: under Triton's interpreter on a CPU, natively on a GPU at Llama-3-8B's shapes.

The tolerance is the arithmetic's, element by element (test_kernels_w4a16.assert_within_rounding).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels_w4a16 import assert_within_rounding, int4_weight

from minillm.kernels import w4a16 as w4a16_module
from minillm.kernels.w4a16_gemv import MAX_ROWS, choose_gemv_tiles, w4a16_gemv

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
needs_cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K,group_size", [(1, 45, 96, 32), (2, 77, 320, 64), (3, 33, 384, 128), (4, 19, 160, 32)])
def test_gemv_matches_the_dequantized_product(M, N, K, group_size, dtype, g):
    qweight, scales, mins = int4_weight(g, N, K, group_size, dtype)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    bn, bc, _, warps, stages = choose_gemv_tiles(N, K, x.device)
    for split in (None, 3):  # chosen, and a split whose last slice is short
        tiles = None if split is None else (bn, bc, split, warps, stages)
        y = w4a16_gemv(x, qweight, scales, mins, group_size, tiles=tiles)
        assert y.dtype == dtype and y.shape == (M, N)
        assert_within_rounding(y, x, qweight, scales, mins, group_size)


def test_w4a16_gemm_runs_the_gemv_up_to_gemv_m(g, monkeypatch):
    """The switch in w4a16_gemm (GEMV_M, 0 by default: the GEMV measured no faster than the tiles)."""
    qweight, scales, mins = int4_weight(g, 24, 128, 32)
    monkeypatch.setattr(w4a16_module, "GEMV_M", MAX_ROWS)
    for M in (1, MAX_ROWS):
        x = torch.randn(M, 128, generator=g).to(DEVICE)
        assert torch.equal(w4a16_module.w4a16_gemm(x, qweight, scales, mins, 32),
                           w4a16_gemv(x, qweight, scales, mins, 32))
    with pytest.raises(ValueError, match=f"w4a16_gemv takes at most {MAX_ROWS} rows, got 5"):
        w4a16_gemv(torch.randn(5, 128).to(DEVICE), qweight, scales, mins, 32)


def test_a_row_sliced_weight_is_read_correctly(g):
    """qweight rows at a stride that is not a multiple of 4 bytes cannot be viewed as int32: copied."""
    qweight, scales, mins = int4_weight(g, 8, 64, 32)
    wide = torch.zeros(8, 34, dtype=torch.uint8, device=DEVICE)
    wide[:, :32] = qweight
    x = torch.randn(1, 64, generator=g).to(DEVICE)
    y = w4a16_gemv(x, wide[:, :32], scales, mins, 32)
    assert torch.equal(y, w4a16_gemv(x, qweight, scales, mins, 32))


@needs_cuda
@pytest.mark.parametrize("M", [1, 3, 4])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])  # Llama-3-8B
def test_llama3_shapes_on_gpu(M, N, K, g):
    for group_size in (32, 128):
        qweight, scales, mins = int4_weight(g, N, K, group_size, torch.bfloat16)
        x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
        y = w4a16_gemv(x, qweight, scales, mins, group_size)
        assert_within_rounding(y, x, qweight, scales, mins, group_size)
        assert torch.equal(w4a16_gemv(x[:1].contiguous(), qweight, scales, mins, group_size), y[:1])
