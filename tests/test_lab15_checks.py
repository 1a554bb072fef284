"""Lab 15's checks pass the lab's solutions and catch the slips a student makes: StreamingLLM's sinks
counted in whole tokens rather than whole blocks, a recent window one block short or without the step's
own block; H2O counting evicted entries as held, forgetting the step's own block, letting the recent
window go, or breaking ties toward the newer block. Some slips agree with the policy on most random
inputs: the engine run must catch them too (its kept maps are compared step by step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from minillm.engine.kv_eviction import NULL_BLOCK
from minillm.labs import CheckFailed, ch15
from minillm.labs.student import solution_namespace

LAB = Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "15_kv_eviction.py"


@pytest.fixture(scope="module")
def ns() -> dict:
    return solution_namespace(LAB)


def test_function_level_checks(ns):
    """The random-input part alone (no engine): the solutions pass, a slip fails."""
    assert ch15.check_streaming_evictable(ns["streaming_evictable"], cases=300, engine_cases=0).passed
    assert ch15.check_h2o_victims(ns["h2o_victims"], cases=300, engine_cases=0).passed
    with pytest.raises(CheckFailed, match="streaming_evictable"):
        ch15.check_streaming_evictable(lambda s, bs, sink, b: (sink // bs, s // bs - (b // bs - sink // bs) + 1),
                                       cases=300, engine_cases=0)


@pytest.mark.slow
def test_solutions_pass_in_the_engine(ns):
    assert ch15.check_streaming_evictable(ns["streaming_evictable"], cases=50, engine_cases=2).passed
    assert ch15.check_h2o_victims(ns["h2o_victims"], cases=50, engine_cases=2).passed


@pytest.mark.slow
@pytest.mark.parametrize("slip", ["sinks in tokens", "window one short", "no own block"])
def test_streaming_slips_fail(ns, slip):
    right = ns["streaming_evictable"]

    def slipped(start, bs, sink, budget):
        lo, hi = right(start, bs, sink, budget)
        if slip == "sinks in tokens":
            return sink // bs, hi
        if slip == "window one short":
            return lo, hi + 1
        return lo, start // bs - (budget // bs - lo)  # the recent window ends before start's block

    with pytest.raises(CheckFailed):
        ch15.check_streaming_evictable(slipped, cases=300, engine_cases=2)


@pytest.mark.slow
@pytest.mark.parametrize("slip", ["null entries held", "no own block", "recent window evicted", "newest ties"])
def test_h2o_slips_fail(ns, slip):
    right = ns["h2o_victims"]

    def slipped(table, start, bs, budget, mass):
        if slip == "null entries held":
            return right([b if b != NULL_BLOCK else 1 for b in table], start, bs, budget, mass)
        if slip == "no own block":
            return right(table, start, bs, budget + 1, mass)
        if slip == "recent window evicted":
            cur = start // bs
            held = [i for i in range(min(cur, len(table))) if table[i] != NULL_BLOCK]
            excess = len(held) + 1 - budget
            return sorted(sorted(held, key=lambda i: mass.get(i, 0.0))[:max(0, excess)])
        return right(table, start, bs, budget, {i: m - 1e-9 * i for i, m in mass.items()})  # ties: the newer first

    with pytest.raises(CheckFailed):
        ch15.check_h2o_victims(slipped, cases=300, engine_cases=2)
