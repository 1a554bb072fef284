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
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


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
    rows = logits if indices is None else logits[indices]  # [b, V]
    if rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"{bitmask.shape[0]} bitmask rows for {rows.shape[0]} logits rows")
    V = min(rows.shape[1], bitmask.shape[1] * 32)
    allowed = unpack_bitmask(bitmask.to(logits.device), V)  # [b, V]
    masked = rows[:, :V].masked_fill(~allowed, float("-inf"))
    if indices is None:
        logits[:, :V] = masked
    else:
        idx = torch.as_tensor(indices, device=logits.device)
        logits[idx, :V] = masked
    return logits
