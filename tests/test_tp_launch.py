"""minillm.distributed.run_ranks: every rank's result comes back in rank order, a rank's exception
re-raises in the caller, and a rank that never finishes ends in a TimeoutError instead of a hang.
The rank functions live at module level: a spawned process imports them by name."""

from __future__ import annotations

import time

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from minillm.distributed import get_tp_group, run_ranks
from minillm.distributed.measure import allreduce_seconds


def _sum_of_ranks(rank: int, world_size: int, scale: float) -> dict:
    x = torch.full((3,), scale * (rank + 1))
    return {"rank": get_tp_group().rank, "sum": get_tp_group().all_reduce(x).tolist()}


def _fails_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 says no")


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(60)


@pytest.mark.slow
def test_results_errors_and_time_limit():
    scale = float(torch.randint(1, 100, ()).item())
    got = run_ranks(_sum_of_ranks, 3, scale)
    assert [g["rank"] for g in got] == [0, 1, 2]
    assert all(g["sum"] == [6 * scale] * 3 for g in got)  # 1 + 2 + 3, on every rank
    with pytest.raises(ProcessRaisedException, match="rank 1 says no"):
        run_ranks(_fails_on_rank_1, 2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        run_ranks(_sleeps, 2, timeout=5)
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_allreduce_timing_on_a_gloo_group():
    sizes = [4096, 65536]
    per_rank = run_ranks(allreduce_seconds, 2, sizes, "cpu", 3, 2)
    assert all(len(r) == len(sizes) and all(t > 0 for t in r) for r in per_rank)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_sum_of_ranks, 0, 1.0)
