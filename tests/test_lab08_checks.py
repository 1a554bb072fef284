"""Lab 08's W4A16 GEMV check passes the lab's solution and catches the slips a student makes: nibbles
swapped, the min forgotten, every group given the first group's scale, nothing accumulated; the stub
(the loop left as `raise NotImplementedError`) fails at the check.

The check's tolerance is a worst-case bound of fp32 rounding (ch08.gemv_tolerance), loose by design:
measured on 12 random cases under the CPU interpreter, the solution's error is at most 3e-4 of it in fp32 and 0.34 in fp16 (the
output's half ulp), and each slip here misses it by a factor of 3,000 or more. Rounding the dequantized
weight to x's dtype (what w4a16.py's tensor-core tiles do) stays inside it (0.8 in fp16): not a slip
the check claims to catch."""

from __future__ import annotations

from pathlib import Path

import pytest
import triton
import triton.language as tl

from minillm.labs import CheckFailed, ch08
from minillm.labs.student import solution_namespace

LAB = Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "08_quantization.py"


def test_solution_passes():
    assert ch08.check_w4a16_gemv(solution_namespace(LAB)["w4a16_gemv"], cases=12).passed


@triton.jit
def _slipped(X, QW, S, Mins, Y, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
             GROUP: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr, NO_MIN: tl.constexpr,
             FIRST_SCALE: tl.constexpr, NOTHING: tl.constexpr):
    """The lab's solution with one slip switched on."""
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_b = tl.arange(0, GROUP // 2)
    x_row = X + row * stride_xm
    w_rows = QW + offs_n[:, None] * stride_qn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(0, K // GROUP):
        cols = g * (GROUP // 2) + offs_b
        packed = tl.load(w_rows + cols[None, :], mask=n_ok[:, None], other=0)
        gs = 0 if FIRST_SCALE else g
        s = tl.load(S + offs_n * stride_sn + gs, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        m = tl.load(Mins + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if NO_MIN:
            m = m * 0.0
        x_even = tl.load(x_row + 2 * cols).to(tl.float32)[None, :]
        x_odd = tl.load(x_row + 2 * cols + 1).to(tl.float32)[None, :]
        lo, hi = packed & 0xF, packed >> 4
        if SWAP:
            lo, hi = hi, lo
        w_even = lo.to(tl.float32) * s + m
        w_odd = hi.to(tl.float32) * s + m
        if not NOTHING:
            acc += tl.sum(w_even * x_even + w_odd * x_odd, axis=1)
    tl.store(Y + row * stride_ym + offs_n, acc.to(Y.dtype.element_ty), mask=n_ok)


SLIPS = ["SWAP", "NO_MIN", "FIRST_SCALE", "NOTHING"]


class _Slipped:  # what the check launches: kernel[grid](..., GROUP=..., BLOCK_N=...), the slip's flags added
    def __init__(self, **flags):
        self.flags = {name: False for name in SLIPS} | flags

    def __getitem__(self, grid):
        return lambda *args, **kw: _slipped[grid](*args, **kw, **self.flags)


def test_the_slipped_kernel_without_a_slip_passes():
    assert ch08.check_w4a16_gemv(_Slipped(), cases=4).passed


@pytest.mark.parametrize("slip", SLIPS)
def test_slips_are_caught(slip):
    with pytest.raises(CheckFailed, match="w4a16_gemv"):
        ch08.check_w4a16_gemv(_Slipped(**{slip: True}), cases=12)


def test_the_stub_fails_at_the_check():
    @triton.jit
    def stub(X, QW, S, Mins, Y, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
             GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
        raise NotImplementedError("your code here")

    with pytest.raises(Exception, match="your code here"):
        ch08.check_w4a16_gemv(stub, cases=2)
