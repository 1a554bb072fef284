"""Lab 18's check passes the lab's solution and catches the slips a student makes in the split-K partial
kernel: the RMSNorm's squares taken after the gain, the gain forgotten, every split reading the first K
slice, a program reading the next row of x; and the harness (ch18.split_k_gemv) is kernels/gemv.py's
answer on the lab's own solution."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from minillm.kernels.gemv import gemv_ref
from minillm.labs import CheckFailed, ch18
from minillm.labs.student import solution_namespace

LAB = Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "18_decode_floor.py"
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # where the Triton kernels run


@pytest.fixture(scope="module")
def ns() -> dict:
    return solution_namespace(LAB)


@pytest.mark.slow
def test_solution_passes(ns):
    assert ch18.check_gemv_partials(ns["gemv_partials"], cases=3).passed


def test_harness_matches_the_unfused_ops(ns, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(3, 70, generator=g).to(DEVICE), (torch.randn(20, 70, generator=g) * 70**-0.5).to(DEVICE)
    gain, res = (1 + 0.2 * torch.randn(70, generator=g)).to(DEVICE), torch.randn(3, 10, generator=g).to(DEVICE)
    bias = torch.randn(20, generator=g).to(DEVICE)
    got = ch18.split_k_gemv(ns["gemv_partials"], x, w, bias, norm_weight=gain, residual=res, silu_mul=True,
                            block=(8, 16))
    torch.testing.assert_close(got, gemv_ref(x, w, bias, norm_weight=gain, residual=res, silu_mul=True),
                               rtol=2e-5, atol=2e-5)


@triton.jit
def _slipped(X, W, G, PART, SQ, N, K, stride_xm, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             NORM: tl.constexpr, SQUARES_AFTER_GAIN: tl.constexpr, NO_GAIN: tl.constexpr,
             FIRST_SLICE: tl.constexpr, NEXT_ROW: tl.constexpr):
    """The solution with one slip switched on."""
    pid_n, pid_s, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    M = tl.num_programs(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (0 if FIRST_SLICE else pid_s * BLOCK_K) + tl.arange(0, BLOCK_K)
    n_ok, k_ok = offs_n < N, offs_k < K
    w = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    row = (m + 1) % M if NEXT_ROW else m
    x = tl.load(X + row * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if NORM and not NO_GAIN:
        x_g = x * tl.load(G + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    else:
        x_g = x
    ss = tl.sum(x_g * x_g, axis=0) if SQUARES_AFTER_GAIN else tl.sum(x * x, axis=0)
    tl.store(PART + (pid_s * M + m) * N + offs_n, tl.sum(w * x_g[None, :], axis=1), mask=n_ok)
    if pid_n == 0:
        tl.store(SQ + pid_s * M + m, ss)


class _With:
    """`kernel[grid](...)` with extra constexpr flags, as the check launches the student's kernel."""

    def __init__(self, **flags):
        self.flags = dict(SQUARES_AFTER_GAIN=False, NO_GAIN=False, FIRST_SLICE=False, NEXT_ROW=False) | flags

    def __getitem__(self, grid):
        return lambda *args, **kw: _slipped[grid](*args, **kw, **self.flags)


def test_the_slip_free_stand_in_passes():
    assert ch18.check_gemv_partials(_With(), cases=3, engine=False).passed


@pytest.mark.parametrize("slip", ["SQUARES_AFTER_GAIN", "NO_GAIN", "FIRST_SLICE", "NEXT_ROW"])
def test_slips_are_caught(slip):
    with pytest.raises(CheckFailed, match="gemv_partials"):
        # the first cases always have a norm (a few seeds): the check's kernel cases catch every slip
        for seed in (1, 2, 3):
            ch18.check_gemv_partials(_With(**{slip: True}), cases=6, engine=False, seed=seed)


@pytest.mark.slow
def test_a_slip_in_the_engine_is_caught():
    """The engine check alone: a kernel whose every split reads the first K slice changes the tiny model's tokens."""
    with pytest.raises(CheckFailed, match="engine"):
        ch18._check_in_the_engine(_With(FIRST_SLICE=True), DEVICE)
