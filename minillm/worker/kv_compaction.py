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

from typing import NamedTuple

import numpy as np
import torch

from ..layers.rotary_embedding import RotaryEmbedding

NULL_BLOCK = 0  # BlockManager's reserved block: evicted table entries point at it (zeros, never written)


class Compacted(NamedTuple):
    table: np.ndarray  # [B, W] the kept entries of each row first, in order; NULL_BLOCK after them
    seq_lens: list[int]  # [B] keys per row that the kernels read
    evicted: list[int]  # [B] tokens dropped from each row (block_size per null entry within its length)
    entries: np.ndarray  # [B, W] the block-table entry (index) each column of `table` came from


def compact_tables(table, seq_lens: list[int], block_size: int) -> Compacted:
    """Each row of a [B, W] block table without its null entries (kept order): what the kernels read
    for StreamingLLM and H2O. Rows are padded with NULL_BLOCK past their new length, as before."""
    t = np.asarray(table, dtype=np.int32).reshape(len(seq_lens), -1)  # [B, W]
    lens = np.asarray(seq_lens, dtype=np.int64)  # [B]
    used = np.arange(t.shape[1])[None, :] < -(-lens[:, None] // block_size)  # [B, W] entries within the length
    null = used & (t == NULL_BLOCK)
    order = np.argsort(null | ~used, axis=1, kind="stable")  # [B, W] kept entries first, in order
    out = np.take_along_axis(np.where(used & ~null, t, NULL_BLOCK), order, axis=1)
    evicted = block_size * null.sum(axis=1)  # [B]
    return Compacted(out, (lens - evicted).tolist(), evicted.tolist(), order)


def block_masses(mass: torch.Tensor, compacted: Compacted, seq_ids: list[int], block_size: int,
                 rows: list[int] | None = None) -> dict:
    """H2O, SnapKV: a step's attention mass per compacted key [B, W * bs] -> {seq_id: (entries, masses)},
    the mass of each kept table entry (its block's keys summed), for the engine's policy (kv_eviction.py).
    rows: the batch rows that were observed (None: all)."""
    per_block = mass.view(mass.shape[0], -1, block_size).sum(-1).cpu().numpy()  # [B, W]
    out = {}
    for b in range(len(seq_ids)) if rows is None else rows:
        n = -(-compacted.seq_lens[b] // block_size)  # kept entries of row b
        out[seq_ids[b]] = (compacted.entries[b, :n].tolist(), per_block[b, :n].tolist())
    return out


def observed_queries(step, window: int):
    """SnapKV's observation window: the last `window` query tokens of each row that ends its prompt this
    step (a chunk of several tokens whose last one samples). -> ((token indices [T'], cu_seqlens [B + 1])
    or None for every query (window 0: H2O), the observed rows)."""
    if window == 0:
        return None, None
    samples = set(step.logits_indices)
    tokens, cu, rows, end = [], [0], [], 0
    for b, n in enumerate(step.query_lens):
        end += n
        if n > 1 and end - 1 in samples:  # the prompt's last chunk (a decode, n = 1, is not observed)
            tokens += range(end - min(window, n), end)
            rows.append(b)
        cu.append(len(tokens))
    return (torch.tensor(tokens, dtype=torch.long), torch.tensor(cu, dtype=torch.int32)), rows


class SinkRotation:
    """StreamingLLM with positions within the cache (kv_positions="cache"; the paper's choice).

    The paper numbers the kept tokens 0, 1, 2, ... as they sit in the cache: with sinks [0, 4) and
    recent tokens [20, 28) kept, the query at 28 sits at cache position 12 and the key at 20 at 4. RoPE
    makes a score depend only on the two positions' difference, so only the differences matter: a query
    and a recent key differ by the same amount in either numbering (the recent tokens are contiguous), a
    query and a sink key by E less in the cache's (E: the tokens evicted between them). So the cache's
    numbering is reached by moving the sinks E positions forward and nothing else: queries and recent
    keys keep the positions they were rotated with.

    The pool's sink blocks are shared (prefix caching) and stay as written; each step, each sequence with
    E > 0 gets a rotated copy of them in blocks of its own, and its compacted table points at the copy:
    k' = R(E) k (rotations compose: a key rotated to n, rotated by E more, is the key rotated to n + E),
    v' = v. The copy is remade from the originals every step, so no rounding accumulates. The copies live
    in the last sink_blocks * max_num_seqs blocks of the pool, `sink_blocks` per batch row, which the
    block manager never hands out (LLMEngine gives it a pool that much smaller)."""

    def __init__(self, model, cache, sink_blocks: int, max_num_seqs: int):
        if any(not spec.has_v or spec.has_scales for spec in cache.specs):
            raise ValueError("kv_positions='cache' rotates cached keys: it needs a K and V cache in a float dtype "
                             "(not MLA's latent, not a quantized kv_cache_dtype); use kv_positions='original'")
        rotaries = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        if len(rotaries) != 1:
            raise ValueError(f"kv_positions='cache' needs a model with one RoPE table, this one has {len(rotaries)}")
        self.rotary, self.cache, self.sink_blocks = rotaries[0], cache, sink_blocks
        self.first = cache.num_blocks - reserved_sink_blocks(sink_blocks, max_num_seqs)

    def apply(self, table: np.ndarray, evicted: list[int]) -> np.ndarray:
        """table: a compacted [B, W] table (sinks first); evicted: E per row. -> the table whose rows with
        E > 0 point at freshly rotated copies of their sink blocks."""
        sb = self.sink_blocks
        rows = [i for i, e in enumerate(evicted) if e > 0]
        if not rows or sb == 0:
            return table
        table = table.copy()
        device = self.cache.k_caches[0].device
        src = torch.as_tensor(table[rows, :sb].reshape(-1), dtype=torch.long, device=device)  # [R * sb]
        dst = self.first + (torch.tensor(rows)[:, None] * sb + torch.arange(sb)[None, :]).reshape(-1)  # [R * sb]
        shift = torch.tensor([evicted[i] for i in rows], device=device).repeat_interleave(sb)  # [R * sb]
        to = dst.to(device)
        for k_cache, v_cache in zip(self.cache.k_caches, self.cache.v_caches):
            cos, sin = self.rotary.cos_sin(shift, k_cache.dtype)  # [R * sb, 1, D] each
            k = k_cache[src]  # [R * sb, bs, Hkv, D]
            k_cache[to] = k * cos[:, None] + rotate_half(k) * sin[:, None]
            v_cache[to] = v_cache[src]
        table[rows, :sb] = dst.view(len(rows), sb).numpy()
        return table


def reserved_sink_blocks(sink_blocks: int, max_num_seqs: int) -> int:
    """Pool blocks SinkRotation keeps for its copies (the last ones)."""
    return sink_blocks * max_num_seqs


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [-x2, x1]: RoPE's "rotate half" layout (layers/rotary_embedding.py)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
