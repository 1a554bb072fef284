"""Worker: one model on one device, with everything that holds its memory (chapter 13).

The engine (minillm/engine/) decides what runs; a worker runs it. A worker owns

    the model          its weights (chapter 11: only this rank's shard)
    the KV cache       the paged pool of every attention layer (chapter 05), sized by the engine
    the ModelRunner    a step's ModelInput -> tensors -> forward pass -> logits
    the StepSampler    logits -> tokens (sample_step.py): the engine gets tokens, never logits
    the CUDA graphs    captured once per batch size and token bucket (chapter 07)
    the proposer       chapter 09's drafter, whose forward passes run on this model and cache

and is driven by an executor (minillm/executor/) through a handful of calls: how many KV blocks fit,
build the cache of that many, run a step, move blocks, draft, let everything go. In one process the
executor calls these methods directly; with tensor parallelism there is one worker per GPU, each in
its own process, and the executor sends every one of them the same calls.
"""

from __future__ import annotations

import dataclasses

import torch

from ..cache.offload import KVOffloadStore
from ..cache.paged import PagedKVCache
from ..distributed.kv_transfer import make_kv_connector
from ..lora.layers import set_adapter, wrap_lora_layers
from .hidden_states import HiddenStates
from .model_input import ModelInput, ModelRunnerOutput
from .model_runner import ModelRunner
from .sample_step import StepSampler, sample_deferred, sample_step


