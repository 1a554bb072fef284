"""Executor: the seam between the engine, which decides what runs, and the workers that run it (chapter 13).

`LLMEngine.step` is schedule -> execute -> advance -> sample -> outputs. Only *execute* touches the
model, and it goes through an executor: an object with a few calls, each taking and returning plain
data (numbers, lists, a ModelInput, the sampled tokens), so the engine never holds the model, the
KV cache, the runner or the CUDA graphs itself. Behind the seam, vLLM's two shapes:

    UniprocExecutor     one Worker in this process; a call is a method call (this chapter)
    MultiprocExecutor   one Worker per GPU, each in its own process, every call sent to all of
                        them; rank 0 returns the logits (chapter 11, tensor parallelism)

The calls, in the order an engine makes them:

    determine_num_blocks()              -> (GPU blocks, CPU blocks) the memory holds
    initialize_cache(gpu, cpu)          allocate the pools, capture the decode graphs, build the proposer
    swap_and_copy(out, in, copies, save, load)  the scheduler's block moves for this step (save, load:
                                        chapter 15's offload tier)
    propose(seqs, num_spec, changes)    chapter 09's drafts (the block tables' changes first)
    execute_model(model_input)          -> ModelRunnerOutput: the step's tokens, sampled by the worker
                                        (None when model_input.sampling.defer_bitmask: then
    sample_tokens(bitmask)              -> its ModelRunnerOutput, the grammars' mask applied; chapter 14)
    capture_token_buckets()             every prefill graph now (warm-up)
    shutdown()                          give the memory back
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..worker.model_input import ModelInput, ModelRunnerOutput


class Executor(ABC):
    sizes = None  # ResolvedSizes: the context, the pools, the cache's spec (set by a subclass)

    @abstractmethod
    def determine_num_blocks(self) -> tuple[int, int]: ...

    @abstractmethod
    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, progress: bool = True) -> None: ...

    @abstractmethod
    def execute_model(self, model_input: ModelInput) -> ModelRunnerOutput:
        """Run and sample the step -> its tokens (logits only when model_input.sampling is None). The
        rows model_input.prev_token_dst names take the tokens the worker sampled last, on the device
        (overlap scheduling)."""

    @abstractmethod
    def sample_tokens(self, bitmask) -> ModelRunnerOutput:
        """Sample the step execute_model queued with sampling.defer_bitmask, under this bitmask
        ([S, ceil(V / 32)] int32 numpy, or None): vLLM's sample_tokens(grammar_output)."""

    @abstractmethod
    def swap_and_copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                      copies: list[tuple[int, int]], offload_save: list[tuple[int, int]] = (),
                      offload_load: list[tuple[int, int]] = ()) -> None: ...

    @abstractmethod
    def propose(self, seqs, num_spec: list[int], table_changes) -> tuple[list[list[int]], torch.Tensor | None]:
        """Chapter 09's drafts; table_changes: BlockManager.peek_table_changes() (the drafts' slots)."""

    @abstractmethod
    def capture_token_buckets(self) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...
