"""Run a function as every rank of a real process group: spawned processes, a free port, a time limit
(a rank that hangs in a collective fails the test instead of CI). gloo on CPU tensors by default (CI);
MINILLM_TP_BACKEND=nccl runs the same tests on one GPU per rank (scripts/gpu/tp2.sh)."""

from __future__ import annotations

import os

import pytest
import torch

from minillm.distributed import run_ranks as launch_ranks

BACKEND = os.environ.get("MINILLM_TP_BACKEND", "gloo")


def rank_device(rank: int = 0) -> torch.device:
    """Where rank `rank`'s tensors live: its own GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", rank) if BACKEND == "nccl" else torch.device("cpu")


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> None:
    """fn(rank, world_size, *args) in world_size spawned processes joined in one group on BACKEND
    (minillm.distributed.run_ranks). An exception in any rank re-raises here; past `timeout` seconds
    every rank is killed and this fails."""
    launch_ranks(fn, world_size, *args, backend=BACKEND, timeout=timeout)


def skip_without_devices(world_size: int) -> None:
    """Under NCCL each rank needs its own GPU: a size the machine cannot host is skipped, and says why."""
    if BACKEND == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"NCCL with {world_size} ranks needs {world_size} GPUs; {torch.cuda.device_count()} visible")
