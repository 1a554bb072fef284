"""All-reduce times on a real group of spawned ranks, for the alpha-beta fit (cost_model.py).

    m = measure_allreduce([8192, 65536, 524288])   # {"backend", "device", "sizes", "seconds", "graph_seconds", ...}

The backend follows the machine: NCCL with one GPU per rank where there are enough GPUs; gloo on CUDA
tensors where there is one GPU (both ranks on it: NCCL cannot host two ranks on one GPU, and gloo's
all-reduce goes through host memory, so it is far slower than NCCL); gloo on CPU tensors elsewhere.

Two times per size on NCCL: eager (each call launched from Python) and replayed from a CUDA graph.
The engine's decode step is a graph replay, all-reduces included (chapter 07), and a small NCCL
all-reduce costs far less there: the launch, a large part of its eager time, is gone. gloo runs on the
host and cannot be captured, so it has eager times only (`graph_seconds` is None).
`scripts/gpu/allreduce_sweep.py` is the torchrun version for a multi-GPU machine (8 KB ... 64 MB, JSON).
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


def _check_sum(group, rank: int, world_size: int, device: torch.device, cuda_graph: bool) -> None:
    """The times below are those of a correct all-reduce: random integers (exact in fp32), known sum;
    with cuda_graph, the all-reduce captured in a graph and replayed must sum too."""
    g = torch.Generator().manual_seed(11)
    parts = [torch.randint(-1000, 1000, (1000,), generator=g).float() for _ in range(world_size)]  # [1000] each
    x = parts[rank].clone().to(device)
    if cuda_graph:
        group.all_reduce(x.clone())  # NCCL builds its communicator at the first call: never inside a capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            group.all_reduce(x)  # recorded, not run: x still holds this rank's part
        x.copy_(parts[rank])
        graph.replay()
        torch.cuda.synchronize(device)
    else:
        group.all_reduce(x)
    if not torch.equal(x.cpu(), sum(parts)):
        where = "replayed from a CUDA graph " if cuda_graph else ""
        raise AssertionError(f"rank {rank}: the all-reduce {where}did not sum the ranks' tensors")


def allreduce_seconds(rank: int, world_size: int, sizes: list[int], device_type: str, iters: int, repeats: int,
                      dtype: torch.dtype = torch.float32, cuda_graph: bool = False) -> list[float]:
    """A spawned rank: check one all-reduce's sum on random integers, then time all-reduces of each size
    (bytes) -> seconds per all-reduce, the median of `repeats` loops of `iters` calls (fewer above 1 MB).
    cuda_graph=True (NCCL only) records each loop once into a CUDA graph and times its replays.
    Every rank makes the same calls in the same order (a collective waits for all of them)."""
    group = get_tp_group()
    nccl = group.backend == "nccl"
    if cuda_graph and not nccl:
        raise ValueError(f"cuda_graph=True needs the NCCL backend (a graph captures GPU work only; {group.backend} "
                         f"all-reduces on the host), not {group.backend!r}")
    device = torch.device("cuda", rank if nccl else 0) if device_type == "cuda" else None
    device = device or torch.device("cpu")
    _check_sum(group, rank, world_size, device, cuda_graph)
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
        out.append(time_it(once, warmup=3, reps=repeats, inner=inner, device=device if nccl else None,
                           cuda_graph=cuda_graph))  # warm-up runs eagerly, before any capture
    return out


def _eager_and_graphed(rank: int, world_size: int, sizes: list[int], device_type: str, iters: int, repeats: int,
                       cuda_graph: bool) -> dict:
    """A spawned rank: the eager times, then (if asked) the graphed ones, in one group (one start-up)."""
    eager = allreduce_seconds(rank, world_size, sizes, device_type, iters, repeats)
    graph = allreduce_seconds(rank, world_size, sizes, device_type, iters, repeats, cuda_graph=True) if cuda_graph \
        else None
    return {"eager": eager, "graph": graph}


def _slowest(per_rank: list[list[float]]) -> tuple[list[float], float]:
    """An all-reduce ends when its slowest rank ends: per size the largest of the ranks' medians, and
    the median over sizes of how far the ranks were apart (max / min)."""
    sizes = range(len(per_rank[0]))
    spread = [max(r[i] for r in per_rank) / min(r[i] for r in per_rank) for i in sizes]
    return [max(r[i] for r in per_rank) for i in sizes], statistics.median(spread)


def measure_allreduce(sizes: list[int], world_size: int = 2, iters: int = 20, repeats: int = 5,
                      timeout: float = 300.0, cuda_graph: bool | None = None) -> dict:
    """Time all-reduces of each size (bytes) over world_size spawned ranks on this machine's backend:
    "seconds" eager, "graph_seconds" replayed from a CUDA graph (None where not measured). cuda_graph:
    None = wherever the backend is NCCL; True on another backend is a ValueError."""
    backend, device_type = backend_for(world_size)
    if cuda_graph and backend != "nccl":
        raise ValueError(f"cuda_graph=True needs NCCL (one GPU per rank); this machine runs {world_size} ranks on "
                         f"{backend} with {device_type} tensors, which a CUDA graph cannot capture: use None or False")
    graphed = backend == "nccl" if cuda_graph is None else cuda_graph
    per_rank = run_ranks(_eager_and_graphed, world_size, sizes, device_type, iters, repeats, graphed,
                         backend=backend, timeout=timeout)
    seconds, spread = _slowest([r["eager"] for r in per_rank])
    graph_seconds, graph_spread = _slowest([r["graph"] for r in per_rank]) if graphed else (None, None)
    return {"backend": backend, "device": device_type, "world_size": world_size, "sizes": list(sizes),
            "seconds": seconds, "rank_spread": spread, "graph_seconds": graph_seconds, "graph_rank_spread": graph_spread}
