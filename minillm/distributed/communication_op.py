"""The collectives the layers call, on the tensor-parallel group (vLLM's names). With one rank each
is the identity (parallel_state.py)."""

from __future__ import annotations

import torch

from .parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks (row-parallel outputs, vocab-parallel embeddings), in place."""
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' slices of x along dim, on every rank (column-parallel outputs)."""
    return get_tp_group().all_gather(x, dim)


def tensor_model_parallel_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    """Concatenate the ranks' slices of x along dim on rank dst; None on the others (the logits)."""
    return get_tp_group().gather(x, dst, dim)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank src's x into every rank's x, in place (step inputs, a sampled token)."""
    return get_tp_group().broadcast(x, src)
