"""Lab 11's checks pass the lab's solutions and catch the slips a student makes: rows for columns, the
wrong block of rows, an MLP that sums before the activation, an embedding that forgets the mask or
splits the vocabulary by floor(V / p), a fit with unweighted rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minillm.labs import CheckFailed, ch11
from minillm.labs.student import solution_namespace

LAB = Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "11_tensor_parallelism.py"


@pytest.fixture(scope="module")
def ns() -> dict:
    return solution_namespace(LAB)


def test_solutions_pass(ns):
    assert ch11.check_column_shard(ns["column_shard"], cases=10).passed
    assert ch11.check_row_shard(ns["row_shard"], cases=10).passed
    assert ch11.check_mlp_partial_sums(ns["mlp_partial_sums"], cases=8).passed
    assert ch11.check_embedding_shard(ns["embedding_shard"], cases=20).passed
    assert ch11.check_fit_alpha_beta(ns["fit_alpha_beta"], cases=10).passed


def test_shard_slips_are_caught(ns):
    with pytest.raises(CheckFailed):  # column-parallel keeps rows of W, not columns
        ch11.check_column_shard(ns["row_shard"], cases=20)
    with pytest.raises(CheckFailed):
        ch11.check_row_shard(ns["column_shard"], cases=20)
    with pytest.raises(CheckFailed):  # always rank 0's block
        ch11.check_column_shard(lambda w, r, p: ns["column_shard"](w, 0, p), cases=20)


def test_mlp_slip_is_caught():
    def summed_too_early(x, gate, up, down, p):  # the full activation on every rank, divided by p
        h = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
        return [h @ down.T / p for _ in range(p)]  # sums right, but no rank computes its own part

    with pytest.raises(CheckFailed):
        ch11.check_mlp_partial_sums(summed_too_early, cases=10)


def test_embedding_slips_are_caught():
    def no_mask(table, ids, rank, p):
        per = -(-table.shape[0] // p)
        return table[(ids - rank * per).clamp(0, per - 1) + rank * per]

    def floor_split(table, ids, rank, p):
        per = table.shape[0] // p
        start, end = rank * per, (rank + 1) * per if rank < p - 1 else table.shape[0]
        mine = (ids >= start) & (ids < end)
        return table[torch.where(mine, ids, 0)] * mine[:, None]

    for slip in (no_mask, floor_split):
        with pytest.raises(CheckFailed):
            ch11.check_embedding_shard(slip, cases=40)


def test_unweighted_fit_is_caught():
    def unweighted(sizes, times, p):
        A = torch.tensor([[2 * (p - 1), 2 * (p - 1) / p * n] for n in sizes], dtype=torch.float64)
        sol = torch.linalg.lstsq(A, torch.tensor(times, dtype=torch.float64)[:, None]).solution
        return sol[0, 0].item(), 1.0 / sol[1, 0].item()

    with pytest.raises(CheckFailed):
        ch11.check_fit_alpha_beta(unweighted, cases=30)
