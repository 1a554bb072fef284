"""Which rank this process is, how many ranks share each layer, and the group they talk through.

A tensor-parallel group is N processes, one per GPU (or per CPU process with gloo), that each hold
1/N of every large weight and meet in collectives: an all-reduce after each row-parallel layer, a
gather of the logits to rank 0. vLLM's names:

    init_distributed_environment(world_size, rank, init_method)   join the group (or from torchrun's env)
    get_tp_group()                                                the GroupCoordinator: rank, size, collectives
    get_tensor_model_parallel_rank() / _world_size()              what a layer asks when it is built
    destroy_distributed_environment()                             leave it

Backends: NCCL for CUDA tensors (one GPU per rank: one GPU cannot host two NCCL ranks), gloo for CPU
tensors, which is how CI proves the sharding without a GPU. gloo also takes CUDA tensors for
all-reduce and broadcast but not all-gather or gather; those are emulated with an all-reduce of a
zero-filled buffer in which each rank writes its own slice (the other ranks add zeros).

Before init (one process, the chapters before 11) the group is a single rank and every collective
is the identity, so the layers never ask whether tensor parallelism is on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")


class GroupCoordinator:
    """A group of ranks and its collectives (vLLM's name). `device_group` carries tensors on the
    group's device; `cpu_group` (gloo) carries Python objects, as a step's plain-data message."""

    def __init__(self, rank: int, world_size: int, backend: str | None = None, device: torch.device | None = None,
                 device_group=None, cpu_group=None):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = device or torch.device("cpu")
        self.device_group, self.cpu_group = device_group, cpu_group

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def _emulated(self, x: torch.Tensor) -> bool:
        """gloo has all-reduce and broadcast for CUDA tensors, but neither all-gather nor gather."""
        return self.backend == "gloo" and x.is_cuda

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x is a fresh partial sum in every caller), and return it."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum over the ranks, in place: a row-parallel layer's per-output-channel
        quantization scale is the largest |w| of the whole row, which no single rank holds."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.device_group)
        return x

    def _gather_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x, in rank order, on this rank."""
        x = x.contiguous()
        if self._emulated(x):
            buf = x.new_zeros((self.world_size, *x.shape))  # [world, *x.shape]: zeros but this rank's row
            buf[self.rank].copy_(x)
            dist.all_reduce(buf, group=self.device_group)
            return list(buf.unbind(0))
        if self.backend == "nccl":
            buf = x.new_empty((self.world_size, *x.shape))
            dist.all_gather_into_tensor(buf, x, group=self.device_group)
            return list(buf.unbind(0))
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.device_group)
        return parts

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate the ranks' x along dim, on every rank: [.., n, ..] -> [.., world * n, ..]."""
        if self.world_size == 1:
            return x
        return torch.cat(self._gather_parts(x), dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate the ranks' x along dim on rank dst only; the others get None (the logits: only
        the rank that samples needs them, and the others skip (world - 1) / world of the traffic)."""
        if self.world_size == 1:
            return x
        if self._emulated(x):
            parts = self._gather_parts(x)
        elif self.backend == "nccl":  # an all-gather, not NCCL's point-to-point gather: a collective
            parts = self._gather_parts(x)  # every CUDA graph capture takes (the decode step's logits)
        else:
            x = x.contiguous()
            parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == dst else None
            dist.gather(x, parts, dst=dst, group=self.device_group)
        return torch.cat(parts, dim=dim) if self.rank == dst else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's x into every rank's x, in place (the same shape and dtype on every rank)."""
        if self.world_size == 1:
            return x
        dist.broadcast(x, src=src, group=self.device_group)
        return x

    def broadcast_object(self, obj=None, src: int = 0):
        """Rank src's picklable obj, returned on every rank (through the CPU group: no device copy)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_group)
        return box[0]

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum of a few integers over the ranks, on every rank (through the CPU
        group): how many KV blocks fit is the smallest count any rank's memory holds."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)  # [n]
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return t.tolist()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def warm_up(self) -> None:
        """Run each collective the layers use once, on a small tensor, and check the sum. NCCL builds
        its communicators at the first collective, which must not be inside a CUDA graph capture:
        call this on every rank before capturing."""
        if self.world_size == 1:
            return
        x = torch.full((8,), float(self.rank + 1), device=self.device)
        total = self.world_size * (self.world_size + 1) / 2
        if not bool((self.all_reduce(x.clone()) == total).all()):
            raise RuntimeError(f"rank {self.rank}: the warm-up all-reduce did not sum the ranks")
        self.all_gather(x)
        self.gather(x)
        self.broadcast(x.clone())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class SimulatedGroup(GroupCoordinator):
    """One process playing rank `rank` of `world_size` (no communication): the layers build and load
    that rank's shard, and every collective returns this rank's own part, so the caller (a test, a
    lab) sums or concatenates the ranks' parts itself. Exact arithmetic for checking the sharding."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x

    def gather(self, x, dst=0, dim=-1):
        return x

    def broadcast(self, x, src=0):
        return x

    def broadcast_object(self, obj=None, src=0):
        return obj

    def all_reduce_min(self, values):
        return list(values)

    def all_reduce_max(self, x):
        return x

    def barrier(self):
        pass

    def warm_up(self):
        pass


