"""Checks for lab 09: drafting, verifying, and the acceptance model of speculative decoding.

  ngram_propose          prompt lookup, against minillm's proposer (spec_decode/ngram.py)
  verify_greedy          greedy verification, against minillm's RejectionSampler on one-hot logits
  acceptance_rate        sum min(p, q) = 1 - TV(p, q), against spec_decode/acceptance.py
  expected_tokens        (1 - alpha^(k+1)) / (1 - alpha), against spec_decode/acceptance.py
  best_k                 the k with the best expected speedup, against spec_decode/acceptance.py's optimal_k
  speculative_accept     the random rule for one sequence, against minillm's RejectionSampler itself, driven
                         with the same coins and the same random draws the sampler uses
  batched_accept         the same rule for a flattened batch in tensor operations, against RejectionSampler

Every case is fresh and random: token lists with repeats (so n-grams recur), draft/target pairs that
agree for a while, distributions where a draft's q is sometimes above and sometimes below p (and
sometimes equal to it, so the residual is empty).
"""

from __future__ import annotations

import random

import torch

from ..sampling import SamplingParams
from ..sampling.rejection_sampler import ACCEPT_STREAM, RejectionSampler, draft_rows_of, race, spec_metadata
from ..sampling.rng import uniforms
from ..sampling.sampler import filtered_probs
from ..spec_decode.acceptance import acceptance_rate, expected_speedup, expected_tokens, optimal_k
from ..spec_decode.ngram import ngram_lookup
from .checker import check
from .hints import Hints


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


def _distribution(rng: random.Random, V: int) -> list[float]:
    """Random probabilities with some exact zeros and no tiny values (so float32 and float64 arithmetic on
    them round alike)."""
    w = [rng.random() ** 3 if rng.random() < 0.8 else 0.0 for _ in range(V)]
    w = [x if x > 1e-3 else 0.0 for x in w]
    w[rng.randrange(V)] += 0.1
    s = sum(w)
    return [x / s for x in w]


def check_acceptance_rate(fn, cases: int = 300):
    """fn(p, q) -> the probability that a draft sampled from q is accepted against target p (lists)."""
    def case(rng):
        V = rng.randint(1, 8)
        p = _distribution(rng, V)
        return p, (_distribution(rng, V) if rng.random() < 0.8 else list(p))

    def reference(p, q):
        return float(acceptance_rate(torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)))

    return check("acceptance_rate", lambda *c: float(fn(*c)), reference, case, cases=cases,
                 equal=lambda got, want: abs(got - want) <= 1e-12)


def check_expected_tokens(fn, cases: int = 300):
    """fn(alpha, k) -> mean tokens a verify step with k i.i.d. drafts emits."""
    def case(rng):
        alpha = rng.choice([0.0, 1.0, rng.random(), 1 - rng.random() * 1e-3])
        return alpha, rng.randint(0, 12)

    return check("expected_tokens", lambda *c: float(fn(*c)), expected_tokens, case, cases=cases,
                 equal=lambda got, want: abs(got - want) <= 1e-9 * max(1.0, want))


def check_best_k(fn, cases: int = 300):
    """fn(alpha, c, k_max) -> the k in 0..k_max with the highest (1 - alpha^(k+1)) / ((1 - alpha)(1 + c k)),
    the smallest such k on a tie."""
    def case(rng):
        while True:  # no near-tie between the two best k: any correct arithmetic gives the same answer
            alpha, c, k_max = rng.choice([0.0, rng.random()]), rng.choice([0.0, rng.random() * 0.5]), rng.randint(1, 16)
            s = sorted((expected_speedup(alpha, k, c) for k in range(k_max + 1)), reverse=True)
            if s[0] - s[1] > 1e-9 * s[0]:
                return alpha, c, k_max

    return check("best_k", fn, lambda a, c, k_max: optimal_k(a, c, k_max), case, cases=cases)


