"""token_bitmask: the Triton kernel that sets disallowed logits to -inf, against the plain-PyTorch
reference and a per-token loop (the oracle): on a CPU under Triton's interpreter with small shapes,
natively on a GPU with SmolLM2's vocabulary. Masking is a copy: held to bit-for-bit equality."""

from __future__ import annotations

import os

import pytest
import torch

from minillm.kernels.token_bitmask import apply_token_bitmask_triton
from minillm.structured_output import apply_token_bitmask

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs a GPU or TRITON_INTERPRET=1")


def _case(seed, B, V, W=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    W = W or (V + 31) // 32
    logits = torch.randn(B, V, generator=g).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (B, W), generator=g, dtype=torch.int64).to(torch.int32)
    return logits, bitmask


def _oracle(logits, bitmask, rows=None):
    out = logits.clone()
    for i, r in enumerate(range(logits.shape[0]) if rows is None else rows):
        for v in range(min(logits.shape[1], bitmask.shape[1] * 32)):
            if not (int(bitmask[i, v // 32]) >> (v % 32)) & 1:
                out[r, v] = float("-inf")
    return out


@pytest.mark.parametrize(("B", "V", "block"), [(1, 37, 64), (3, 200, 64), (2, 97, 32)] if INTERPRETED
                         else [(1, 49152, 1024), (64, 49152, 1024), (5, 151936, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_and_oracle(seed, B, V, block, dtype):
    logits, bitmask = _case(seed, B, V, dtype=dtype)
    ref = apply_token_bitmask(logits.clone(), bitmask)
    if INTERPRETED:
        assert torch.equal(ref, _oracle(logits, bitmask))
    got = apply_token_bitmask_triton(logits.to(DEVICE), bitmask.to(DEVICE), block=block).cpu()
    assert torch.equal(got, ref)


def test_kernel_rows_by_indices_and_padded_vocab(seed):
    """Only rows 0 and 2 are constrained; the logits are wider than 32*W (padded embedding rows)."""
    logits, bitmask = _case(seed, 3, 70, W=2)  # 70 logits, 64 mask bits: the last 6 left alone
    rows = [2, 0]
    want = _oracle(logits, bitmask[:2], rows)
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask[:2], indices=rows), want)
    got = apply_token_bitmask_triton(logits.to(DEVICE), bitmask[:2].contiguous().to(DEVICE), indices=rows, block=32)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got.cpu()[1], logits[1]) and torch.equal(got.cpu()[:, 64:], logits[:, 64:])


def test_kernel_refuses_bad_input():
    logits, bitmask = _case(0, 2, 64)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_triton(logits.to(DEVICE), bitmask.to(torch.int64).to(DEVICE))
    with pytest.raises(ValueError, match="pass indices"):
        apply_token_bitmask_triton(logits.to(DEVICE), bitmask[:1].to(DEVICE))
