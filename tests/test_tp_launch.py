"""minillm.distributed.run_ranks: every rank's result comes back in rank order, a rank's exception
re-raises in the caller, and a rank that never finishes ends in a TimeoutError instead of a hang.
The rank functions live at module level: a spawned process imports them by name."""

from __future__ import annotations

import time

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from minillm.distributed import get_tp_group, run_ranks
from minillm.distributed.measure import _check_sum, allreduce_seconds, backend_for, measure_allreduce


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


def _check_counts_a_missing_rank(rank: int, world_size: int) -> None:
    """The sum check on a group of world_size, told to expect one rank more: its oracle must object."""
    _check_sum(get_tp_group(), rank, world_size + 1, torch.device("cpu"), cuda_graph=False)


def _graphed_on_gloo(rank: int, world_size: int) -> None:
    allreduce_seconds(rank, world_size, [4096], "cpu", 2, 1, cuda_graph=True)


@pytest.mark.slow
@pytest.mark.skipif(backend_for(2)[0] == "nccl", reason="a gloo group: this machine would run NCCL")
def test_measure_allreduce_on_gloo_is_eager_only():
    """On gloo (CPU) only eager times exist; the sum check that guards every measurement bites."""
    sizes = [4096, 65536]
    m = measure_allreduce(sizes, world_size=2, iters=3, repeats=2)  # each rank checks a random integer sum first
    assert (m["backend"], m["sizes"], m["graph_seconds"], m["graph_rank_spread"]) == ("gloo", sizes, None, None)
    assert len(m["seconds"]) == len(sizes) and all(t > 0 for t in m["seconds"]) and m["rank_spread"] >= 1
    with pytest.raises(ProcessRaisedException, match="did not sum the ranks"):
        run_ranks(_check_counts_a_missing_rank, 2)
    with pytest.raises(ProcessRaisedException, match="needs the NCCL backend"):
        run_ranks(_graphed_on_gloo, 2)


@pytest.mark.skipif(backend_for(2)[0] == "nccl", reason="this machine runs two ranks on NCCL, where graphs work")
def test_cuda_graph_refused_without_nccl():
    with pytest.raises(ValueError, match="cuda_graph=True needs NCCL"):
        measure_allreduce([4096], cuda_graph=True)


@pytest.mark.skipif(backend_for(2)[0] != "nccl", reason="needs two GPUs (NCCL, one GPU per rank)")
def test_allreduce_in_a_cuda_graph_on_two_gpus():
    """NCCL: both times, each after a sum check (the graphed one replays a captured all-reduce); the small
    all-reduce the engine's decode step makes costs less replayed from a graph than launched eagerly."""
    sizes = [8192, 1 << 20]
    m = measure_allreduce(sizes, world_size=2, iters=50, repeats=5)
    assert m["backend"] == "nccl" and len(m["graph_seconds"]) == len(sizes)
    assert all(t > 0 for t in m["seconds"] + m["graph_seconds"])
    assert m["graph_seconds"][0] < m["seconds"][0], (m["graph_seconds"], m["seconds"])


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_sum_of_ranks, 0, 1.0)
