"""EngineConfig: the knobs of the serving engine, with vLLM's names, checked when built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV block (chapter 05)
    num_gpu_blocks: int | None = None  # None: as many as gpu_memory_utilization allows (a GPU is needed)
    # share of the GPU's memory this engine may fill, weights included; the default can be set with
    # MINILLM_GPU_MEMORY_UTILIZATION (several engines on one GPU: parallel test workers, notebooks)
    gpu_memory_utilization: float = field(
        default_factory=lambda: float(os.environ.get("MINILLM_GPU_MEMORY_UTILIZATION", "0.9")))
    swap_space: float = 1.0  # GiB of CPU memory for swapped-out blocks (preemption_mode="swap")
    num_cpu_blocks: int | None = None  # overrides swap_space when given
    enable_prefix_caching: bool | str | None = None  # None/False, True/"hash" (vLLM) or "radix" (SGLang)
    max_num_batched_tokens: int = 2048  # token budget of one step (decode tokens + prefill chunks)
    max_num_seqs: int = 256  # sequences running at once
    max_model_len: int | None = None  # None: the model's context
    preemption_mode: str = "recompute"  # or "swap"
    enforce_eager: bool = False  # True: no CUDA graphs
    cuda_graph_max_batch: int = 256  # decode batches up to this size replay a captured graph
    # steps with prompt tokens (prefill chunks, mixed with decodes) of up to this many tokens replay a
    # graph too, captured per token bucket on first use; None: max_num_batched_tokens; 0: run them eagerly
    cuda_graph_max_tokens: int | None = None

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "cuda_graph_max_batch"):
            positive_int(name, getattr(self, name))
        for name in ("num_gpu_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.cuda_graph_max_tokens is not None and (not isinstance(self.cuda_graph_max_tokens, int) or isinstance(
                self.cuda_graph_max_tokens, bool) or self.cuda_graph_max_tokens < 0):
            raise ValueError(f"cuda_graph_max_tokens must be None or an int >= 0, not {self.cuda_graph_max_tokens!r}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (block 0 is reserved), not {self.num_gpu_blocks}")
        if self.num_cpu_blocks is not None and (not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0):
            raise ValueError(f"num_cpu_blocks must be None or an int >= 0, not {self.num_cpu_blocks!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization!r}")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, not {self.swap_space!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', not {self.preemption_mode!r}")
        if self.enable_prefix_caching is True:
            self.enable_prefix_caching = "hash"
        elif self.enable_prefix_caching is False:
            self.enable_prefix_caching = None
        if self.enable_prefix_caching not in (None, "hash", "radix"):
            raise ValueError("enable_prefix_caching must be None/False, True/'hash' or 'radix', "
                             f"not {self.enable_prefix_caching!r}")
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"enforce_eager must be True or False, not {self.enforce_eager!r}")


def positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, not {value!r}")
