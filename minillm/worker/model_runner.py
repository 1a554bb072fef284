"""ModelRunner: run one step's ModelInput through the model, return the logits (chapters 07, 13).

The engine packs each step into a ModelInput (`model_input.py`: token ids, positions, the paged
cache's slots and block tables, the rows that want logits); the runner turns it into tensors and
runs the forward pass. A step of a small model is a few hundred short kernels, and launching them
from Python costs more than running them; so a step whose shape fits replays a CUDA graph instead
(`cuda_graphs.py`: pure decode batches padded to a captured batch size, steps with prompt tokens
padded to a token bucket).
"""

from __future__ import annotations

import dataclasses

import torch

from ..cache.paged import PagedKVCache
from ..cache.spec import cache_layers
from ..forward_context import set_forward_context
from ..layers import AttentionMetadata
from ..layers.backend import get_kernel_mode
from ..layers.decode_gemv import decode_gemv_refusal, enable_decode_gemv
from ..layers.quantization.kv_cache import ensure_kv_scales
from .block_table import PersistentBlockTable
from .cuda_graphs import StepGraphs, cuda_graph_sizes, token_buckets
from .kv_compaction import SinkRotation, block_masses, compact_tables, observed_queries
from .model_input import ModelInput


def take_prev_tokens(input_ids: torch.Tensor, step: ModelInput, prev_tokens: torch.Tensor | None) -> None:
    """Overlap scheduling (chapter 13): fill the rows whose token the previous step sampled on the GPU
    (step.prev_token_dst, -1 on the host) from its sampled tokens, without the host ever seeing them."""
    if not step.prev_token_dst:
        return
    if prev_tokens is None:
        raise ValueError("this step takes tokens sampled by the previous one, but none were given")
    device = input_ids.device
    dst = torch.tensor(step.prev_token_dst, dtype=torch.long).to(device, non_blocking=True)  # [P]
    src = torch.tensor(step.prev_token_src, dtype=torch.long).to(device, non_blocking=True)  # [P]
    input_ids.index_copy_(0, dst, prev_tokens.index_select(0, src).to(input_ids.dtype))


def token_lora_slots(step: ModelInput) -> list[int] | None:
    """Chapter 16: each token's adapter slot [T] (its sequence's; -1: none), or None without adapters."""
    if step.lora_slots is None:
        return None
    return [slot for slot, n in zip(step.lora_slots, step.query_lens) for _ in range(n)]


