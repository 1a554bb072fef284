"""Lab 10's new checks (route_v3, moe_align) pass the lab's solutions and catch the slips a student makes."""

from __future__ import annotations

from pathlib import Path

import jupytext
import pytest
import torch

from minillm.labs import CheckFailed, ch10

LAB = Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "10_mla_moe.py"


@pytest.fixture(scope="module")
def ns() -> dict:
    out: dict = {}
    for cell in jupytext.read(LAB).cells:
        if cell.cell_type == "code" and "check" not in cell.metadata.get("tags", []):
            exec(compile(cell.source, LAB.name, "exec"), out)
    return out


def test_solutions_pass(ns):
    assert ch10.check_route_v3(ns["route_v3"]).passed
    assert ch10.check_moe_align(ns["moe_align"]).passed


def _v3(ns, softmax=False, biased_weights=False, no_groups=False, best_one=False):
    def route(logits, bias, top_k, n_group, topk_group, scaling):
        T, E = logits.shape
        scores = logits.softmax(-1) if softmax else logits.sigmoid()
        choice = scores + bias
        g = choice.view(T, n_group, E // n_group)
        gs = g.max(-1).values if best_one else g.topk(min(2, E // n_group), -1).values.sum(-1)
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(topk_group, -1).indices, True)
        if not no_groups:
            choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, 1), float("-inf"))
        ids = choice.topk(top_k, -1).indices
        w = (scores + bias if biased_weights else scores).gather(1, ids)
        return w / w.sum(-1, keepdim=True) * scaling, ids
    return route


@pytest.mark.parametrize("slip", ["softmax", "biased_weights", "no_groups", "best_one"])
def test_route_v3_slips_are_caught(ns, slip):
    with pytest.raises(CheckFailed):
        ch10.check_route_v3(_v3(ns, **{slip: True}))


def test_route_v3_reference_slip_free_version_passes(ns):
    assert ch10.check_route_v3(_v3(ns)).passed  # the slip-free variant of the slips above is right


def test_moe_align_slips_are_caught(ns):
    def no_padding(topk_ids, block_m, E):
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        return order, flat[order][::block_m]

    def unstable(topk_ids, block_m, E):  # pairs inside an expert in reverse order
        s, e = ns["moe_align"](topk_ids, block_m, E)
        n = topk_ids.numel()
        out = s.clone()
        runs = {}
        for i, v in enumerate(s.tolist()):
            if v != n:
                runs.setdefault(int(topk_ids.reshape(-1)[v]), []).append(i)
        for rows in runs.values():
            out[rows] = s[rows].flip(0)
        return out, e

    def pad_id_zero(topk_ids, block_m, E):
        s, e = ns["moe_align"](topk_ids, block_m, E)
        return torch.where(s == topk_ids.numel(), torch.zeros_like(s), s), e

    for slip in (no_padding, unstable, pad_id_zero):
        with pytest.raises(CheckFailed):
            ch10.check_moe_align(slip)


def test_every_exercise_has_three_hints(capsys):
    for name in ("route", "route_v3", "moe_align", "absorbed_attention"):
        ch10.hint(name, 3)
        assert name in capsys.readouterr().out