def _verify_case(rng: random.Random, num_seqs: int):
    """A random verify step of num_seqs sampled sequences: the sampler's inputs and the draws it will make.
    Drawn again while a coin lands within float rounding of its threshold, so the accept test cannot
    depend on the order of the arithmetic."""
    while True:
        V = rng.randint(2, 6)
        num_draft = [rng.randint(0, 5) for _ in range(num_seqs)]
        p = [[_distribution(rng, V) for _ in range(k + 1)] for k in num_draft]
        q = [[_distribution(rng, V) if rng.random() < 0.8 else list(p[b][j]) for j in range(k)]
             for b, k in enumerate(num_draft)]
        drafts = [rng.choices(range(V), weights=q[b][j])[0] for b, k in enumerate(num_draft) for j in range(k)]
        seeds, num_output = [rng.randrange(2**62) for _ in num_draft], [rng.randrange(1000) for _ in num_draft]
        meta = spec_metadata([SamplingParams(temperature=1.0)] * num_seqs, seeds, num_output, num_draft, V, "cpu")
        logits = torch.log(torch.tensor([row for rows in p for row in rows]))  # [R, V]
        probs = filtered_probs(logits, meta)  # [R, V] the p the sampler verifies against
        q_t = torch.tensor([row for rows in q for row in rows], dtype=torch.float32).reshape(len(drafts), V)  # [D, V]
        rows = torch.tensor(draft_rows_of(num_draft), dtype=torch.long)  # [D]
        coins = uniforms(meta.seeds[rows] ^ ACCEPT_STREAM, meta.steps[rows], 1)[:, 0]  # [D]
        d = torch.tensor(drafts, dtype=torch.long)
        p_d, q_d = probs[rows, d], q_t[torch.arange(len(drafts)), d]  # [D]
        if bool(((coins * q_d - p_d).abs() > 1e-5 * p_d.clamp_min(1e-30)).all()):
            return logits, probs, q_t, drafts, num_draft, coins, meta


def _sampler(logits, q_t, drafts, num_draft, meta) -> list[list[int]]:
    return RejectionSampler()(logits, num_draft, drafts, q_t, meta)


def check_speculative_accept(fn, cases: int = 300):
    """fn(p [k+1][V], q [k][V], drafts [k], coins [k], pick) -> the tokens one sequence emits; pick(j, weights)
    draws the token emitted at position j from unnormalized weights. The check runs minillm's
    RejectionSampler on the same sequence and hands fn the sampler's own coins and draws."""
    def case(rng):
        return _verify_case(rng, 1)

    def reference(logits, probs, q_t, drafts, num_draft, coins, meta):
        return _sampler(logits, q_t, drafts, num_draft, meta)[0]

    def student(logits, probs, q_t, drafts, num_draft, coins, meta):
        def pick(j, weights):  # the sampler's exponential race at row j, on the same uniforms
            w = torch.tensor([list(weights)], dtype=torch.float32)  # [1, V]
            return int(race(w, meta.seeds[j:j + 1], meta.steps[j:j + 1])[0])
        k = num_draft[0]
        return list(fn(probs.tolist(), q_t.tolist(), list(drafts), coins.tolist()[:k], pick))

    return check("speculative_accept", student, reference, case, cases=cases)


def check_batched_accept(fn, cases: int = 200):
    """fn(p [R, V], q [D, V], draft_token_ids [D], num_draft [B], coins [D], race_uniforms [R, V]) -> per
    sequence the tokens it emits, with the random rule for every draft of the flattened batch at once
    (tensors; p and q float32). Against minillm's RejectionSampler on the same batch and the same draws."""
    def case(rng):
        return _verify_case(rng, rng.randint(1, 6))

    def reference(logits, probs, q_t, drafts, num_draft, coins, meta):
        return _sampler(logits, q_t, drafts, num_draft, meta)

    def student(logits, probs, q_t, drafts, num_draft, coins, meta):
        u = uniforms(meta.seeds, meta.steps, probs.shape[1])  # [R, V] the race's uniforms
        out = fn(probs.clone(), q_t.clone(), torch.tensor(drafts, dtype=torch.long), list(num_draft), coins.clone(), u)
        return [list(map(int, x)) for x in out]

    return check("batched_accept", student, reference, case, cases=cases)


