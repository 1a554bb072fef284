"""ModelRunner: turn one scheduled step into tensors, run the model, return the logits (chapter 07).

Inputs of a step, packed with no padding (chapter 02's layout), plus the paged-cache metadata
(chapter 05): for the sequences scheduled with n new tokens each,

    input_ids, positions  [T]        the new tokens and their positions (T = sum of the n's)
    cu_seqlens            [B + 1]    where each sequence's new tokens start
    seq_lens              [B]        keys per sequence after this step (cached + new)
    block_table           [B, W]     each sequence's blocks, padded with 0 to the widest
    slot_mapping          [T]        cache row of each new token: table[p // bs] * bs + p % bs

A step of a small model is a few hundred short kernels, and launching them from Python costs more
than running them; so a step whose shape fits replays a CUDA graph instead (`cuda_graphs.py`: pure
decode batches padded to a captured batch size, steps with prompt tokens padded to a token bucket).
"""

from __future__ import annotations

import torch

from ..cache.paged import PagedKVCache
from ..cache.spec import cache_layers
from ..layers import AttentionMetadata
from ..layers.backend import get_kernel_mode
from ..layers.quantization.kv_cache import ensure_kv_scales
from ..sequence import Sequence
from .block_manager import cdiv
from .config import EngineConfig
from .cuda_graphs import StepGraphs, cuda_graph_sizes, token_buckets


def new_tokens(seq: Sequence, start: int, n: int) -> list[int]:
    """seq.token_ids[start:start + n] without building the whole list (decode: one token); past the
    sequence's end, its draft tokens of this step (chapter 09: verified beside the last token)."""
    P, end = len(seq.prompt_ids), seq.num_tokens
    if start + n > end:
        return new_tokens(seq, start, end - start) + seq.spec_token_ids[: start + n - end]
    if start >= P:
        return seq.output_ids[start - P : start - P + n]
    return (seq.prompt_ids[start : start + n] + seq.output_ids[: max(0, start + n - P)])[:n]


