"""Lab 16's checks pass the lab's solutions and catch the slips a student makes: slot -1 read as Python's last
slot, every part of a fused layer reading the first rank chunk, the update added to a copy of y;
the scaling without rsLoRA's square root, or with it always."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from minillm.labs import CheckFailed, ch16
from minillm.labs.student import solution_namespace

pytest.importorskip("peft")
LAB = Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "16_multi_lora.py"


@pytest.fixture(scope="module")
def ns() -> dict:
    return solution_namespace(LAB)


@pytest.mark.slow
def test_solutions_pass(ns):
    assert ch16.check_bgmv(ns["bgmv"], cases=20).passed
    assert ch16.check_lora_scaling(ns["lora_scaling"], cases=20).passed


@pytest.mark.slow
@pytest.mark.parametrize("slip", ["slot -1 is the last slot", "one chunk for every part", "a copy of y"])
def test_bgmv_slips_fail(ns, slip):
    right = ns["bgmv"]

    def slipped(y, x, a, b, slots, slice_offsets=(0,)):
        if slip == "slot -1 is the last slot":
            return right(y, x, a, b, slots % a.shape[0], slice_offsets)
        if slip == "one chunk for every part":
            R = b.shape[2]
            a2 = a.clone()
            for i in range(1, a.shape[1] // R):
                a2[:, i * R : (i + 1) * R] = a[:, :R]
            return right(y, x, a2, b, slots, slice_offsets)
        right(y.clone(), x, a, b, slots, slice_offsets)  # the update lands in a copy, not in y

    with pytest.raises(CheckFailed):
        ch16.check_bgmv(slipped, cases=40)


@pytest.mark.slow
def test_one_chunk_slip_fails_inside_the_engine(ns):
    """With no random cases the engine alone must catch a fused layer whose parts all read chunk 0."""
    right = ns["bgmv"]

    def slipped(y, x, a, b, slots, slice_offsets=(0,)):
        R = b.shape[2]
        a2 = a.clone()
        for i in range(1, a.shape[1] // R):
            a2[:, i * R : (i + 1) * R] = a[:, :R]
        return right(y, x, a2, b, slots, slice_offsets)

    with pytest.raises(CheckFailed, match="inside the engine"):
        ch16.check_bgmv(slipped, cases=0)


@pytest.mark.slow
@pytest.mark.parametrize("slip", [lambda r, a, rs: a / r, lambda r, a, rs: a / math.sqrt(r), lambda r, a, rs: r / a])
def test_scaling_slips_fail(slip):
    with pytest.raises(CheckFailed):
        ch16.check_lora_scaling(slip, cases=40)


@pytest.mark.slow
def test_scaling_slip_caught_inside_the_engine():
    """Only the engine run, which has an rsLoRA adapter, sees a function that ignores use_rslora."""
    with pytest.raises(CheckFailed, match="inside the engine"):
        ch16.check_lora_scaling(lambda r, a, rs: a / r, cases=0)