hint = Hints("09", {
    "ngram_propose": (
        "Work with n from max_n down to min_n, and for each n compare the last n tokens with every earlier "
        "window of length n, from the left.",
        "A window starting at i matches when tokens[i:i+n] == tokens[L-n:]. Only windows that end before the "
        "last token count (i < L - n), so the match is followed by at least one token; never try n > L - 1.",
        "for n in range(min(max_n, L - 1), min_n - 1, -1):\n    for i in range(L - n):\n"
        "        if tokens[i:i+n] == tokens[L-n:]: return tokens[i+n : i+n+k]\nreturn []",
    ),
    "verify_greedy": (
        "Walk the drafts and the target's argmaxes side by side; the answer always has between 1 and k + 1 tokens.",
        "At the first j with draft[j] != target_argmax[j] the target's token replaces the draft and the step "
        "ends. If no mismatch, target_argmax[k] is a free extra token.",
        "for d, t in zip(drafts, target):\n    if d != t: return out + [t]\n    out.append(d)\n"
        "return out + [target[len(drafts)]]",
    ),
    "acceptance_rate": (
        "A draft x is drawn with probability q(x) and then kept with probability min(1, p(x)/q(x)).",
        "q(x) * min(1, p(x)/q(x)) = min(q(x), p(x)); sum it over x.",
        "return sum(min(a, b) for a, b in zip(p, q))",
    ),
    "expected_tokens": (
        "Draft j is kept only if drafts 1..j all were: probability alpha^j. Every step emits one token more.",
        "E = 1 + alpha + ... + alpha^k, a geometric sum; careful at alpha = 1, where the closed form divides by 0.",
        "return k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)",
    ),
    "best_k": (
        "Compute the expected speedup for every k from 0 to k_max and take the best.",
        "speedup(k) = expected_tokens(alpha, k) / (1 + c * k). Keep the first k that reaches the maximum "
        "(a strict > while scanning upwards).",
        "best = 0\nfor k in range(1, k_max + 1):\n    if speedup(k) > speedup(best): best = k\nreturn best",
    ),
    "speculative_accept": (
        "It is verify_greedy with two changes: whether draft j survives is a coin flip, and the token that "
        "replaces a rejected draft (or the bonus) comes from pick.",
        "Accept d = drafts[j] when coins[j] * q[j][d] <= p[j][d] (this is u < p/q without dividing by 0). On "
        "the first rejection, emit pick(j, residual) with residual = max(p_j - q_j, 0) elementwise (p_j itself if "
        "that is all zeros) and stop. All accepted: pick(k, p[k]).",
        "for j, d in enumerate(drafts):\n    if coins[j] * q[j][d] <= p[j][d]: out.append(d); continue\n"
        "    r = [max(a - b, 0.0) for a, b in zip(p[j], q[j])]\n    return out + [pick(j, r if sum(r) > 0 else p[j])]\n"
        "return out + [pick(len(drafts), p[len(drafts)])]",
    ),
    "batched_accept": (
        "Sequence b owns rows start_b .. start_b + k_b of p (start_b = sum of (k + 1) before it) and drafts "
        "d_b .. d_b + k_b - 1. First build, for every draft, the index of its row of p.",
        "Three tensor steps for all drafts at once: accepted = coins * q[i, d_i] <= p[row_i, d_i]; weights = p "
        "with the draft rows replaced by (p[rows] - q).clamp_min(0) (p[rows] where that sums to 0); tokens = "
        "argmax(weights / -log(race_uniforms)) per row. Then walk each sequence: drafts while accepted, then "
        "tokens[row] of the first rejection, or tokens[start_b + k_b] after all of them.",
        "rows = torch.tensor([s + j for s, k in zip(starts, num_draft) for j in range(k)])\n"
        "acc = coins * q.gather(1, d[:, None])[:, 0] <= p[rows, d]\n"
        "res = (p[rows] - q).clamp_min(0); w = p.clone()\n"
        "w[rows] = torch.where(res.sum(-1, keepdim=True) <= 0, p[rows], res)\n"
        "tok = (w / -torch.log(race_uniforms)).argmax(-1)",
    ),
})
