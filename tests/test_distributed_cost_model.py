"""The alpha-beta all-reduce model: its formulas against hand arithmetic, and the fit recovering the
(alpha, beta) that generated a sweep, with and without noise."""

from __future__ import annotations

import random

import pytest

from minillm.distributed.cost_model import AlphaBeta, fit_alpha_beta, tp_decode_step_time

SIZES = [8 * 1024 * 4**i for i in range(7)]  # 8 KB ... 32 MB


def test_ring_and_one_shot_by_hand():
    ab = AlphaBeta(alpha=5e-6, beta=100e9)
    n = 64 * 2**20
    assert ab.allreduce_time(n, 1) == 0.0  # one rank: nothing to exchange
    # p = 4: 2 (p-1) = 6 steps of alpha, and 2 (p-1)/p = 1.5 message sizes over the link
    assert ab.allreduce_time(n, 4) == pytest.approx(6 * 5e-6 + 1.5 * n / 100e9)
    one = AlphaBeta(5e-6, 100e9, "one_shot")
    assert one.allreduce_time(n, 4) == pytest.approx(5e-6 + 3 * n / 100e9)
    # p = 2: the ring's 2 steps of n/2 each move as many bytes as one shot's n, at twice the alpha
    assert ab.allreduce_time(8192, 2) - one.allreduce_time(8192, 2) == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="algorithm"):
        AlphaBeta(1e-6, 1e9, "tree").allreduce_time(1, 2)


@pytest.mark.parametrize("algorithm", ["ring", "one_shot"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_fit_recovers_alpha_and_beta(algorithm, p, seed):
    rng = random.Random(seed)
    true = AlphaBeta(rng.uniform(2e-6, 30e-6), rng.uniform(20e9, 400e9), algorithm)
    times = [true.allreduce_time(n, p) for n in SIZES]
    fit = fit_alpha_beta(SIZES, times, p, algorithm)
    assert fit.alpha == pytest.approx(true.alpha, rel=1e-6)
    assert fit.beta == pytest.approx(true.beta, rel=1e-6)
    # 3 % multiplicative noise: the fit still predicts every size within a few percent
    noisy = [t * rng.uniform(0.97, 1.03) for t in times]
    fit = fit_alpha_beta(SIZES, noisy, p, algorithm)
    for n, t in zip(SIZES, times):
        assert fit.allreduce_time(n, p) == pytest.approx(t, rel=0.06)


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="two or more distinct sizes"):
        fit_alpha_beta([1024, 1024], [1e-5, 1e-5], 2)
    with pytest.raises(ValueError, match="moves nothing"):
        fit_alpha_beta([1, 2], [1e-5, 2e-5], 1)
    with pytest.raises(ValueError, match="alpha >= 0"):
        fit_alpha_beta([1024, 2048], [2e-5, 1e-5], 2)  # larger messages faster: no positive bandwidth


def test_decode_step_prediction_by_hand():
    """Llama-3-8B shaped: 16 GB of bf16 weights, 32 layers, hidden 4096, batch 1."""
    ab = AlphaBeta(alpha=8e-6, beta=150e9)
    W, B, L, H = 16e9, 3e12, 32, 4096
    t1 = tp_decode_step_time(W, B, 1, L, H, 1, 2, ab)
    assert t1 == pytest.approx(W / B)  # one rank: no all-reduce
    t2 = tp_decode_step_time(W, B, 2, L, H, 1, 2, ab)
    message = H * 2  # one token's hidden state in bf16: 8 KB
    assert t2 == pytest.approx(W / 2 / B + 2 * L * (2 * 8e-6 + message / 150e9))
    assert 1.0 < t1 / t2 < 2.0  # the weights halve; the 64 all-reduces take some of that back
