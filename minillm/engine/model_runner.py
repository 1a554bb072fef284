"""ModelRunner: turn one scheduled step into tensors, run the model, return the logits (chapter 07).

Inputs of a step, packed with no padding (chapter 02's layout), plus the paged-cache metadata
(chapter 05): for the sequences scheduled with n new tokens each,

    input_ids, positions  [T]        the new tokens and their positions (T = sum of the n's)
    cu_seqlens            [B + 1]    where each sequence's new tokens start
    seq_lens              [B]        keys per sequence after this step (cached + new)
    block_table           [B, W]     each sequence's blocks, padded with 0 to the widest
    slot_mapping          [T]        cache row of each new token: table[p // bs] * bs + p % bs

A decode step of a small model is a few hundred short kernels, and on a fast GPU launching them
from Python costs more than running them. So pure decode batches (every sequence brings one
token) replay a CUDA graph captured once per batch size: the launches are recorded with fixed
input buffers, and a step only copies its inputs in and replays. A batch of b replays the
smallest captured size >= b; the padding rows write nowhere (slot -1) and read block 0.
"""

from __future__ import annotations

import bisect

import torch
from tqdm.auto import tqdm

from ..cache.kv_cache import attention_layers
from ..cache.paged import PagedKVCache
from ..layers import AttentionMetadata
from ..sequence import Sequence
from .block_manager import cdiv
from .config import EngineConfig


def new_tokens(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.token_ids[start:start + n] without building the whole list (decode: one token)."""
    P = len(seq.prompt_ids)
    if start >= P:
        return seq.output_ids[start - P : start - P + n]
    return (seq.prompt_ids[start : start + n] + seq.output_ids[: max(0, start + n - P)])[:n]


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, config: EngineConfig, max_model_len: int):
        self.model, self.cache = model, cache
        self.block_size = cache.block_size
        self.device = cache.device
        self.max_blocks_per_seq = cdiv(max_model_len, self.block_size)
        self.use_cuda_graphs = self.device.type == "cuda" and not config.enforce_eager
        self.graph_sizes = [b for b in (1, 2, 4, 8, *range(16, config.cuda_graph_max_batch + 1, 16))
                            if b <= min(config.cuda_graph_max_batch, config.max_num_seqs)]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._first_layer = attention_layers(model)[0]
        cache.bind(model)

    # ---- inputs ----------------------------------------------------------------------------------

    def prepare(self, scheduled: list[tuple[Sequence, int]], block_tables: dict[int, list[int]]):
        bs = self.block_size
        ids, pos, slots, seq_lens, tables = [], [], [], [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            table = block_tables[seq.seq_id]
            ids += new_tokens(seq, start, n)
            pos += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            seq_lens.append(start + n)
            tables.append(table)
        width = max(len(t) for t in tables)
        table_rows = [t + [0] * (width - len(t)) for t in tables]
        return ids, pos, slots, seq_lens, table_rows

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], block_tables: dict[int, list[int]],
                sample_rows: list[int]) -> torch.Tensor:
        """Run one step; logits [len(sample_rows), vocab] fp32 at the last token of those sequences."""
        if self._first_layer.kv_cache is None or self._first_layer.kv_cache[0] is not self.cache.k_caches[0]:
            self.cache.bind(self.model)  # someone else (chapter 03's one-request path) used the model meanwhile
        ids, pos, slots, seq_lens, table = self.prepare(scheduled, block_tables)
        B = len(scheduled)
        if self.use_cuda_graphs and len(ids) == B and B <= self.graph_sizes[-1]:
            return self._replay(ids, pos, slots, seq_lens, table)[sample_rows]
        dev = self.device
        meta = AttentionMetadata.from_seq_lens([n for _, n in scheduled], dev)
        meta.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)  # [B]
        meta.block_table = torch.tensor(table, dtype=torch.int32, device=dev)  # [B, W]
        meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)  # [T]
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta)  # [T, hidden]
        last = meta.last_token_indices[torch.tensor(sample_rows, dtype=torch.long, device=dev)]
        return self.model.compute_logits(hidden[last])  # [rows, vocab]

    def swap_and_copy(self, swap_out, swap_in, copies) -> None:
        """Block moves the scheduler asked for, before the step's forward pass writes anything."""
        self.cache.swap_out(swap_out)
        self.cache.swap_in(swap_in)
        self.cache.copy_blocks(copies)

    # ---- CUDA graphs -----------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_cuda_graphs(self, progress: bool = True) -> None:
        """Record one decode step per batch size in graph_sizes (largest first, sharing one memory pool)."""
        if not self.use_cuda_graphs:
            return
        B, dev = self.graph_sizes[-1], self.device
        self._ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self._pos = torch.zeros(B, dtype=torch.int64, device=dev)
        self._slots = torch.full((B,), -1, dtype=torch.int64, device=dev)
        self._seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self._table = torch.zeros(B, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self._cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
        pool = torch.cuda.graph_pool_handle()
        for b in tqdm(sorted(self.graph_sizes, reverse=True), desc="capturing CUDA graphs", disable=not progress):
            meta = AttentionMetadata(cu_seqlens=self._cu[: b + 1], max_seqlen=1, seq_lens=self._seq_lens[:b],
                                     block_table=self._table[:b], slot_mapping=self._slots[:b])

            def step(b=b, meta=meta):
                return self.model.compute_logits(self.model(self._ids[:b], self._pos[:b], meta))  # [b, vocab]

            step()  # warm-up: Triton autotunes and compiles here, outside the capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = step()
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize(dev)

    def _replay(self, ids, pos, slots, seq_lens, table) -> torch.Tensor:
        b = len(ids)
        size = self.graph_sizes[bisect.bisect_left(self.graph_sizes, b)]
        graph, logits = self.graphs[size]
        # One host->device copy per input; padding rows: slot -1 (write nothing), one key in block 0.
        self._ids[:b].copy_(torch.tensor(ids), non_blocking=True)
        self._pos[:b].copy_(torch.tensor(pos), non_blocking=True)
        self._slots[:size].fill_(-1)
        self._slots[:b].copy_(torch.tensor(slots), non_blocking=True)
        self._seq_lens[:size].fill_(1)
        self._seq_lens[:b].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        width = len(table[0])
        self._table[:b, :width].copy_(torch.tensor(table, dtype=torch.int32), non_blocking=True)
        self._table[b:size].zero_()
        graph.replay()
        return logits[:b]