class Worker:
    def __init__(self, model, config, draft_model=None):
        self.model, self.config, self.draft_model = model, config, draft_model
        # chapter 16: the adaptable linear layers get max_loras GPU slots each, before any graph is captured
        self.lora_layers = (wrap_lora_layers(model, config.max_loras, config.max_lora_rank)
                            if getattr(config, "enable_lora", False) else {})
        self.sizes = config.resolve(model, draft_model)  # the context, and what memory allows
        self.cache: PagedKVCache | None = None
        self.runner: ModelRunner | None = None
        self.proposer = None
        self.sampler = StepSampler(config.max_num_seqs)
        self.last_sampled: torch.Tensor | None = None  # [R] the last on-device step's tokens (overlap)
        self.kv_connector = None  # chapter 17: the worker side of a KV connector
        self.hidden_states: HiddenStates | None = None  # chapter 09: the target's h, for a learned drafter

    def determine_num_blocks(self) -> tuple[int, int]:
        """(GPU blocks, CPU blocks) this worker's memory holds (the engine takes the minimum over workers)."""
        return self.sizes.num_gpu_blocks, self.sizes.num_cpu_blocks

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, progress: bool = True) -> None:
        """Allocate the KV pools, bind the model's attention layers to them, capture the decode graphs."""
        self.sizes = sizes = dataclasses.replace(self.sizes, num_gpu_blocks=num_gpu_blocks,
                                                 num_cpu_blocks=num_cpu_blocks)
        self.cache = PagedKVCache(list(sizes.kv_cache_spec), num_gpu_blocks, self.config.block_size, sizes.device,
                                  num_cpu_blocks)
        if (kv := self.config.kv_transfer_config) is not None:  # before the runner binds the pool to the model:
            self.kv_connector = make_kv_connector(kv, self.config.block_size, sizes.kv_cache_spec)
            self.kv_connector.register_kv_caches(self.model, self.cache)  # a pull transport may share it
        self.runner = ModelRunner(self.model, self.cache, self.config, sizes.max_model_len, self.kv_connector)
        if sizes.num_offload_blocks:  # chapter 15: this worker's own shard of every offloaded block
            self.runner.offload = KVOffloadStore(self.cache.k_caches, self.cache.v_caches, sizes.num_offload_blocks)
        self.runner.capture_cuda_graphs(progress)
        if self.runner.keep_hidden:
            self.hidden_states = HiddenStates()

    def attach_proposer(self, proposer, progress: bool = True) -> None:
        """Chapter 09's drafter (built by the executor, spec_decode.make_proposer): a model-based one
        gets CUDA graphs of its own passes, on this worker's sizes."""
        self.proposer = proposer
        if hasattr(proposer, "hidden_states"):  # a learned drafter reads the target's h from this worker
            proposer.hidden_states = self.hidden_states
        if self.runner.graphs is not None and hasattr(proposer, "graphs"):  # its passes replay too
            proposer.graphs = self.runner.make_graphs(model=proposer.model)
            with torch.inference_mode():
                proposer.graphs.capture_decode(progress)  # the one-token draft passes

    def execute_model(self, step: ModelInput, prev_tokens: torch.Tensor | None = None,
                      sample: bool = True) -> ModelRunnerOutput | None:
        """Run the step and sample it: -> its tokens (ModelRunnerOutput); its logits
        [len(step.logits_indices), vocab] fp32 in .logits when step.sampling is None; None when
        step.sampling.defer_bitmask (the forward pass is queued; sample_tokens samples it). The rows the step
        takes from the previous one's tokens (overlap scheduling) read the tokens this worker sampled
        last, on the device (prev_tokens: a tensor-parallel rank's copy of rank 0's). sample=False:
        a rank that only takes part in the forward pass (chapter 11)."""
        for slot, lora in step.lora_loads:  # adapters into their GPU slots, in stream order before the pass
            set_adapter(self.lora_layers, slot, lora)
        logits = self.runner.execute(step, self.last_sampled if prev_tokens is None else prev_tokens)
        if self.hidden_states is not None and self.runner.last_hidden is not None:  # kept here, never sent
            self.hidden_states.record(self.runner.last_hidden, step.seq_ids, step.query_lens, step.seq_lens)
        if not sample:
            return None
        out, on_device = sample_step(self.sampler, logits, step.sampling)
        if out is None:  # its bitmask comes with sample_tokens (step.sampling.defer_bitmask)
            return None
        return self._answer(out, on_device)

    def sample_tokens(self, bitmask) -> ModelRunnerOutput:
        """Sample the step execute_model left waiting for its grammars' bitmask ([S, W] int32 numpy, or
        None): applied at the one mask point, sampled on the device, nothing waited for (chapter 14)."""
        return self._answer(*sample_deferred(self.sampler, bitmask))

    def _answer(self, out: ModelRunnerOutput, on_device) -> ModelRunnerOutput:
        if self.kv_connector is not None:  # chapter 17: what this step's transfers moved
            out.kv_stats = self.kv_connector.take_stats()
        self.last_sampled = on_device if on_device is not None else self.last_sampled
        out.kv_block_mass = self.runner.block_mass  # H2O/SnapKV's per-block attention (None otherwise)
        return out

    def swap_and_copy(self, swap_out, swap_in, copies, offload_save=(), offload_load=()) -> None:
        """Block moves the scheduler asked for, before the step's forward pass writes anything; a
        proposer with a cache of its own mirrors the copies (a draft model's blocks are not offloaded:
        a prefix hit makes it draft from scratch, Sequence.num_draft_computed)."""
        self.runner.swap_and_copy(swap_out, swap_in, copies, offload_save, offload_load)
        if self.proposer is not None:
            self.proposer.copy_blocks(copies)

    def propose(self, seqs, num_spec: list[int], table_changes) -> tuple[list[list[int]], torch.Tensor | None]:
        """Chapter 09's drafts: -> (draft tokens per sequence, q or None). table_changes: the block
        tables' changes so far this step (the drafts' reserved slots among them), applied to the
        worker's own tables first: the proposer reads those, not a copy of the engine's."""
        self.runner.block_tables.apply(*table_changes)
        return self.proposer.propose(seqs, num_spec, self.runner.block_tables)

    def capture_token_buckets(self, max_model_len: int) -> None:
        """Every token bucket's graph now (LLMEngine.warm_up), the draft's catch-up passes too."""
        self.runner.capture_token_buckets()
        if getattr(self.proposer, "graphs", None) is not None:
            with torch.inference_mode():
                self.proposer.graphs.capture_buckets(max_model_len)

    def shutdown(self) -> None:
        """Detach the cache from the model and let its memory go (the pool, the CUDA graphs and their
        buffers), so another engine, or a peer in the same process, gets the GPU's memory back."""
        if self.cache is None:
            return
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        self.cache.unbind(self.model)
        if self.hidden_states is not None:
            self.hidden_states.clear()
        if self.runner.graphs is not None:
            self.runner.graphs.clear()
            self.runner.graphs = None  # the static buffers too; what is left runs eagerly
        if getattr(self.proposer, "graphs", None) is not None:  # a draft's graphs (chapter 09)
            self.proposer.graphs.clear()
            self.proposer.graphs = None
        self.cache.k_caches.clear()
        self.cache.v_caches.clear()

