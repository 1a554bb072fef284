"""All-reduce times on a real group of spawned ranks, for the alpha-beta fit (cost_model.py).

    m = measure_allreduce([8192, 65536, 524288])   # {"backend", "device", "sizes", "seconds", ...}

The backend follows the machine: NCCL with one GPU per rank where there are enough GPUs; gloo on CUDA
tensors where there is one GPU (both ranks on it: NCCL cannot host two ranks on one GPU, and gloo's
all-reduce goes through host memory, so it is far slower than NCCL); gloo on CPU tensors elsewhere.
`scripts/gpu/allreduce_sweep.py` is the torchrun version for a multi-GPU machine (CUDA graphs, JSON).
"""

from __future__ import annotations

import statistics

import torch

from ..hw import time_it
from .launch import run_ranks
from .parallel_state import get_tp_group


def backend_for(world_size: int) -> tuple[str, str]:
    """(backend, device type) this machine can run a group of world_size ranks on."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= world_size:
        return "nccl", "cuda"
    return ("gloo", "cuda") if gpus >= 1 else ("gloo", "cpu")


def allreduce_seconds(rank: int, world_size: int, sizes: list[int], device_type: str, iters: int, repeats: int,
                      dtype: torch.dtype = torch.float32) -> list[float]:
    """A spawned rank: check one all-reduce's sum on random integers, then time all-reduces of each size
    (bytes) -> seconds per all-reduce, the median of `repeats` loops of `iters` calls (fewer above 1 MB).
    Every rank makes the same calls in the same order (a collective waits for all of them)."""
    group = get_tp_group()
    device = torch.device("cuda", rank if group.backend == "nccl" else 0) if device_type == "cuda" else None
    device = device or torch.device("cpu")
    g = torch.Generator().manual_seed(11)
    parts = [torch.randint(-1000, 1000, (1000,), generator=g).float() for _ in range(world_size)]  # exact in fp32
    if not torch.equal(group.all_reduce(parts[rank].clone().to(device)).cpu(), sum(parts)):
        raise AssertionError(f"rank {rank}: the all-reduce did not sum the ranks' tensors")
    nccl = group.backend == "nccl"
    out = []
    for n in sizes:
        x = torch.zeros(n // dtype.itemsize, dtype=dtype, device=device)  # the values do not change the time

        def once(x=x):
            group.all_reduce(x)
            if device.type == "cuda" and not nccl:
                torch.cuda.synchronize(device)  # gloo's CUDA all-reduce: wait for the copies back to the GPU

        group.barrier()
        # the same number of calls on every rank, never calibrated per rank: `iters` up to 1 MB, fewer above
        inner = max(2, min(iters, iters * 2**20 // max(n, 1)))
        out.append(time_it(once, warmup=3, reps=repeats, inner=inner, device=device if nccl else None))
    return out


def measure_allreduce(sizes: list[int], world_size: int = 2, iters: int = 20, repeats: int = 5,
                      timeout: float = 300.0) -> dict:
    """Time all-reduces of each size (bytes) over world_size spawned ranks on this machine's backend.
    An all-reduce ends when its slowest rank ends: per size, the largest of the ranks' medians."""
    backend, device_type = backend_for(world_size)
    per_rank = run_ranks(allreduce_seconds, world_size, sizes, device_type, iters, repeats, backend=backend,
                         timeout=timeout)
    seconds = [max(r[i] for r in per_rank) for i in range(len(sizes))]
    spread = [max(r[i] for r in per_rank) / min(r[i] for r in per_rank) for i in range(len(sizes))]
    return {"backend": backend, "device": device_type, "world_size": world_size, "sizes": list(sizes),
            "seconds": seconds, "rank_spread": statistics.median(spread)}
