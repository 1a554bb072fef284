"""The acceptance model of speculative decoding (Leviathan et al. 2023, section 3), and offline acceptance.

With the rejection rule, a draft token sampled from q is accepted with probability

    alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q)

(TV the total-variation distance). If every draft position is accepted independently with the same
alpha, a verify step with k drafts emits the accepted prefix plus one token, on average

    E[tokens per step] = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)

and, with c the cost of one draft token and r_k the cost of a verify step with k drafts, both in units of
a plain decode step, the speedup is E / (r_k + c k). Leviathan et al. take r_k = 1; chapter 09 measures
r_k (a forward pass with k + 1 tokens a sequence). The best k balances the two: past it, the next draft
adds alpha^(k+1) tokens on average but costs c more.

`offline_tokens_per_step` measures acceptance without running a speculating engine: given a greedy
continuation produced by plain decoding, it replays what a deterministic proposer would have drafted at
each step and how many drafts greedy verification would have kept (greedy speculation emits exactly
the plain tokens, so the replay is exact).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[..., V] target p and draft q (each a distribution over the last dim) -> [...] the probability that
    a draft sampled from q is accepted: sum min(p, q) = 1 - TV(p, q)."""
    if p.shape != q.shape:
        raise ValueError(f"acceptance_rate: p is {tuple(p.shape)} and q is {tuple(q.shape)}; they must match")
    return torch.minimum(p, q).sum(dim=-1)


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens a verify step emits with k drafts, each accepted with probability alpha (i.i.d.):
    (1 - alpha^(k+1)) / (1 - alpha); k + 1 when alpha = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"expected_tokens: alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"expected_tokens: k must be >= 0, got {k}")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Tokens per unit of time against plain decoding: E[tokens] / (verify_cost + c k); c the cost of one
    draft token and verify_cost that of the verify step, both in plain decode steps."""
    if c < 0 or verify_cost <= 0:
        raise ValueError(f"expected_speedup: need c >= 0 and verify_cost > 0, got c={c}, verify_cost={verify_cost}")
    return expected_tokens(alpha, k) / (verify_cost + c * k)


def optimal_k(alpha: float, c: float, k_max: int = 16, verify_cost: Callable[[int], float] | None = None) -> int:
    """The k in 0..k_max with the highest expected speedup (the smallest on a tie); 0 when no draft pays.
    verify_cost(k) gives the verify step's cost with k drafts (default 1 for every k)."""
    cost = verify_cost or (lambda k: 1.0)
    speedups = [expected_speedup(alpha, k, c, cost(k) if k else 1.0) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (speedups[k], -k))


def offline_tokens_per_step(tokens: Sequence[int], prompt_len: int, propose: Callable[[list[int], int], list[int]],
                            k: int) -> tuple[float, list[int]]:
    """Replay greedy speculation over a known greedy sequence: at each step propose(tokens so far, k),
    keep the drafts while they equal the next tokens, then one token. -> (mean tokens per step, per draft
    position j the number of steps whose j-th draft was accepted)."""
    tokens = list(tokens)
    i, steps, accepted_at = prompt_len, 0, [0] * k
    while i < len(tokens):
        drafts = list(propose(tokens[:i], k))[:k]
        m = 0
        while m < len(drafts) and i + m < len(tokens) and drafts[m] == tokens[i + m]:
            accepted_at[m] += 1
            m += 1
        steps += 1
        i += m + 1  # the accepted drafts and the target's own token
    return (len(tokens) - prompt_len) / max(steps, 1), accepted_at