_SINGLE = GroupCoordinator(rank=0, world_size=1)  # before init: one rank, every collective the identity
_TP: GroupCoordinator | None = None


def get_tp_group() -> GroupCoordinator:
    return _TP if _TP is not None else _SINGLE


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"init_distributed_environment() without world_size and rank reads {name} from the "
                         f"environment (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE); it is not set")
    return int(value)


def init_distributed_environment(world_size: int = -1, rank: int = -1, distributed_init_method: str = "env://",
                                 local_rank: int = -1, backend: str | None = None, timeout_s: float = 600.0
                                 ) -> GroupCoordinator:
    """Join the tensor-parallel group: every rank of the world holds a shard of every layer.

    world_size = rank = -1 reads torchrun's RANK, LOCAL_RANK and WORLD_SIZE (and MASTER_ADDR/PORT
    through init method "env://"); a spawned worker passes its rank, the world size and an init method
    such as "tcp://127.0.0.1:29501". backend None: NCCL when CUDA is available, else gloo. With NCCL
    each rank takes GPU `local_rank` (default: rank). A rank that does not hear from the others within
    timeout_s fails instead of hanging."""
    global _TP
    if _TP is not None:
        raise RuntimeError("the distributed environment is already initialized (destroy_distributed_environment() "
                           "first)")
    if world_size == -1:
        world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
        local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank == -1 else local_rank
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, got rank {rank} of {world_size}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    local_rank = rank if local_rank == -1 else local_rank
    device = torch.device("cpu")
    if backend == "nccl":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f"NCCL needs one GPU per rank: local rank {local_rank} but {count} GPU(s) visible "
                             f"(one GPU cannot host two NCCL ranks; use backend='gloo' to try TP on one device)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=distributed_init_method, world_size=world_size, rank=rank,
                                timeout=timeout)
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}, not {rank} of {world_size}")
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    _TP = GroupCoordinator(rank, world_size, backend, device, dist.group.WORLD, cpu_group)
    return _TP


def destroy_distributed_environment() -> None:
    """Leave the group and free the communicators (a clean exit; NCCL warns without it)."""
    global _TP
    _TP = None
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def simulate_tensor_parallel(rank: int, world_size: int) -> Iterator[GroupCoordinator]:
    """Build layers as rank `rank` of `world_size` inside one process (SimulatedGroup): for tests and
    labs that check a layer's shards add up to the unsharded layer."""
    global _TP
    if _TP is not None:
        raise RuntimeError("a tensor-parallel group is active; simulate only in a single process")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, got rank {rank} of {world_size}")
    _TP = SimulatedGroup(rank, world_size)
    try:
        yield _TP
    finally:
        _TP = None
