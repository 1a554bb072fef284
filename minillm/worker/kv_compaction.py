"""What the kernels read under StreamingLLM (chapter 15, engine/kv_eviction.py): each block table without
its null entries.

The block manager keeps a sequence's table position-indexed (entry i holds positions [i * bs, (i + 1) * bs))
and points evicted entries at NULL_BLOCK. No window masks those entries under StreamingLLM, so the
worker hands the kernels each row compacted: the kept entries in order, the step's new tokens last, and
seq_lens shortened by bs per dropped entry. The causal mask (queries aligned to the end of the keys) is
then unchanged, and each query attends to exactly the sinks, the recent blocks and its step's own earlier
tokens. (This file is the worker's side; the engine's policy imports it, never the other way round.)
"""

from __future__ import annotations

import numpy as np

NULL_BLOCK = 0  # BlockManager's reserved block: evicted table entries point at it (zeros, never written)


def compact_tables(table, seq_lens: list[int], block_size: int) -> tuple[np.ndarray, list[int]]:
    """Each row of a [B, W] block table without its null entries (kept order), and each sequence's
    key count less block_size per null entry within its length: what the kernels read for StreamingLLM.
    Rows are padded with NULL_BLOCK past their new length, as before."""
    t = np.asarray(table, dtype=np.int32).reshape(len(seq_lens), -1)  # [B, W]
    lens = np.asarray(seq_lens, dtype=np.int64)  # [B]
    used = np.arange(t.shape[1])[None, :] < -(-lens[:, None] // block_size)  # [B, W] entries within the length
    null = used & (t == NULL_BLOCK)
    order = np.argsort(null | ~used, axis=1, kind="stable")  # kept entries first, in order
    out = np.take_along_axis(np.where(used & ~null, t, NULL_BLOCK), order, axis=1)
    return out, (lens - block_size * null.sum(axis=1)).tolist()

