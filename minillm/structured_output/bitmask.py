"""The token bitmask and applying it to logits, in plain PyTorch.

Layout (xgrammar's, so either backend fills the same tensor): bitmask [B, ceil(V/32)] int32, bit i of
word w set = token 32*w + i allowed. 32x smaller than a bool mask, so uploading a batch's mask each
step costs little; the engine fills rows on the host while the GPU runs the step before, then applies
them at its one mask point just before sampling.
"""

from __future__ import annotations

import torch


def allocate_token_bitmask(batch_size: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """[B, ceil(V/32)] int32, all tokens allowed (-1 = every bit set): a free row needs no fill."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin_memory)


def fill_bitmasks(matchers, bitmask: torch.Tensor) -> None:
    """Row i <- matchers[i]'s mask; a None matcher (a free request in the batch) allows everything."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu":
        raise ValueError(f"bitmask must be a CPU int32 [B, W] tensor, got {bitmask.dtype} {tuple(bitmask.shape)} "
                         f"on {bitmask.device}")
    if len(matchers) > bitmask.shape[0]:
        raise ValueError(f"{len(matchers)} matchers for a bitmask of {bitmask.shape[0]} rows")
    rows = bitmask.numpy()
    for i, m in enumerate(matchers):
        if m is None:
            rows[i] = -1
        else:
            m.fill_bitmask(rows[i])


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 -> [B, V] bool (True = allowed)."""
    bits = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32, device=bitmask.device)  # [32]
    return (bitmask.unsqueeze(-1) & bits).ne(0).reshape(bitmask.shape[0], -1)[:, :vocab_size]  # [B, W, 32] -> [B, V]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices=None) -> torch.Tensor:
    """Set disallowed logits to -inf, in place; returns logits.

    logits: [B, V] float; bitmask: [B, ceil(V/32)] int32 on logits' device (or [len(indices), W] with
    indices: the logits rows the mask rows belong to, for a batch where only some rows are constrained).
    Columns past 32*W (a padded vocabulary wider than the mask) are left alone.
    """
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f"logits [B, V] and bitmask [B, W] expected, got {tuple(logits.shape)} and {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, not {bitmask.dtype}")
    n = logits.shape[0] if indices is None else len(indices)
    if n != bitmask.shape[0]:
        raise ValueError(f"{bitmask.shape[0]} bitmask rows for {n} logits rows")
    V = min(logits.shape[1], bitmask.shape[1] * 32)
    disallowed = ~unpack_bitmask(bitmask.to(logits.device), V)  # [b, V]
    if indices is None:
        logits[:, :V].masked_fill_(disallowed, float("-inf"))  # a view: in place
    else:
        idx = torch.as_tensor(indices, device=logits.device)
        logits[idx, :V] = logits[idx, :V].masked_fill(disallowed, float("-inf"))  # [b, V] gathered rows
    return logits