def forward_packed(model, device, step: ModelInput, prev_tokens: torch.Tensor | None = None,
                   block_table=None, kv_connector=None, extras: dict | None = None,
                   return_hidden: bool = False):
    """One eager forward pass over a ModelInput; -> logits [len(step.logits_indices), vocab] fp32.
    block_table: the step's [B, W] table when the worker keeps the tables (else step.block_table).
    kv_connector: chapter 17's worker side, bound to the step's work; its attention hooks run inside.
    The forward context carries each token's adapter slot (lora_mapping [T]) when some have one;
    extras: the forward context's (H2O's attention-mass buffer). return_hidden: -> (logits, hidden
    [T, hidden]), the states a learned drafter reads (chapter 09, worker/hidden_states.py)."""
    meta = AttentionMetadata.from_seq_lens(step.query_lens, device)
    meta.seq_lens = torch.tensor(step.seq_lens, dtype=torch.int32, device=device)  # [B]
    table = step.block_table if block_table is None else block_table
    meta.block_table = torch.as_tensor(table, dtype=torch.int32).to(device)  # [B, W]
    meta.slot_mapping = torch.tensor(step.slot_mapping, dtype=torch.int64, device=device)  # [T]
    input_ids = torch.tensor(step.input_ids, device=device)  # [T]
    take_prev_tokens(input_ids, step, prev_tokens)
    slots = token_lora_slots(step)
    lora_mapping = None if slots is None else torch.tensor(slots, dtype=torch.int32, device=device)  # [T]
    with set_forward_context(meta, kv_connector=kv_connector, lora_mapping=lora_mapping, extras=extras or {}):
        hidden = model(input_ids, torch.tensor(step.positions, device=device), meta)  # [T, hidden]
    rows = torch.tensor(step.logits_indices, dtype=torch.long, device=device)  # [rows]
    logits = model.compute_logits(hidden[rows])  # [rows, vocab]
    return (logits, hidden) if return_hidden else logits


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, config, max_model_len: int, kv_connector=None):
        self.model, self.cache = model, cache
        self.offload = None  # chapter 15: the KV offload tier's CPU pool (cache/offload.py), set by the worker
        self.kv_connector = kv_connector  # chapter 17: the worker side of a KV connector, or None
        self.block_size = cache.block_size
        self.device = cache.device
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)  # ceil
        self.block_tables = PersistentBlockTable(config.max_num_seqs, self.max_blocks_per_seq)
        # graphs hold minillm's Triton kernels: MINILLM_KERNELS=torch (the references) runs eagerly
        self.use_cuda_graphs = (self.device.type == "cuda" and not config.enforce_eager
                                and get_kernel_mode() != "torch"
                                and getattr(config, "kv_eviction", None) not in ("h2o", "snapkv"))
        self.graph_sizes = cuda_graph_sizes(config.max_num_seqs, config.cuda_graph_max_batch)
        max_tokens = config.cuda_graph_max_tokens
        self.token_buckets = token_buckets(config.max_num_batched_tokens if max_tokens is None else max_tokens)
        self.max_num_seqs = config.max_num_seqs
        kind = getattr(config, "kv_eviction", None)
        self.compact_kv = kind in ("streaming", "h2o", "snapkv")  # the kernels read each table without its nulls
        # the layers also add up each key's attention mass (kernels/attn_mass.py): from every query (H2O), or
        # from the last snapkv_window queries of a prompt's last chunk (SnapKV's observation window)
        self.mass_window = {"h2o": 0, "snapkv": getattr(config, "snapkv_window", 0)}.get(kind)
        self.block_mass: dict | None = None  # H2O: the last step's {seq_id: (entries, masses)}
        self.sink_rotation = None  # StreamingLLM with positions within the cache (kv_compaction.py)
        if self.compact_kv and config.kv_positions == "cache":
            sink_blocks = -(-config.sink_tokens // self.block_size)
            self.sink_rotation = SinkRotation(model, cache, sink_blocks, config.max_num_seqs)
        spec = config.speculative_config  # chapter 09: a verify wants logits at 1 + k rows per sequence
        self.logits_per_seq = 1 + spec.num_speculative_tokens if spec is not None else 1
        # chapter 09, part two: a learned drafter reads the step's hidden states (worker/hidden_states.py)
        self.keep_hidden = spec is not None and spec.method in ("medusa", "eagle")
        self.last_hidden: torch.Tensor | None = None  # [T, hidden] of the last step (keep_hidden only)
        self.enable_lora = getattr(config, "enable_lora", False)  # graphs then carry a per-token slot buffer
        self._first_layer = cache_layers(model)[0]
        self.decode_backend = getattr(config, "decode_backend", "graphs")
        # chapter 18: "pdl" sends the projections of decode steps through our GEMV; "graphs" (the model is
        # shared: chapter 03's one-request path, a test's second engine) puts the layers' own path back
        if self.decode_backend == "pdl":
            self._enable_pdl()
        else:
            enable_decode_gemv(model, None)
        ensure_kv_scales(model, cache.specs[0].dtype)  # a quantized cache: scales calibrated before any graph
        cache.bind(model)
        self.graphs = self.make_graphs() if self.use_cuda_graphs else None

    def _enable_pdl(self) -> None:
        why = decode_gemv_refusal(self.model, self.device)
        if why is None and self.enable_lora:
            why = "LoRA adapters (enable_lora): the GEMV path has no adapter kernels"
        if why is not None:
            raise ValueError(f"decode_backend='pdl' is not supported here: {why}; use decode_backend='graphs'")
        enable_decode_gemv(self.model, "pdl" if self.device.type == "cuda" else "gemv")  # the interpreter: no PDL

    def make_graphs(self, capture: bool = True, model=None) -> StepGraphs:
        """The static buffers and graphs; capture=False runs the same padded steps eagerly (tests).
        model: another model's steps on the same sizes (chapter 09's draft passes; one logits row a
        sequence)."""
        if model is not None:
            return StepGraphs(model, self.device, self.graph_sizes, self.token_buckets, self.max_num_seqs,
                              self.max_blocks_per_seq, capture)
        return StepGraphs(self.model, self.device, self.graph_sizes, self.token_buckets, self.max_num_seqs,
                          self.max_blocks_per_seq, capture, self.logits_per_seq, lora=self.enable_lora,
                          keep_hidden=self.keep_hidden)

    @torch.inference_mode()
    def execute(self, step: ModelInput, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; -> logits [len(step.logits_indices), vocab] fp32 at those rows of the packed
        tokens (vLLM's logits_indices: each sampling sequence's last token; chapter 09 asks for several
        per sequence, one per draft token). prev_tokens: the previous step's sampled tokens on the
        device, for the rows step.prev_token_dst names (overlap scheduling)."""
        table = self.step_block_table(step)  # first: the table changes must land whatever happens next
        self.last_hidden = None  # set by the paths that keep it (keep_hidden)
        if self.compact_kv:  # StreamingLLM (chapter 15): the kernels read the kept blocks only
            compacted = compact_tables(table, step.seq_lens, self.block_size)
            table = compacted.table
            step = dataclasses.replace(step, seq_lens=compacted.seq_lens)
            if self.sink_rotation is not None:
                table = self.sink_rotation.apply(table, compacted.evicted)
        self.bind()
        if step.prev_token_dst and prev_tokens is None:
            raise ValueError("this step takes tokens sampled by the previous one, but none were given")
        if self.mass_window is not None:  # eager (no graphs): the mass buffer is per step
            mass = torch.zeros(len(step.seq_lens), table.shape[1] * self.block_size, device=self.device)  # [B, keys]
            queries, rows = observed_queries(step, self.mass_window)
            extras = {"attn_mass": (mass, None if queries is None else [t.to(self.device) for t in queries])}
            logits = forward_packed(self.model, self.device, step, prev_tokens, table, extras=extras)
            self.block_mass = block_masses(mass, compacted, step.seq_ids, self.block_size, rows)
            return logits
        kv_meta = step.kv_connector_metadata
        if self.kv_connector is not None and kv_meta is not None and kv_meta.has_work:
            return self._execute_with_transfers(step, prev_tokens, table, kv_meta)
        graphs = self._live_graphs()
        shape = (graphs.shape_for(step.num_tokens, len(step.query_lens), len(step.logits_indices))
                 if graphs is not None else None)
        if shape is not None:
            logits = graphs.run(shape, step.input_ids, step.positions, step.slot_mapping, step.seq_lens,
                                table, step.query_lens, step.logits_indices,
                                (step.prev_token_dst, step.prev_token_src, prev_tokens), token_lora_slots(step))
            if self.keep_hidden:  # the graph's static buffer is overwritten by the next replay: a copy
                self.last_hidden = graphs.hidden[: step.num_tokens].clone()  # [T, hidden]
            return logits
        if self.keep_hidden:
            logits, self.last_hidden = forward_packed(self.model, self.device, step, prev_tokens, table,
                                                      return_hidden=True)
            return logits
        return forward_packed(self.model, self.device, step, prev_tokens, table)

    def _execute_with_transfers(self, step: ModelInput, prev_tokens, table, kv_meta) -> torch.Tensor:
        """Chapter 17: a step that loads or saves K/V runs eagerly (a graph replays no Python hook): the
        loads start, each attention layer waits for its own and hands off its saves, and the step ends
        when every save is done."""
        connector = self.kv_connector
        connector.bind_connector_metadata(kv_meta)
        try:
            connector.start_load_kv()
            logits = forward_packed(self.model, self.device, step, prev_tokens, table, connector)
            connector.wait_for_save()
        finally:
            connector.clear_connector_metadata()
        return logits

    def step_block_table(self, step: ModelInput):
        """The step's [B, W] block table: gathered from the worker's own copy, updated with the step's
        changes (chapter 13), or the padded lists of a message that carries them (labs, tests)."""
        if not step.seq_ids:
            return step.block_table
        self.block_tables.apply(step.dropped_tables, step.table_updates)
        return self.block_tables.gather(step.seq_ids)  # [B, W] int32 numpy

    def bind(self) -> None:
        """Point the model's attention layers at the pool (again, if someone else, chapter 03's
        one-request path, used the model meanwhile)."""
        if self._first_layer.kv_cache is None or self._first_layer.kv_cache[0] is not self.cache.k_caches[0]:
            self.cache.bind(self.model)

    def swap_and_copy(self, swap_out, swap_in, copies, offload_save=(), offload_load=()) -> None:
        """Block moves the scheduler asked for, before the step's forward pass writes anything: every
        read of a block this step hands out again (swap-out, offload saves) before any write."""
        self.cache.swap_out(swap_out)
        if offload_save or offload_load:
            self.offload.transfer(offload_save, offload_load)  # chapter 15's CPU tier (cache/offload.py)
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
