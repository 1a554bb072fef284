"""Chapter 11's collectives on a real group: 2 (and 3) CPU processes with gloo. Each rank checks
closed-form results (every rank's input is a function of its rank, drawn from a seed all ranks share),
and the group's functions are the ones the layers call (minillm.distributed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tp_utils import BACKEND, rank_device, run_ranks, skip_without_devices

import minillm.distributed as tp

ROOT = Path(__file__).resolve().parent.parent


def _inputs(seed: int, world_size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 5, generator=g) for _ in range(world_size)]  # rank r's tensor: the r-th draw


def _collectives(rank: int, world_size: int, seed: int) -> None:
    tp.get_tp_group().warm_up()  # what a worker runs before capturing CUDA graphs
    xs = [x.to(rank_device(rank)) for x in _inputs(seed, world_size)]
    assert (tp.get_tensor_model_parallel_rank(), tp.get_tensor_model_parallel_world_size()) == (rank, world_size)
    assert tp.get_tp_group().backend == BACKEND and tp.model_parallel_is_initialized()

    total = sum(xs[1:], xs[0].clone())
    y = tp.tensor_model_parallel_all_reduce(xs[rank].clone())
    # gloo sums in some order of its own: a sum of world_size fp32 terms moves by (n - 1) eps |terms|
    tol = (world_size - 1) * torch.finfo(torch.float32).eps * sum(x.abs() for x in xs)
    assert ((y - total).abs() <= tol).all()

    for dim in (0, -1):
        assert torch.equal(tp.tensor_model_parallel_all_gather(xs[rank], dim), torch.cat(xs, dim))

    got = tp.tensor_model_parallel_gather(xs[rank], dst=0)
    if rank == 0:
        assert torch.equal(got, torch.cat(xs, -1))
    else:
        assert got is None  # only the sampling rank receives the logits

    z = xs[rank].clone()
    assert torch.equal(tp.broadcast(z, src=world_size - 1), xs[-1])
    assert tp.get_tp_group().broadcast_object({"step": rank}, src=0) == {"step": 0}
    ints = torch.arange(4, device=z.device) + rank  # integer tensors (token ids) sum exactly
    want = world_size * torch.arange(4, device=z.device) + sum(range(world_size))
    assert torch.equal(tp.tensor_model_parallel_all_reduce(ints), want)


def _emulated_all_gather(rank: int, world_size: int, xs: list[torch.Tensor]) -> None:
    """gloo's path for CUDA tensors (no all-gather there): the zero-filled all-reduce, run on CPU."""
    group = tp.get_tp_group()
    group._emulated = lambda x: True  # take the emulation for these CPU tensors
    assert torch.equal(group.all_gather(xs[rank], dim=0), torch.cat(xs, 0))  # x + 0 + 0 is exact
    got = group.gather(xs[rank], dst=1)
    assert torch.equal(got, torch.cat(xs, -1)) if rank == 1 else got is None


def _all(rank: int, world_size: int, seed: int) -> None:
    _collectives(rank, world_size, seed)
    _emulated_all_gather(rank, world_size, [x.to(rank_device(rank)) for x in _inputs(seed, world_size)])


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_on_a_gloo_group(world_size, seed):
    """Each process: all-reduce, all-gather (both dims), gather to rank 0, tp.broadcast (tensor and
    object), then all-gather and gather again through the emulation gloo needs for CUDA tensors."""
    skip_without_devices(world_size)
    run_ranks(_all, world_size, seed, timeout=180)


def test_one_rank_before_init_is_the_identity():
    assert not tp.model_parallel_is_initialized()
    x = torch.randn(4, 3)
    assert tp.tensor_model_parallel_all_reduce(x) is x and tp.tensor_model_parallel_all_gather(x) is x
    assert tp.tensor_model_parallel_gather(x) is x and tp.broadcast(x) is x
    assert (tp.get_tensor_model_parallel_rank(), tp.get_tensor_model_parallel_world_size()) == (0, 1)
    assert isinstance(tp.get_tp_group(), tp.GroupCoordinator)


def test_init_rejects_bad_arguments(monkeypatch):
    with pytest.raises(ValueError, match="rank must be in"):
        tp.init_distributed_environment(2, 2, "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="backend must be one of"):
        tp.init_distributed_environment(1, 0, "tcp://127.0.0.1:1", backend="mpi")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        tp.init_distributed_environment()  # torchrun's variables are missing
    assert not tp.model_parallel_is_initialized()


def test_one_rank_group_from_torchrun_variables(monkeypatch):
    """What `torchrun --nproc-per-node 1` sets: the same code path as N ranks."""
    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(tp.get_open_port())}.items():
        monkeypatch.setenv(k, v)
    group = tp.init_distributed_environment(backend="gloo", timeout_s=30)
    try:
        assert (group.rank, group.world_size, group.backend) == (0, 1, "gloo")
        with pytest.raises(RuntimeError, match="already initialized"):
            tp.init_distributed_environment(backend="gloo")
    finally:
        tp.destroy_distributed_environment()
    assert not tp.model_parallel_is_initialized()


@pytest.mark.slow
def test_torchrun_starts_a_group_from_its_environment(tmp_path):
    """`torchrun --nproc-per-node 2` (torch.distributed.run) on the all-reduce sweep's dry run: each
    rank joins through RANK/WORLD_SIZE/MASTER_* alone, checks one all-reduce against its known sum,
    and rank 0 writes the timings."""
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "scripts" / "gpu" / "allreduce_sweep.py"), "--backend", "gloo", "--device", "cpu",
           "--max-sizes", "3", "--iters", "5", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["world_size"] == 2 and result["meta"]["backend"] == "gloo"
    assert [r["bytes"] for r in result["rows"]] == [8192, 16384, 32768]
    assert all(r["eager_s"] > 0 and "graph_s" not in r for r in result["rows"])  # no graphs on a CPU
