"""EngineConfig: the knobs of the serving engine, with vLLM's names, checked when built; and
ResolvedSizes: what they mean for one model, worked out once (`EngineConfig.resolve`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..cache import KVCacheSpec, PagedKVCache, kv_cache_spec
from ..checks import check_choice, check_float, check_int, is_int
from ..distributed.kv_transfer.config import KVTransferConfig
from ..layers.quantization.kv_cache import check_kv_cache_device, kv_cache_torch_dtype
from ..spec_decode.config import SpeculativeConfig
from ..structured_output.xgrammar_backend import import_xgrammar

CPU_KV_CACHE_BYTES = 512 * 2**20  # KV pool on a CPU when num_gpu_blocks is not given
MAX_SWAP_SPACE_GIB = 1 << 20  # a sanity bound (1 PiB): anything above is a typo, and inf cannot be sized


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
    # what the KV cache stores (chapter 08): "auto" (the model's dtype), "fp8"/"fp8_e4m3" or "int8": one
    # byte per number with calibrated per-head scales, so the pool holds twice the tokens
    kv_cache_dtype: str = "auto"
    # speculative decoding (chapter 09), vLLM's keys: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b}, {"model": PATH, "num_speculative_tokens": k},
    # {"method": "layer_skip", "num_draft_layers": L, "num_speculative_tokens": k}; None: off
    speculative_config: dict | SpeculativeConfig | None = None
    # overlap scheduling (chapter 13; vLLM's --async-scheduling): prepare step N+1 while the GPU runs step
    # N, the sampled tokens staying on the GPU. None: on where it pays (a CUDA model), off on a CPU.
    # Steps of requests that need the host's view of every token (logprobs, penalties, min_tokens) and
    # speculative decoding run without it.
    async_scheduling: bool | None = None
    # structured output (chapter 14; vLLM's name): whose compiler and matcher fill the token bitmask,
    # "minillm" (ours, structured_output/) or "xgrammar" (the PyPI package), behind the same mask point
    structured_outputs_backend: str = "minillm"
    # disaggregated prefill and decode (chapter 17; vLLM's kv_transfer_config): {"kv_connector":
    # "SharedStorageConnector" | "SharedPoolConnector" | "CudaIpcConnector", "kv_role": "producer" | "consumer" | "both",
    # "kv_path": DIR, ...} (distributed/kv_transfer/config.py); None: off
    kv_transfer_config: dict | KVTransferConfig | None = None
    # multi-LoRA serving (chapter 16), vLLM's names: requests may carry a LoRARequest; max_loras adapters
    # run in one step (GPU slots), of rank <= max_lora_rank; up to max_cpu_loras (None: max_loras)
    # stay read and checked on the CPU, least recently used evicted first
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # KV eviction (chapter 15, engine/kv_eviction.py): "auto" frees the blocks a model whose every layer has
    # a sliding window will never read again (exact), "sliding" insists on it, "none" keeps every block;
    # "streaming" (StreamingLLM) keeps the first sink_tokens (whole blocks) and the most recent tokens, up
    # to kv_budget tokens in all, for unbounded generation in constant memory (an approximation); "h2o"
    # keeps kv_budget tokens: the recent half and the blocks that got the most attention (heavy hitters);
    # "snapkv" keeps, once the prompt is in, the prompt blocks its last snapkv_window queries attend to most.
    # kv_positions (streaming only): "original" scores a kept key at the position it was written at, "cache"
    # at its place among the kept tokens, as the paper does (worker/kv_compaction.py SinkRotation)
    kv_eviction: str = "auto"
    sink_tokens: int = 4
    kv_budget: int | None = None
    kv_positions: str = "original"
    snapkv_window: int = 16  # "snapkv": the prompt's last queries whose attention picks its blocks
    # the KV offload tier (chapter 15, engine/kv_offload.py; SGLang's HiCache, vLLM's KV offloading): a prefix-
    # cache block evicted from the GPU pool is copied to a pinned CPU pool of kv_offload_gb GiB per worker (or
    # kv_offload_blocks blocks, which overrides it) instead of being dropped, least recently used out first,
    # and copied back when a later prompt starts with it. 0: off. Needs enable_prefix_caching.
    # (Not vLLM's cpu_offload_gb: that one offloads weights.)
    kv_offload_gb: float = 0
    kv_offload_blocks: int | None = None
    # how a decode step runs (chapter 18): "graphs" (chapter 07/13's kernels, cuBLAS projections, in a CUDA
    # graph) or "pdl" (our split-K GEMV for the projections of steps of <= 8 tokens, each kernel launched with
    # programmatic dependent launch so it reads its weights under the previous kernel's tail); "pdl" needs a
    # Hopper GPU and a dense, unquantized Llama/Qwen3 model at TP = 1 without LoRA, and is refused otherwise
    decode_backend: str = "graphs"

    def __post_init__(self):
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "cuda_graph_max_batch"):
            check_int(name, getattr(self, name))
        check_int("max_model_len", self.max_model_len, optional=True)
        check_int("cuda_graph_max_tokens", self.cuda_graph_max_tokens, 0, optional=True)
        if self.num_gpu_blocks is not None and is_int(self.num_gpu_blocks) and self.num_gpu_blocks == 1:
            raise ValueError(f"num_gpu_blocks must be >= 2 (block 0 is reserved), not {self.num_gpu_blocks}")
        check_int("num_gpu_blocks", self.num_gpu_blocks, optional=True)
        check_int("num_cpu_blocks", self.num_cpu_blocks, 0, optional=True)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool) \
                or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization!r}")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) \
                or not 0 <= self.swap_space <= MAX_SWAP_SPACE_GIB:
            raise ValueError(f"swap_space must be a number of GiB in [0, {MAX_SWAP_SPACE_GIB}], "
                             f"not {self.swap_space!r}")
        check_choice("preemption_mode", self.preemption_mode, ("recompute", "swap"))
        if self.enable_prefix_caching is True:
            self.enable_prefix_caching = "hash"
        elif self.enable_prefix_caching is False:
            self.enable_prefix_caching = None
        if self.enable_prefix_caching not in (None, "hash", "radix"):
            raise ValueError("enable_prefix_caching must be None/False, True/'hash' or 'radix', "
                             f"not {self.enable_prefix_caching!r}")
        if not isinstance(self.enforce_eager, bool):
            raise TypeError(f"enforce_eager must be True or False, not {self.enforce_eager!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError(f"async_scheduling must be True, False or None (auto), not {self.async_scheduling!r}")
        check_choice("decode_backend", self.decode_backend, ("graphs", "pdl"))
        check_choice("structured_outputs_backend", self.structured_outputs_backend, ("minillm", "xgrammar"))
        if self.structured_outputs_backend == "xgrammar":  # not installed: say so before any model loads
            import_xgrammar()
        if not isinstance(self.enable_lora, bool):
            raise TypeError(f"enable_lora must be True or False, not {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            check_int(name, getattr(self, name))
        check_int("max_cpu_loras", self.max_cpu_loras, optional=True)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): every "
                             "adapter in a GPU slot has its CPU copy")
        self._check_kv_eviction()
        self._check_kv_offload()
        kv_cache_torch_dtype(self.kv_cache_dtype)  # an unknown name fails here, before any model is touched
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = KVTransferConfig.from_dict(self.kv_transfer_config)
        if self.speculative_config is not None:
            self.speculative_config = spec = SpeculativeConfig.from_dict(self.speculative_config)
            if spec.num_speculative_tokens + 1 > self.max_num_batched_tokens:
                raise ValueError(f"speculative_config num_speculative_tokens={spec.num_speculative_tokens} does not "
                                 f"fit a step of max_num_batched_tokens={self.max_num_batched_tokens} beside its token")

    def _check_kv_eviction(self) -> None:
        check_choice("kv_eviction", self.kv_eviction, ("auto", "none", "sliding", "streaming", "h2o", "snapkv"))
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("kv_budget", self.kv_budget, optional=True)
        kind = self.kv_eviction
        check_int("snapkv_window", self.snapkv_window)
        if kind in ("streaming", "h2o", "snapkv") and self.kv_budget is None:
            raise ValueError(f"kv_eviction={kind!r} needs kv_budget (tokens kept per sequence)")
        if kind == "streaming":
            sink = -(-self.sink_tokens // self.block_size) * self.block_size
            if self.kv_budget < sink + self.block_size:
                raise ValueError(f"kv_budget={self.kv_budget} must hold the sink block(s) ({sink} tokens for "
                                 f"sink_tokens={self.sink_tokens}) and at least one recent block of "
                                 f"block_size={self.block_size}")
        elif kind in ("h2o", "snapkv"):
            if self.kv_budget < 2 * self.block_size:
                raise ValueError(f"kv_budget={self.kv_budget} must hold at least 2 blocks of block_size="
                                 f"{self.block_size} (chosen blocks and a recent window) for kv_eviction={kind!r}")
            # they rank blocks by the attention queries gave them: a draft's rejected tokens would add theirs,
            # an overlapped step would rank with a stale sum, and (H2O, every query) a prefix hit skips some
            off = {"speculative_config": self.speculative_config, "async_scheduling": self.async_scheduling or None}
            if kind == "h2o":
                off["enable_prefix_caching"] = self.enable_prefix_caching
            for field, value in off.items():
                if value is not None:
                    raise ValueError(f"kv_eviction={kind!r} cannot run with {field}={value!r}: leave it off")
            if kv_cache_torch_dtype(self.kv_cache_dtype) is not None:
                raise ValueError(f"kv_eviction={kind!r} reads keys as floats; kv_cache_dtype={self.kv_cache_dtype!r} "
                                 "is quantized: use 'auto'")
        elif self.kv_budget is not None:
            raise ValueError(f"kv_budget is for kv_eviction='streaming', 'h2o' or 'snapkv', not {kind!r}")
        check_choice("kv_positions", self.kv_positions, ("original", "cache"))
        if self.kv_positions == "cache" and kind != "streaming":
            raise ValueError(f"kv_positions='cache' is for kv_eviction='streaming', not {kind!r}")

    def _check_kv_offload(self) -> None:
        check_float("kv_offload_gb", self.kv_offload_gb, 0, MAX_SWAP_SPACE_GIB)
        check_int("kv_offload_blocks", self.kv_offload_blocks, 0, optional=True)
        if not self.offloads:
            return
        if self.enable_prefix_caching is None:
            raise ValueError("kv_offload_gb/kv_offload_blocks keep evicted prefix-cache blocks on the CPU: they need "
                             "enable_prefix_caching ('hash' or 'radix')")
        if self.kv_eviction not in ("auto", "none"):  # a policy nulls table entries a restored chain would need
            raise ValueError(f"kv_offload cannot run with kv_eviction={self.kv_eviction!r}: use 'none' or 'auto'")
        if self.kv_transfer_config is not None:
            raise ValueError("kv_offload cannot run with kv_transfer_config (a KV connector loads its own blocks)")

    @property
    def offloads(self) -> bool:
        """Whether the KV offload tier is asked for."""
        return bool(self.kv_offload_blocks) if self.kv_offload_blocks is not None else self.kv_offload_gb > 0

    def num_offload_blocks(self, block_bytes: int) -> int:
        """CPU offload slots: kv_offload_blocks, or what kv_offload_gb holds of blocks of block_bytes."""
        if self.kv_offload_blocks is not None:
            return self.kv_offload_blocks
        if self.kv_offload_gb and not block_bytes:
            raise ValueError("kv_offload_gb needs the cache's block size in bytes; give kv_offload_blocks instead")
        n = int(self.kv_offload_gb * 2**30) // block_bytes if self.kv_offload_gb else 0
        if self.kv_offload_gb and n < 1:
            raise ValueError(f"kv_offload_gb={self.kv_offload_gb} holds no block of {block_bytes} bytes")
        return n

    def resolve(self, model, draft_model=None) -> ResolvedSizes:
        """The sizes this config means for this model, worked out once: the context, the KV pool on the
        GPU (num_gpu_blocks, or what gpu_memory_utilization leaves, or a fixed budget on a CPU) and the
        CPU blocks for swapping. The engine, its runner and (chapter 09) a draft model read them here."""
        mc = model.config
        param = next(model.parameters())
        kv_dtype = kv_cache_torch_dtype(self.kv_cache_dtype)  # None: the model's dtype
        check_kv_cache_device(kv_dtype, param.device)
        specs = kv_cache_spec(model, kv_dtype)
        max_model_len = min(self.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        block_bytes = PagedKVCache.block_bytes(specs, self.block_size)
        # a draft model's pool has as many blocks (the same ids): size the pair together
        pool_specs = specs + (kv_cache_spec(draft_model) if draft_model is not None else [])
        if self.num_gpu_blocks is not None:
            num_blocks = self.num_gpu_blocks
        elif param.device.type == "cuda":
            num_blocks = PagedKVCache.blocks_for_memory(pool_specs, self.block_size, param.device,
                                                        self.gpu_memory_utilization)
        else:
            num_blocks = max(2, CPU_KV_CACHE_BYTES // PagedKVCache.block_bytes(pool_specs, self.block_size))
        num_cpu = self.num_cpu_blocks
        if num_cpu is None:  # CPU blocks only matter for swapping
            num_cpu = int(self.swap_space * 2**30) // block_bytes if self.preemption_mode == "swap" else 0
        return ResolvedSizes(max_model_len, num_blocks, num_cpu, block_bytes, tuple(specs), param.device,
                             self.num_offload_blocks(block_bytes))


@dataclass(frozen=True)
class ResolvedSizes:
    max_model_len: int  # tokens a sequence may reach: the config's, capped by the model's context
    num_gpu_blocks: int  # KV blocks in the GPU pool (block 0 reserved)
    num_cpu_blocks: int  # KV blocks in CPU memory, for preemption by swapping
    block_bytes: int  # one block of every layer
    kv_cache_spec: tuple[KVCacheSpec, ...]  # per layer, what the cache holds
    device: torch.device
    num_offload_blocks: int = 0  # CPU slots of the KV offload tier (engine/kv_offload.py)
