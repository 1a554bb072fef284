"""Lab 17's check passes the lab's solution and catches the slips a student makes: the whole request on
the consumer without a handle (the tokens agree, but nothing came from the producer), a phase 1 that
generates every token, two different transfer ids (the consumer waits for K/V that never come)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from minillm.labs import CheckFailed, ch17
from minillm.labs.student import solution_namespace

LAB = Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "17_disaggregation.py"


def handle(params, **h):
    return dataclasses.replace(params, extra_args={"kv_transfer_params": h})


def test_solution_passes():
    assert ch17.check_two_phase(solution_namespace(LAB)["two_phase"], cases=3).passed


def no_handle(producer, consumer, rid, prompt, params):
    return ch17.finish(consumer, rid, prompt, params)


def whole_request_first(producer, consumer, rid, prompt, params):
    ch17.finish(producer, rid, prompt, handle(params, do_remote_decode=True, transfer_id=rid))
    return ch17.finish(consumer, rid, prompt, handle(params, do_remote_prefill=True, transfer_id=rid))


def two_ids(producer, consumer, rid, prompt, params):
    ch17.finish(producer, rid, prompt, dataclasses.replace(
        handle(params, do_remote_decode=True, transfer_id="a" + rid), max_tokens=1))
    return ch17.finish(consumer, rid, prompt, handle(params, do_remote_prefill=True, transfer_id="b" + rid))


@pytest.mark.parametrize("slip, match", [(no_handle, "computed .* prompt tokens"),
                                         (whole_request_first, "generated .* tokens"),
                                         (two_ids, "failed on the engine")])
def test_slips_are_caught(slip, match):
    with pytest.raises((CheckFailed, RuntimeError), match=match):
        ch17.check_two_phase(slip, cases=2)
