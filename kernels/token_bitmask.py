"""Applying a structured-output token bitmask to logits, as one Triton kernel (chapter 14).

    logits[b, v] = -inf  where bit (v % 32) of bitmask[b, v // 32] is 0

The plain-PyTorch reference (minillm.structured_output.bitmask.apply_token_bitmask) unpacks the
mask to a [B, V] bool tensor and runs masked_fill: three kernels and a [B, V] temporary. Here each
program takes one row and a BLOCK of the vocabulary, loads BLOCK/32 words of the mask, tests each
logit's bit in registers and writes -inf only where a token is disallowed: one launch, the logits
read and written once, the mask read once (32x smaller than the logits).

`indices` (optional, [b] int32/int64): the logits rows the mask rows belong to, so a batch that
mixes constrained and free requests masks only the constrained rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_tensor


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,  # [B, V], rows stride_l apart
    bitmask_ptr,  # [b, W] int32, rows stride_m apart
    indices_ptr,  # [b] logits row of each mask row (unused without HAS_INDICES)
    V,
    stride_l,
    stride_m,
    HAS_INDICES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    block = tl.program_id(1)
    out_row = tl.load(indices_ptr + row).to(tl.int64) if HAS_INDICES else row.to(tl.int64)
    cols = block * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] token ids
    inside = cols < V
    words = tl.load(bitmask_ptr + row.to(tl.int64) * stride_m + cols // 32, mask=inside, other=-1)  # [BLOCK]
    allowed = ((words >> (cols % 32)) & 1) != 0
    # Store -inf only where disallowed: the allowed logits are left as they are, not rewritten.
    ptr = logits_ptr + out_row * stride_l + cols
    tl.store(ptr, tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=inside & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, indices=None,
                               block: int = 1024) -> torch.Tensor:
    """In place; returns logits. logits [B, V] (last dim contiguous), bitmask [b, ceil(V/32)] int32 on
    the same device; b == B without indices. Columns past 32*W are left alone, as in the reference."""
    check_tensor("logits", logits)
    check_tensor("bitmask", bitmask)
    if logits.dtype not in FLOAT_DTYPES:
        raise ValueError(f"logits must be one of {FLOAT_DTYPES}, not {logits.dtype}")
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"logits [B, V] float and bitmask [b, W] int32 expected, got {tuple(logits.shape)} "
                         f"{logits.dtype} and {tuple(bitmask.shape)} {bitmask.dtype}")
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask need a contiguous last dim")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device}, logits on {logits.device}")
    rows = bitmask.shape[0]
    if indices is None:
        if rows != logits.shape[0]:
            raise ValueError(f"{rows} bitmask rows for {logits.shape[0]} logits rows (pass indices)")
        idx = bitmask  # unused
    else:
        idx = torch.as_tensor(indices, device=logits.device)
        if idx.shape != (rows,):
            raise ValueError(f"indices must be [{rows}], got {tuple(idx.shape)}")
    V = min(logits.shape[1], bitmask.shape[1] * 32)
    if rows == 0 or V == 0:
        return logits
    grid = (rows, triton.cdiv(V, block))
    _apply_bitmask_kernel[grid](logits, bitmask, idx, V, logits.stride(0), bitmask.stride(0),
                                HAS_INDICES=indices is not None, BLOCK=block)
    return logits