def pack(chunks: list[tuple[int, list[int], list[int]]], block_size: int):
    """(start position, new token ids, block table) per sequence -> the step's packed lists: ids, positions,
    slots [T]; seq_lens [B]; block table rows [B, W] padded with 0."""
    ids, pos, slots, seq_lens, tables = [], [], [], [], []
    for start, tokens, table in chunks:
        n = len(tokens)
        ids += tokens
        pos += range(start, start + n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        seq_lens.append(start + n)
        tables.append(table)
    width = max(len(t) for t in tables)
    return ids, pos, slots, seq_lens, [t + [0] * (width - len(t)) for t in tables]


def forward_packed(model, device, packed, query_lens: list[int], logits_indices: list[int]) -> torch.Tensor:
    """One eager forward pass over pack()'s lists; -> logits [len(logits_indices), vocab] fp32."""
    ids, pos, slots, seq_lens, table = packed
    meta = AttentionMetadata.from_seq_lens(query_lens, device)
    meta.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)  # [B]
    meta.block_table = torch.tensor(table, dtype=torch.int32, device=device)  # [B, W]
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)  # [T]
    hidden = model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), meta)  # [T, hidden]
    rows = torch.tensor(logits_indices, dtype=torch.long, device=device)  # [rows]
    return model.compute_logits(hidden[rows])  # [rows, vocab]


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, config: EngineConfig, max_model_len: int):
        self.model, self.cache = model, cache
        self.block_size = cache.block_size
        self.device = cache.device
        self.max_model_len, self.max_blocks_per_seq = max_model_len, cdiv(max_model_len, self.block_size)
        # graphs hold minillm's Triton kernels: MINILLM_KERNELS=torch (the references) runs eagerly
        self.use_cuda_graphs = (self.device.type == "cuda" and not config.enforce_eager
                                and get_kernel_mode() != "torch")
        self.graph_sizes = cuda_graph_sizes(config.max_num_seqs, config.cuda_graph_max_batch)
        max_tokens = config.cuda_graph_max_tokens
        self.token_buckets = token_buckets(config.max_num_batched_tokens if max_tokens is None else max_tokens)
        self.max_num_seqs = config.max_num_seqs
        spec = config.speculative_config  # chapter 09: a verify wants logits at 1 + k rows per sequence
        self.logits_per_seq = 1 + spec.num_speculative_tokens if spec is not None else 1
        self._first_layer = cache_layers(model)[0]
        ensure_kv_scales(model, cache.specs[0].dtype)  # a quantized cache: scales calibrated before any graph
        cache.bind(model)
        self.graphs = self.make_graphs() if self.use_cuda_graphs else None

    def make_graphs(self, capture: bool = True, model=None) -> StepGraphs:
        """The static buffers and graphs; capture=False runs the same padded steps eagerly (tests).
        model: another model's steps on the same sizes (chapter 09's draft passes; one logits row a
        sequence)."""
        if model is not None:
            return StepGraphs(model, self.device, self.graph_sizes, self.token_buckets, self.max_num_seqs,
                              self.max_blocks_per_seq, capture)
        return StepGraphs(self.model, self.device, self.graph_sizes, self.token_buckets, self.max_num_seqs,
                          self.max_blocks_per_seq, capture, self.logits_per_seq)

    # ---- inputs ----------------------------------------------------------------------------------

    def prepare(self, scheduled: list[tuple[Sequence, int]], block_tables: dict[int, list[int]]):
        return pack([(s.num_computed_tokens, new_tokens(s, s.num_computed_tokens, n), block_tables[s.seq_id])
                     for s, n in scheduled], self.block_size)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]], block_tables: dict[int, list[int]],
                logits_indices: list[int]) -> torch.Tensor:
        """Run one step; -> logits [len(logits_indices), vocab] fp32 at those rows of the packed tokens
        (vLLM's logits_indices: each sampling sequence's last token; chapter 09 asks for several per
        sequence, one per draft token)."""
        self.bind()
        ids, pos, slots, seq_lens, table = self.prepare(scheduled, block_tables)
        query_lens = [n for _, n in scheduled]
        graphs = self._live_graphs()
        shape = graphs.shape_for(len(ids), len(scheduled), len(logits_indices)) if graphs is not None else None
        if shape is not None:
            return graphs.run(shape, ids, pos, slots, seq_lens, table, query_lens, logits_indices)
        return forward_packed(self.model, self.device, (ids, pos, slots, seq_lens, table), query_lens, logits_indices)

    def bind(self) -> None:
        """Point the model's attention layers at the pool (again, if someone else, chapter 03's
        one-request path, used the model meanwhile)."""
        if self._first_layer.kv_cache is None or self._first_layer.kv_cache[0] is not self.cache.k_caches[0]:
            self.cache.bind(self.model)

    def swap_and_copy(self, swap_out, swap_in, copies) -> None:
        """Block moves the scheduler asked for, before the step's forward pass writes anything."""
        self.cache.swap_out(swap_out)
        self.cache.swap_in(swap_in)
        self.cache.copy_blocks(copies)

    # ---- CUDA graphs -----------------------------------------------------------------------------

    def _live_graphs(self) -> StepGraphs | None:
        """The graphs, unless kernel_mode("torch") was switched on after start-up: they hold minillm's
        Triton kernels, and the references must run eagerly (they synchronise with the host)."""
        return self.graphs if get_kernel_mode() != "torch" else None

    @torch.inference_mode()
    def capture_cuda_graphs(self, progress: bool = True) -> None:
        """Record one decode step per batch size in graph_sizes now; steps with prompt tokens are
        captured per token bucket when first needed."""
        if (graphs := self._live_graphs()) is not None:
            graphs.capture_decode(progress)

    @torch.inference_mode()
    def capture_token_buckets(self) -> None:
        """Record every token bucket's graph now (LLMEngine.warm_up), not at its first step."""
        if (graphs := self._live_graphs()) is not None:
            graphs.capture_buckets(self.max_model_len)
