"""Tensor-parallel state: which rank this process is, how many share each layer, how they combine.

Chapter 11 splits every linear layer across GPUs: a column-parallel layer keeps a slice of the
output features on each rank, a row-parallel one a slice of the input features, and the ranks'
partial sums meet in an all-reduce. Until then there is one rank; the layers already ask these
functions, so the places where chapter 11 will shard and reduce are in the code today, and each
of them is the identity.
"""

from __future__ import annotations

import torch


def get_tensor_model_parallel_rank() -> int:
    return 0


def get_tensor_model_parallel_world_size() -> int:
    return 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks (row-parallel outputs, vocab-parallel embeddings). One rank: x itself."""
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' slices of x along dim (column-parallel outputs, logits). One rank: x."""
    return x


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, which must divide exactly (heads, features and vocab across ranks)."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
