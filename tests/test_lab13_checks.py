"""Lab 13's checks pass the lab's solutions and catch the slips a student makes: a kernel that forgets the
new residual or averages over the padded tile, a finish rule that wastes nothing (the synchronous engine's)
or wastes a row on max_tokens too."""

from __future__ import annotations

from pathlib import Path

import pytest
import triton
import triton.language as tl

from minillm.labs import CheckFailed, ch13
from minillm.labs.student import solution_namespace

LAB = Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "13_fast_path.py"


@pytest.fixture(scope="module")
def ns() -> dict:
    return solution_namespace(LAB)


def test_solutions_pass(ns):
    assert ch13.check_add_rms_norm(ns["add_rms_norm"], cases=6).passed
    assert ch13.check_finish_one_step_late(ns["finish_one_step_late"], cases=8).passed


@triton.jit
def _slipped(X, R, W, OUT, NEW_RES, H, eps, BLOCK: tl.constexpr, MEAN_OVER_BLOCK: tl.constexpr,
             NORM_X: tl.constexpr):
    """The solution with one slip: the mean taken over the padded tile, or x normalised instead of x + r."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * H + cols, mask=mask, other=0.0)
    r = tl.load(R + row * H + cols, mask=mask, other=0.0)
    s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(NEW_RES + row * H + cols, s, mask=mask)
    xf = x.to(tl.float32) if NORM_X else s.to(tl.float32)
    n = BLOCK if MEAN_OVER_BLOCK else H
    y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)).to(x.dtype)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(OUT + row * H + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


@pytest.mark.parametrize("slip", [dict(MEAN_OVER_BLOCK=True, NORM_X=False), dict(MEAN_OVER_BLOCK=False, NORM_X=True)],
                         ids=["mean_over_block", "no_residual"])
def test_kernel_slips_are_caught(slip):
    class Slipped:  # what the check launches: kernel[grid](..., BLOCK=...), the slip's flags added
        def __getitem__(self, grid):
            return lambda *args, **kw: _slipped[grid](*args, **kw, **slip)

    with pytest.raises(CheckFailed):
        ch13.check_add_rms_norm(Slipped(), cases=20)


def test_finish_rule_slips_are_caught(ns):
    solution = ns["finish_one_step_late"]

    def synchronous(requests):  # the plain engine: the host knows every token before the next step
        kept, wasted = solution(requests)
        return kept, [0] * len(wasted)

    def always_late(requests):  # forgets that the host counts max_tokens
        kept, wasted = solution(requests)
        return kept, [1] * len(wasted)

    def drops_the_stop_token(requests):
        kept, wasted = solution(requests)
        return [k[:-1] if k and k[-1] in r.stop_token_ids else k for k, r in zip(kept, requests)], wasted

    for slip in (synchronous, always_late, drops_the_stop_token):
        with pytest.raises(CheckFailed):
            ch13.check_finish_one_step_late(slip, cases=40)
