"""Checks for lab 09: the two small functions at the heart of speculative decoding.

  ngram_propose          prompt lookup, against minillm's proposer (spec_decode/ngram.py)
  verify_greedy          greedy verification, against minillm's RejectionSampler on one-hot logits
  speculative_accept     the random rule, on given coins and a given picker, against a plain reference
                         that follows sampling/rejection_sampler.py step by step

Every case is fresh and random: token lists with repeats (so n-grams recur), draft/target pairs that
agree for a while, distributions where a draft's q is sometimes above and sometimes below p.
"""

from __future__ import annotations

import random

import torch

from ..sampling import SamplingParams
from ..sampling.rejection_sampler import RejectionSampler, spec_metadata
from ..spec_decode.ngram import ngram_lookup
from .checker import check


def _tokens(rng: random.Random) -> list[int]:
    """A sequence built from a few recurring phrases over a small vocabulary."""
    vocab = rng.choice([3, 5, 20])
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 4))]
    out = []
    while len(out) < rng.randint(1, 40):
        out += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(vocab)]
    return out or [0]


def check_ngram_propose(fn, cases: int = 300):
    """fn(tokens, min_n, max_n, k) -> the k (or fewer) tokens after the earliest earlier occurrence of
    the longest suffix of length n in [min_n, max_n]; [] when none occurs."""
    def case(rng):
        lo = rng.randint(1, 3)
        return _tokens(rng), lo, rng.randint(lo, 4), rng.randint(1, 6)

    return check("ngram_propose", lambda *c: list(fn(*c)), ngram_lookup, case, cases=cases)


def reference_verify_greedy(draft_tokens: list[int], target_argmax: list[int]) -> list[int]:
    """minillm's RejectionSampler, greedy, on logits whose argmax is target_argmax."""
    V = max([*draft_tokens, *target_argmax]) + 1
    logits = torch.zeros(len(target_argmax), V)
    logits[torch.arange(len(target_argmax)), torch.tensor(target_argmax)] = 1.0
    k = len(draft_tokens)
    meta = spec_metadata([SamplingParams(temperature=0)], [0], [0], [k], V, "cpu")
    return RejectionSampler()(logits, [k], list(draft_tokens), None, meta)[0]


def check_verify_greedy(fn, cases: int = 300):
    """fn(draft_tokens [k], target_argmax [k + 1]) -> the tokens emitted: the drafts while they match
    the target's argmax, then the target's token at the first mismatch (or the bonus after all k)."""
    def case(rng):
        k = rng.randint(0, 6)
        target = [rng.randrange(6) for _ in range(k + 1)]
        agree = rng.randint(0, k)
        drafts = target[:agree] + [rng.randrange(6) for _ in range(k - agree)]
        return drafts, target

    return check("verify_greedy", lambda *c: list(fn(*c)), reference_verify_greedy, case, cases=cases)


def reference_speculative_accept(p, q, drafts, coins, pick) -> list[int]:
    """The random rule of rejection_sampler.py, one sequence, in plain Python:
    accept draft j when coins[j] * q[j][d] <= p[j][d] (u < p/q); at the first rejection emit
    pick(max(p_j - q_j, 0)) (p_j itself if that is all zero) and stop; after k acceptances emit pick(p_k)."""
    out = []
    for j, d in enumerate(drafts):
        if coins[j] * q[j][d] <= p[j][d]:
            out.append(d)
            continue
        residual = [max(a - b, 0.0) for a, b in zip(p[j], q[j])]
        out.append(pick(residual if sum(residual) > 0 else list(p[j])))
        return out
    out.append(pick(list(p[len(drafts)])))
    return out


def _distribution(rng: random.Random, V: int) -> list[float]:
    w = [rng.random() ** 3 if rng.random() < 0.8 else 0.0 for _ in range(V)]
    w[rng.randrange(V)] += 0.1
    s = sum(w)
    return [x / s for x in w]


def check_speculative_accept(fn, cases: int = 300):
    """fn(p [k+1][V], q [k][V], drafts [k], coins [k], pick) -> the tokens emitted. pick(weights) picks
    a token from unnormalized weights (the check's is deterministic, so answers can be compared)."""
    def case(rng):
        V, k = rng.randint(2, 6), rng.randint(0, 5)
        p = [_distribution(rng, V) for _ in range(k + 1)]
        q = [_distribution(rng, V) if rng.random() < 0.8 else list(p[j]) for j in range(k)]
        drafts = [rng.choices(range(V), weights=q[j])[0] for j in range(k)]
        coins = [rng.random() for _ in range(k)]
        clocks = [rng.expovariate(1.0) for _ in range(V)]  # an exponential race, fixed per case

        def pick(weights):
            return max(range(V), key=lambda i: weights[i] / clocks[i])
        return p, q, drafts, coins, pick

    return check("speculative_accept", lambda *c: list(fn(*c)), reference_speculative_accept, case, cases=cases)
