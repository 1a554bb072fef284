"""Chapter 09's sampling oracle: speculative sampling emits exactly the target's distribution.

Scripted target and draft distributions on a small vocabulary (the target's row j does not depend on
the tokens before it, so every emitted position j must follow p_j): draw tens of thousands of
sequences' drafts from q, verify them in one batched call, and hold each position's histogram to p_j
with a chi-square test. A one-line bug in the residual (resampling from p instead of max(p - q, 0))
fails the same test by a wide margin; so the test can fail. Greedy verification is a prefix match,
checked case by case; seeded rows give the same tokens alone and batched; k = 0 is the plain sampler.
"""

from __future__ import annotations

import math

import pytest
import torch

from minillm.sampling import Sampler, SamplingMetadata, SamplingParams, filtered_probs
from minillm.sampling import rejection_sampler as rs
from minillm.sampling.rejection_sampler import RejectionSampler, spec_metadata

V, K = 8, 3


def chi2_limit(dof: int, z: float = 5.0) -> float:
    """The chi-square value a true null exceeds with probability ~3e-7 (Wilson-Hilferty, z = 5)."""
    a = 2 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    n = counts.sum()
    expected = n * p
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def scripted(seed: int, num_seqs: int, params: SamplingParams, with_q: bool):
    """Per position j: target logits (shared by every sequence), the target's filtered p_j, the draft's
    filtered q_j, and every sequence's drafts drawn from q_j (or one fixed token per position: n-gram)."""
    g = torch.Generator().manual_seed(seed)

    def filtered(logits):
        rows = logits.shape[0]
        meta = SamplingMetadata.build([params] * rows, [[]] * rows, [[]] * rows, [0] * rows, [[]] * rows, V, "cpu")
        return filtered_probs(logits, meta)

    # a position whose filtered p keeps one token (top-p on a peaked row) has nothing to test: draw the
    # target again until every position keeps at least two (a seed-independent amount of evidence)
    for _ in range(1000):
        target_logits = torch.randn(K + 1, V, generator=g)  # [K+1, V]
        p = filtered(target_logits)
        if bool(((p > 0).sum(dim=-1) >= 2).all()):
            break
    draft_logits = torch.randn(K, V, generator=g)  # [K, V]
    q = filtered(draft_logits)
    if with_q:
        drafts = torch.stack([torch.multinomial(q[j], num_seqs, replacement=True, generator=g) for j in range(K)], 1)
    else:  # n-gram: a token without probabilities; pick the target's second most likely one
        fixed = p.argsort(dim=-1, descending=True)[:K, 1]
        drafts = fixed[None, :].expand(num_seqs, K)
    return target_logits, p, q, drafts  # drafts [num_seqs, K]


def run(target_logits, q, drafts, params, seeds, with_q: bool) -> list[list[int]]:
    B = drafts.shape[0]
    logits = target_logits.repeat(B, 1)  # [B * (K+1), V]
    meta = spec_metadata([params] * B, seeds, [0] * B, [K] * B, V, "cpu")
    draft_probs = q.repeat(B, 1) if with_q else None  # [B * K, V]
    return RejectionSampler()(logits, [K] * B, drafts.reshape(-1).tolist(), draft_probs, meta)


def position_stats(emitted: list[list[int]], p: torch.Tensor) -> list[float]:
    """chi-square of each position's emitted tokens against p_j (positions with enough samples)."""
    stats = []
    for j in range(K + 1):
        col = torch.tensor([e[j] for e in emitted if len(e) > j], dtype=torch.long)
        if len(col) < 2000 or (p[j] > 0).sum() < 2:  # too few samples, or nothing to test
            continue
        stats.append(chi2(torch.bincount(col, minlength=V).float(), p[j]) / chi2_limit(int((p[j] > 0).sum()) - 1))
    return stats


