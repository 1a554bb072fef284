"""Lab 09's checks pass minillm's solution and catch the slips a student makes."""

from __future__ import annotations

from pathlib import Path

import jupytext
import pytest
import torch

from minillm.labs import CheckFailed, ch09

LAB = Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "09_speculative_decoding.py"


def solution() -> dict:
    ns: dict = {}
    for cell in jupytext.read(LAB).cells:
        if cell.cell_type == "code" and "check" not in cell.metadata.get("tags", []):
            exec(compile(cell.source, LAB.name, "exec"), ns)
    return ns


def test_the_solution_passes():
    ns = solution()
    assert ch09.check_ngram_propose(ns["ngram_propose"]).passed
    assert ch09.check_verify_greedy(ns["verify_greedy"]).passed
    assert ch09.check_speculative_accept(ns["speculative_accept"]).passed
    assert ch09.check_acceptance_rate(ns["acceptance_rate"]).passed
    assert ch09.check_expected_tokens(ns["expected_tokens"]).passed
    assert ch09.check_best_k(ns["best_k"]).passed
    assert ch09.check_batched_accept(ns["batched_accept"]).passed


def test_ngram_slips_are_caught():
    ns = solution()

    def latest(tokens, min_n, max_n, k):  # the most recent occurrence instead of the earliest
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i : i + n] == tokens[len(tokens) - n :]:
                    return tokens[i + n : i + n + k]
        return []

    def shortest_first(tokens, min_n, max_n, k):
        return ns["ngram_propose"](tokens, min_n, min_n, k) or ns["ngram_propose"](tokens, min_n, max_n, k)

    for slip in (latest, shortest_first):
        with pytest.raises(CheckFailed):
            ch09.check_ngram_propose(slip)


def test_verify_slips_are_caught():
    def no_bonus(drafts, target):
        out = []
        for d, t in zip(drafts, target):
            if d != t:
                return out + [t]
            out.append(d)
        return out

    def keeps_the_draft(drafts, target):  # emits the rejected draft instead of the target's token
        out = []
        for d, t in zip(drafts, target):
            out.append(d)
            if d != t:
                return out
        return out + [target[len(drafts)]]

    for slip in (no_bonus, keeps_the_draft):
        with pytest.raises(CheckFailed):
            ch09.check_verify_greedy(slip)


@pytest.mark.parametrize("slip", ["resample_p", "ratio_flipped", "no_bonus"])
def test_accept_slips_are_caught(slip):
    def accept(p, q, drafts, coins, pick):
        out = []
        for j, d in enumerate(drafts):
            ratio = q[j][d] / p[j][d] if slip == "ratio_flipped" and p[j][d] else p[j][d] / max(q[j][d], 1e-30)
            if coins[j] <= ratio:
                out.append(d)
                continue
            residual = [max(a - b, 0.0) for a, b in zip(p[j], q[j])]
            weights = list(p[j]) if slip == "resample_p" or sum(residual) == 0 else residual
            return out + [pick(j, weights)]
        return out if slip == "no_bonus" else out + [pick(len(drafts), list(p[len(drafts)]))]

    with pytest.raises(CheckFailed):
        ch09.check_speculative_accept(accept)


def test_accept_with_the_wrong_row_is_caught():
    """The draw for a rejected draft must be the sampler's draw at that row, not the next one."""
    ns = solution()

    def accept(p, q, drafts, coins, pick):
        k = len(drafts)
        return ns["speculative_accept"](p, q, drafts, coins, lambda j, w: pick(j + 1 if j < k else j, w))

    with pytest.raises(CheckFailed):
        ch09.check_speculative_accept(accept)


def test_acceptance_model_slips_are_caught():
    with pytest.raises(CheckFailed):  # the overlap of the supports instead of the probability mass
        ch09.check_acceptance_rate(lambda p, q: sum(min(a, b) > 0 for a, b in zip(p, q)) / len(p))
    with pytest.raises(CheckFailed):  # forgets the token every step emits
        ch09.check_expected_tokens(lambda a, k: sum(a**j for j in range(1, k + 1)))
    with pytest.raises((CheckFailed, ZeroDivisionError)):  # the closed form at alpha = 1
        ch09.check_expected_tokens(lambda a, k: (1 - a ** (k + 1)) / (1 - a))
    ns = solution()
    with pytest.raises(CheckFailed):  # ignores the draft cost
        ch09.check_best_k(lambda a, c, k_max: ns["best_k"](a, 0.0, k_max))
    with pytest.raises(CheckFailed):  # never considers k = 0
        ch09.check_best_k(lambda a, c, k_max: max(range(1, k_max + 1), key=lambda k: ns["expected_tokens"](a, k) / (1 + c * k)))


@pytest.mark.parametrize("slip", ["resample_p", "no_bonus_row", "loop_rows_off_by_one"])
def test_batched_slips_are_caught(slip):
    ns = solution()

    def batched(p, q, d, num_draft, coins, u):
        if slip == "resample_p":  # the residual forgotten: every row draws from p
            q = torch.zeros_like(q)
        out = ns["batched_accept"](p, q, d, num_draft, coins, u)
        if slip == "no_bonus_row":
            out = [o[:-1] if len(o) == k + 1 and k else o for o, k in zip(out, num_draft)]
        if slip == "loop_rows_off_by_one":  # rows counted without each sequence's extra row
            starts = [sum(num_draft[:b]) for b in range(len(num_draft))]
            out = [o if len(num_draft) == 1 else o[:-1] + [int(u[starts[b]].argmin())] for b, o in enumerate(out)]
        return out

    with pytest.raises(CheckFailed):
        ch09.check_batched_accept(batched)


def test_every_exercise_has_three_hints(capsys):
    for name in ("ngram_propose", "verify_greedy", "acceptance_rate", "expected_tokens", "best_k",
                 "speculative_accept", "batched_accept"):
        for level in (1, 2, 3):
            ch09.hint(name, level)
            assert name in capsys.readouterr().out
    with pytest.raises(ValueError, match="level"):
        ch09.hint("best_k", 4)
