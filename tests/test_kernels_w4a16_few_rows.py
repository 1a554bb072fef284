"""What the two few-row int4 kernels (w4a16_gemv.py, w4a16_swap.py) promise beyond accuracy, checked on
both with the same inputs: a split-K reduction in a fixed order inside the kernel (the same input gives
the same bits, and the counters are zero again for the next launch), and rows that do not depend on the
batch around them. Under Triton's interpreter on a CPU, natively on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from test_kernels_w4a16 import int4_weight

from minillm.kernels import w4a16_gemv as gemv
from minillm.kernels import w4a16_swap as swap
from minillm.kernels.w4a16_gemv import _counters

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# kernel, its row limit, explicit tiles giving 3 N tiles x 4 split-K slices on a [37, 512] weight
KERNELS = {"gemv": (gemv.w4a16_gemv, gemv.MAX_ROWS, (16, 8, 4, 1, 1)),
           "swap": (swap.w4a16_swap, swap.MAX_ROWS, (16, 4, 4, 1))}  # swap: slices of 2 groups of 64


@pytest.fixture
def g(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("name", KERNELS)
def test_split_k_is_deterministic_and_leaves_the_counters_zeroed(name, g):
    kernel, _, tiles = KERNELS[name]
    qweight, scales, mins = int4_weight(g, 37, 512, 64)
    x = torch.randn(2, 512, generator=g).to(DEVICE)
    first = kernel(x, qweight, scales, mins, 64, tiles=tiles)
    assert torch.equal(kernel(x, qweight, scales, mins, 64, tiles=tiles), first)
    assert int(_counters[x.device].abs().sum()) == 0


@pytest.mark.parametrize("name", KERNELS)
def test_rows_do_not_depend_on_the_batch(name, g):
    """Row i alone and in a batch of up to the kernel's row limit gives the same bits."""
    kernel, max_rows, _ = KERNELS[name]
    qweight, scales, mins = int4_weight(g, 40, 256, 32)
    x = torch.randn(max_rows, 256, generator=g).to(DEVICE)
    full = kernel(x, qweight, scales, mins, 32)
    for M in sorted({1, 2, max_rows // 2 + 1, max_rows - 1} & set(range(1, max_rows))):
        assert torch.equal(kernel(x[:M].contiguous(), qweight, scales, mins, 32), full[:M])
    r = max_rows // 2  # one row from the middle, alone
    assert torch.equal(kernel(x[r:r + 1].contiguous(), qweight, scales, mins, 32), full[r:r + 1])