CASES = {
    "draft model": (SamplingParams(temperature=1.0), True),
    "draft model, T=0.8 top-k 5 top-p 0.95": (SamplingParams(temperature=0.8, top_k=5, top_p=0.95), True),
    "draft model, min-p 0.05": (SamplingParams(temperature=1.3, min_p=0.05), True),
    "n-gram (one-hot q)": (SamplingParams(temperature=1.0), False),
    "n-gram, top-k 4": (SamplingParams(temperature=0.8, top_k=4), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target_distribution(seed, case):
    params, with_q = CASES[case]
    target_logits, p, q, drafts = scripted(seed, 30000, params, with_q)
    seeds = [(seed * 7919 + i) % (1 << 62) for i in range(drafts.shape[0])]
    emitted = run(target_logits, q, drafts, params, seeds, with_q)
    assert all(1 <= len(e) <= K + 1 for e in emitted)
    stats = position_stats(emitted, p)
    assert stats, "no position had enough samples to test"
    assert max(stats) < 1.0, f"chi-square / limit per position: {stats}"


@pytest.mark.parametrize("case", ["draft model", "n-gram (one-hot q)"])
def test_a_one_line_residual_bug_fails_the_distribution_test(seed, case, monkeypatch):
    """Resampling from p after a rejection (instead of max(p - q, 0)) over-weights the drafts' tokens."""
    monkeypatch.setattr(rs, "residual_probs", lambda p, q: p)
    params, with_q = CASES[case]
    target_logits, p, q, drafts = scripted(seed, 30000, params, with_q)
    emitted = run(target_logits, q, drafts, params, list(range(drafts.shape[0])), with_q)
    assert max(position_stats(emitted, p)) > 1.0


def test_greedy_is_a_prefix_match_against_the_argmax():
    argmax = [[3, 1, 4, 1], [5, 9, 2, 6], [0, 7], [2]]  # per sequence, the target's argmax per row
    drafts = [[3, 1, 4], [5, 8, 2], [6], []]  # all accepted; second rejected; first rejected; k = 0
    logits = torch.full((sum(len(a) for a in argmax), V + 2), -5.0)
    for r, t in enumerate(t for a in argmax for t in a):
        logits[r, t] = 5.0
    params = SamplingParams(temperature=0)
    meta = spec_metadata([params] * 4, [1, 2, 3, 4], [0, 5, 0, 9], [3, 3, 1, 0], V + 2, "cpu")
    out = RejectionSampler()(logits, [3, 3, 1, 0], [t for d in drafts for t in d], None, meta)
    assert out == [[3, 1, 4, 1], [5, 9], [0], [2]]


def test_seeded_rows_give_the_same_tokens_alone_and_batched(seed):
    params = SamplingParams(temperature=1.0, top_p=0.95)
    target_logits, _, q, drafts = scripted(seed, 64, params, True)
    seeds = [seed + 31 * i for i in range(64)]
    batched = run(target_logits, q, drafts, params, seeds, True)
    for i in range(0, 64, 9):
        assert run(target_logits, q, drafts[i : i + 1], params, seeds[i : i + 1], True) == batched[i : i + 1]
    assert run(target_logits, q, drafts, params, [s + 1 for s in seeds], True) != batched  # seeds matter


def test_no_drafts_is_the_plain_sampler(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(16, V, generator=g)
    params = [SamplingParams(temperature=t, top_k=k) for t, k in zip([0.0, 0.7, 1.0, 1.3] * 4, [0, 3] * 8)]
    seeds, steps = list(range(100, 116)), [3 * i for i in range(16)]
    meta = spec_metadata(params, seeds, steps, [0] * 16, V, "cpu")
    got = RejectionSampler()(logits, [0] * 16, [], None, meta)
    plain = SamplingMetadata.build(params, [[]] * 16, [[0] * s for s in steps], seeds, [[]] * 16, V, "cpu")
    assert [g[0] for g in got] == Sampler()(logits, plain).token_ids.tolist()


def test_shapes_that_do_not_fit_are_refused():
    params = SamplingParams(temperature=1.0)
    meta = spec_metadata([params], [0], [0], [2], V, "cpu")
    with pytest.raises(ValueError, match="logits rows"):
        RejectionSampler()(torch.zeros(2, V), [2], [1, 2], None, meta)
    with pytest.raises(ValueError, match="draft_probs"):
        RejectionSampler()(torch.zeros(3, V), [2], [1, 2], torch.zeros(2, V + 1), meta)
    with pytest.raises(ValueError, match="penalties"):
        spec_metadata([SamplingParams(presence_penalty=0.5)], [0], [0], [1], V, "cpu")
