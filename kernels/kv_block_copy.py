"""Copying runs of KV-cache rows from one pool to another in one pass (chapter 17: the CUDA IPC
connector's device-to-device copy; vLLM's `copy_blocks` does the same inside one pool).

A consumer engine loads a prompt's K/V out of the producer's pool: producer rows (block * block_size +
offset) into its own rows. Both sides store a position at the same offset of its block, so the rows of
a prompt come in *runs*: consecutive on both sides, for a whole block at least (for many blocks when the
two block managers handed out consecutive blocks). A run is one flat piece of memory on each side:

    src: [src_slots, row_elems]    dst: [dst_slots, row_elems]    (a layer's K or V viewed as rows)
    runs: (src_row, dst_row, n)    dst[dst_row : dst_row + n] = src[src_row : src_row + n]

PyTorch would do it as `dst.index_copy_(0, d, src.index_select(0, s))`: a gather into a temporary, then
a scatter, so each byte is read twice and written twice. The kernel reads each byte once and writes it
once, the cost of a plain copy, in one launch for all the step's runs of a layer: program (r, t) copies
tile t of run r (runs cut to at most MAX_RUN_ROWS rows so the grid stays even). Rows are copied as
int32/int64 words, whatever the cache dtype: bits, no arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

MAX_RUN_ROWS = 64  # a run longer than this is cut: every program of the grid has about as much to copy
BLOCK = 1024  # words a program copies


def copy_runs(src_slots, dst_slots, max_rows: int = MAX_RUN_ROWS) -> np.ndarray:
    """[n] source rows and [n] destination rows -> [R, 3] int64 runs (src_row, dst_row, length) where
    both sides are consecutive, each at most max_rows long."""
    s, d = np.asarray(src_slots, dtype=np.int64), np.asarray(dst_slots, dtype=np.int64)
    if s.shape != d.shape or s.ndim != 1:
        raise ValueError(f"src_slots and dst_slots must be two lists of one length, not {s.shape} and {d.shape}")
    if s.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    # a run breaks where either side is not the previous row + 1, or where it reaches max_rows
    brk = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate([[0], brk])
    lengths = np.diff(np.concatenate([starts, [s.size]]))
    out = []
    for st, n in zip(starts.tolist(), lengths.tolist()):
        for off in range(0, n, max_rows):
            out.append((s[st] + off, d[st] + off, min(max_rows, n - off)))
    return np.asarray(out, dtype=np.int64).reshape(-1, 3)


def _words(rows: torch.Tensor) -> torch.Tensor:
    """[slots, row_bytes] uint8 -> [slots, words] of the widest word that divides a row (a view)."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if rows.shape[1] % size == 0:
            return rows.view(dtype)
    return rows


@triton.jit
def _copy_runs_kernel(src_ptr, dst_ptr, runs_ptr, row_words, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    t = tl.program_id(1)
    src_row = tl.load(runs_ptr + 3 * r).to(tl.int64)
    dst_row = tl.load(runs_ptr + 3 * r + 1).to(tl.int64)
    n = tl.load(runs_ptr + 3 * r + 2).to(tl.int64)
    offs = t * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # words into the run, which is flat on both sides
    mask = offs < n * row_words
    x = tl.load(src_ptr + src_row * row_words + offs, mask=mask)
    tl.store(dst_ptr + dst_row * row_words + offs, x, mask=mask)


def copy_rows_reference(src: torch.Tensor, dst: torch.Tensor, runs: torch.Tensor) -> None:
    """The plain-PyTorch copy the kernel must equal."""
    for s, d, n in runs.tolist():
        dst[d:d + n].copy_(src[s:s + n])


def copy_rows(src: torch.Tensor, dst: torch.Tensor, runs: torch.Tensor, max_rows: int = MAX_RUN_ROWS) -> None:
    """dst[d:d+n] = src[s:s+n] for every run (s, d, n) of runs [R, 3] int64 on dst's device.
    src, dst: [slots, row_bytes] uint8 row views (layout.row_view) of one layer's K or V."""
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.dim() != 2 or dst.dim() != 2:
        raise TypeError(f"src and dst must be [slots, row_bytes] uint8 row views, not {src.dtype}{tuple(src.shape)} "
                        f"and {dst.dtype}{tuple(dst.shape)}")
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"rows differ: {src.shape[1]} bytes at the source, {dst.shape[1]} at the destination")
    if src.device != dst.device or runs.device != dst.device:
        raise ValueError(f"src, dst and runs must be on one device, not {src.device}, {dst.device}, {runs.device}")
    if runs.numel() == 0:
        return
    s, d = _words(src), _words(dst)
    grid = (runs.shape[0], triton.cdiv(max_rows * s.shape[1], BLOCK))
    _copy_runs_kernel[grid](s, d, runs, s.shape[1], BLOCK=BLOCK)
