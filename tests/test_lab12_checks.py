"""Lab 12's merge and arrival checks (merge_rows, arrival_times): the lab's solutions pass, a correct
generator passes whatever its seed or random source, and the slips a student makes are caught.
(The lab's first three checks are tested in test_bench_serve.py.)"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from test_bench_serve import _lab12  # the lab's solution cells, run

from minillm.bench.serve_metrics import arrival_times as minillm_arrival_times
from minillm.labs import CheckFailed, ch12
from minillm.labs.ch12_arrivals import PROCESSES, dkw_epsilon


@pytest.fixture(scope="module")
def ns() -> dict:
    return _lab12()[1]


def test_solutions_pass(ns):
    assert ch12.check_merge_rows(ns["merge_rows"]).passed
    assert ch12.check_arrival_times(ns["arrival_times"]).passed


# ---- merge_rows -----------------------------------------------------------------------------------

def _merge(rows, slip=None):
    """The lab's merge with one slip switched on."""
    merged = {}
    for rid, finished, error, metrics, outs in rows:
        m = merged.setdefault(rid, [finished, error, metrics, {}])
        if slip != "finished_first":
            m[0] = finished
        if slip != "metrics_first":
            m[1], m[2] = error or m[1], metrics or m[2]
        for index, text, ids, cumulative, logprobs, finish, stop in outs:
            c = m[3].get(index)
            if c is None:
                m[3][index] = [[text], list(ids), cumulative, None if logprobs is None else list(logprobs), finish,
                               stop]
                continue
            c[0] = [text] if slip == "last_text" else c[0] + [text]
            c[1] += ids
            if logprobs is not None and slip != "first_logprobs":
                c[3] = list(logprobs) if c[3] is None else c[3] + list(logprobs)
            c[2] = c[2] + cumulative if slip == "sum_cumulative" and cumulative is not None else cumulative
            if slip != "first_finish":
                c[4], c[5] = finish, stop
    items = sorted(merged.items()) if slip == "sorted_requests" else merged.items()
    return [(rid, finished, None if slip == "no_error" else error, metrics,
             [(i, "".join(c[0]), *c[1:]) for i, c in (sorted(ch.items()) if slip == "sorted_choices" else ch.items())])
            for rid, (finished, error, metrics, ch) in items]


def test_merge_reference_variant_passes():
    assert ch12.check_merge_rows(_merge).passed  # the slip-free variant of the slips below is right


@pytest.mark.parametrize("slip", ["finished_first", "metrics_first", "last_text", "first_logprobs", "sum_cumulative",
                                  "first_finish", "sorted_requests", "no_error", "sorted_choices"])
def test_merge_slips_are_caught(slip):
    with pytest.raises(CheckFailed):
        ch12.check_merge_rows(lambda rows: _merge(rows, slip))


def test_merge_unmerged_rows_are_caught():
    with pytest.raises(CheckFailed):
        ch12.check_merge_rows(lambda rows: list(rows))  # one output per row, not per request


# ---- arrival_times --------------------------------------------------------------------------------

def _arrivals(gap, validate=True, first_at_gap=False, cumulative=True, post=None):
    """An arrival generator from a gap sampler gap(rng, rate, k), with one slip or another."""
    def fn(num, rate, burstiness=1.0, seed=0):
        if validate and not (rate > 0 and burstiness > 0 and math.isfinite(burstiness)):
            raise ValueError(f"bad rate {rate} or burstiness {burstiness}")
        if math.isinf(rate):
            return [0.0] * num
        rng = random.Random(seed)
        gaps = [gap(rng, rate, burstiness) for _ in range(num)]
        gaps = post(gaps) if post else gaps
        if not cumulative:
            return [0.0, *gaps[1:]][:num]
        times = list(np.cumsum(gaps)) if first_at_gap else [0.0, *np.cumsum(gaps)[:-1]][:num]
        return [float(t) for t in times]
    return fn


def _gamma(rng, rate, k):
    return rng.gammavariate(k, 1 / (rate * k))


def test_arrivals_correct_generators_pass_whatever_the_seed():
    """The bounds hold for correct generators on other seeds and another random source (numpy's)."""
    def numpy_gamma(num, rate, burstiness=1.0, seed=0):
        if not (rate > 0 and 0 < burstiness < math.inf):
            raise ValueError("rate > 0, 0 < burstiness < inf")
        if math.isinf(rate):
            return [0.0] * num
        gaps = np.random.default_rng(seed).gamma(burstiness, 1 / (rate * burstiness), num)
        return [0.0, *np.cumsum(gaps)[:-1].tolist()][:num]

    assert ch12.check_arrival_times(numpy_gamma).passed
    assert ch12.check_arrival_times(_arrivals(_gamma)).passed
    for shift in range(1, 9):  # other seeds, minillm's own generator as the student's
        processes = [(rate, k, seed + 7919 * shift) for rate, k, seed in PROCESSES]
        assert ch12.check_arrival_times(minillm_arrival_times, processes).passed


SLIPS = {
    "mean_as_rate": _arrivals(lambda rng, rate, k: rng.expovariate(1 / rate)),  # expovariate takes the rate
    "scale_ignores_k": _arrivals(lambda rng, rate, k: rng.gammavariate(k, 1 / rate)),  # mean k/λ
    "exponential_always": _arrivals(lambda rng, rate, k: rng.expovariate(rate)),  # burstiness ignored
    "uniform_gaps": _arrivals(lambda rng, rate, k: rng.uniform(0, 2 / rate)),  # right mean, wrong shape
    "fixed_gaps": _arrivals(lambda rng, rate, k: 1 / rate),  # a metronome
    "sorted_gaps": _arrivals(_gamma, post=sorted),  # right marginal, not independent
    "first_at_a_gap": _arrivals(_gamma, first_at_gap=True),
    "gaps_not_times": _arrivals(_gamma, cumulative=False),
    "no_validation": _arrivals(_gamma, validate=False),
    "nan_rate_passes": lambda num, rate, k=1.0, seed=0: (_arrivals(_gamma, validate=False) if rate != rate
                                                         else _arrivals(_gamma))(num, rate, k, seed),
    "unseeded": lambda num, rate, k=1.0, seed=0: _arrivals(_gamma)(num, rate, k, random.randrange(2**31)),
    "seed_ignored": lambda num, rate, k=1.0, seed=0: _arrivals(_gamma)(num, rate, k, 0),
}


@pytest.mark.parametrize("slip", list(SLIPS))
def test_arrival_slips_are_caught(slip):
    with pytest.raises(CheckFailed):
        ch12.check_arrival_times(SLIPS[slip])


def test_dkw_epsilon_is_the_bound_it_claims():
    n = 19_999
    eps = dkw_epsilon(n)
    assert math.isclose(2 * math.exp(-2 * n * eps**2), 1e-6, rel_tol=1e-9)
