"""Lab 09's checks pass minillm's solution and catch the slips a student makes."""

from __future__ import annotations

from pathlib import Path

import jupytext
import pytest

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
            return out + [pick(weights)]
        return out if slip == "no_bonus" else out + [pick(list(p[len(drafts)]))]

    with pytest.raises(CheckFailed):
        ch09.check_speculative_accept(accept)
