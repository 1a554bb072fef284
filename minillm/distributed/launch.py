"""Start a tensor-parallel group from one Python process: spawn one process per rank, join them in a
group, run a function on every rank, and bring each rank's result back.

    results = run_ranks(fn, 2, *args)      # fn(rank, world_size, *args) on ranks 0 and 1: [result0, result1]

This is the way a notebook or a test starts a group (the engine's multi-process executor keeps its
workers alive instead, and `torchrun` starts the processes from the shell). `fn` must be importable
by name (a module-level function of a module, not one defined in a notebook): a spawned process
starts a fresh interpreter and finds `fn` by its module and name. A rank that hangs in a collective
ends in a TimeoutError here after `timeout` seconds, never in a hung caller.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from .parallel_state import destroy_distributed_environment, init_distributed_environment
from .utils import get_distributed_init_method, get_open_port


def _rank_main(rank: int, world_size: int, init_method: str, backend: str, threads: int, out: str, fn, args):
    torch.set_num_threads(threads)  # ranks share the host's cores: one thread each unless told otherwise
    init_distributed_environment(world_size, rank, init_method, backend=backend, timeout_s=60)
    try:
        result = fn(rank, world_size, *args)
    finally:
        destroy_distributed_environment()
    torch.save(result, Path(out) / f"rank{rank}.pt")


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0, threads: int = 1) -> list:
    """fn(rank, world_size, *args) on `world_size` spawned ranks of one group (gloo: CPU tensors, or
    CUDA tensors on one GPU; nccl: one GPU per rank) -> every rank's return value, in rank order.
    An exception in any rank re-raises here (ProcessRaisedException, with the rank's traceback)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, not {world_size!r}")
    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    with tempfile.TemporaryDirectory(prefix="minillm-ranks-") as out:
        ctx = mp.start_processes(_rank_main, args=(world_size, init_method, backend, threads, out, fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
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
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
