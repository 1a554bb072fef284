"""The acceptance model (spec_decode/acceptance.py) against the rejection sampler it describes and against
brute force: alpha = sum min(p, q) is the sampler's acceptance rate, (1 - alpha^(k+1)) / (1 - alpha) the
mean tokens of i.i.d. acceptance, optimal_k the best of every k, and the offline replay counts exactly."""

from __future__ import annotations

import random

import pytest
import torch

from minillm.sampling import SamplingParams
from minillm.sampling.rejection_sampler import RejectionSampler, spec_metadata
from minillm.spec_decode.acceptance import (
    acceptance_rate,
    expected_speedup,
    expected_tokens,
    offline_tokens_per_step,
    optimal_k,
)


def test_alpha_is_the_samplers_acceptance_rate():
    """Fresh random p, q on 6 tokens; 20 000 one-draft verifies: the fraction accepted is alpha within
    6 standard errors (a draft is accepted exactly when it is emitted first: the residual is 0 at a
    token whose q exceeds its p, and a token whose p exceeds its q is always accepted)."""
    g = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    V, N = 6, 20000
    p = torch.softmax(torch.randn(2, V, generator=g), -1)  # [k + 1, V]
    q = torch.softmax(torch.randn(1, V, generator=g) * 2, -1)  # [k, V]
    drafts = torch.multinomial(q[0], N, replacement=True, generator=g)  # [N]
    meta = spec_metadata([SamplingParams(temperature=1.0)] * N, list(range(N)), [0] * N, [1] * N, V, "cpu")
    out = RejectionSampler()(torch.log(p).repeat(N, 1), [1] * N, drafts.tolist(), q.repeat(N, 1), meta)
    accepted = sum(e[0] == d for e, d in zip(out, drafts.tolist())) / N
    alpha = float(acceptance_rate(p[0], q[0]))
    assert alpha == pytest.approx(1 - 0.5 * float((p[0] - q[0]).abs().sum()), abs=1e-6)  # = 1 - TV(p, q)
    assert abs(accepted - alpha) < 6 * (alpha * (1 - alpha) / N) ** 0.5


def test_expected_tokens_is_the_geometric_sum_and_the_simulation():
    rng = random.Random(0)
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for k in (0, 1, 4):
            assert expected_tokens(alpha, k) == pytest.approx(sum(alpha**j for j in range(k + 1)))
    alpha, k, n = 0.7, 4, 20000  # i.i.d. acceptance: accepted prefix + 1
    sim = sum(next((j for j in range(k) if rng.random() >= alpha), k) + 1 for _ in range(n)) / n
    assert sim == pytest.approx(expected_tokens(alpha, k), abs=6 * 1.5 / n**0.5)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens(1.5, 2)


def test_optimal_k_is_the_best_k():
    for alpha in (0.0, 0.4, 0.8, 0.95):
        for c in (0.0, 0.02, 0.2, 1.0):
            best = optimal_k(alpha, c, k_max=12)
            speedups = [expected_speedup(alpha, k, c) for k in range(13)]
            assert speedups[best] == max(speedups) and best == speedups.index(max(speedups))
    assert optimal_k(0.0, 0.1) == 0  # drafts that are never accepted never pay
    assert optimal_k(0.9, 0.01) > optimal_k(0.9, 0.2) > 0  # dearer drafts: fewer of them
    # a verify step that costs more with k (a compute-bound batch) pulls the best k down
    assert optimal_k(0.8, 0.02, verify_cost=lambda k: 1 + 0.2 * k) < optimal_k(0.8, 0.02)


def test_offline_replay_counts_steps_exactly():
    tokens = list(range(10)) + [5, 6, 7, 8, 9, 1]  # prompt 0..9, then 6 generated tokens
    oracle = lambda prefix, k: tokens[len(prefix):len(prefix) + k]  # always right
    assert offline_tokens_per_step(tokens, 10, oracle, 2) == (6 / 2, [2, 2])
    wrong = lambda prefix, k: [-1] * k
    assert offline_tokens_per_step(tokens, 10, wrong, 3) == (1.0, [0, 0, 0])
    # right for one token, then wrong: steps of 2 tokens, 3 steps
    half = lambda prefix, k: tokens[len(prefix):len(prefix) + 1] + [-1] * (k - 1)
    assert offline_tokens_per_step(tokens, 10, half, 3) == (2.0, [3, 0, 0])
