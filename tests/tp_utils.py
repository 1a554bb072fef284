"""Run a function as every rank of a real process group: spawned processes, a free port, a time limit
(a rank that hangs in a collective fails the test instead of CI). gloo on CPU tensors by default (CI);
MINILLM_TP_BACKEND=nccl runs the same tests on one GPU per rank (scripts/gpu/tp2.sh)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from minillm.distributed import (
    destroy_distributed_environment,
    get_distributed_init_method,
    get_open_port,
    init_distributed_environment,
)

BACKEND = os.environ.get("MINILLM_TP_BACKEND", "gloo")


def rank_device(rank: int = 0) -> torch.device:
    """Where rank `rank`'s tensors live: its own GPU under NCCL, the CPU under gloo."""
    return torch.device("cuda", rank) if BACKEND == "nccl" else torch.device("cpu")


def _rank_main(rank: int, world_size: int, init_method: str, fn, args) -> None:
    torch.set_num_threads(1)  # CI has 2 cores for all ranks
    init_distributed_environment(world_size, rank, init_method, backend=BACKEND, timeout_s=60)
    try:
        fn(rank, world_size, *args)
    finally:
        destroy_distributed_environment()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> None:
    """fn(rank, world_size, *args) in world_size spawned processes joined in one gloo group. An
    exception in any rank re-raises here; past `timeout` seconds every rank is killed and this fails."""
    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    ctx = mp.start_processes(_rank_main, args=(world_size, init_method, fn, args), nprocs=world_size, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, 9)
                p.join()


def skip_without_devices(world_size: int) -> None:
    """Under NCCL each rank needs its own GPU: a size the machine cannot host is skipped, and says why."""
    if BACKEND == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"NCCL with {world_size} ranks needs {world_size} GPUs; {torch.cuda.device_count()} visible")
