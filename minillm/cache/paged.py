"""The paged KV cache: one pool of fixed-size blocks per layer, shared by every sequence (chapter 05).

Chapter 03 reserved a contiguous region of max_len tokens per sequence. Most sequences end far
shorter, so most of that memory is reserved and never written (the vLLM paper measured 60-80 % of
KV memory wasted that way in earlier systems). Paging cuts the cache into blocks of `block_size`
tokens, hands them out one at a time as a sequence grows, and finds them again through the
sequence's block table, exactly as an OS finds pages through a page table:

    k_caches[layer]: [num_blocks, block_size, num_kv_heads, head_dim]       (and v_caches; the heads
                                                                              and sizes per layer: its spec)
    token at position p of a sequence whose block table is bt  ->  row bt[p // block_size] * block_size
                                                                       + p % block_size  (its slot)

Waste is now at most block_size - 1 tokens per sequence (its last, partly filled block). Which block
belongs to whom is the BlockManager's business (minillm/engine/block_manager.py); this file owns
the memory: the GPU pool, an optional CPU pool for swapped-out sequences, and the block copies
that copy-on-write and swapping need.

Block 0 is never handed out: padded rows of a CUDA-graph batch point their block tables at it.
"""

from __future__ import annotations

import gc

import torch

from ..checks import check_float, check_int
from .kv_cache import CacheSizes, allocate
from .spec import KVCacheSpec, bytes_per_token


class PagedKVCache(CacheSizes):
    """GPU (and optional CPU) block pools for every attention layer of one model, shaped by its spec."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device | str,
                 num_cpu_blocks: int = 0):
        check_int("num_blocks", num_blocks, 2, prefix="PagedKVCache ")
        check_int("block_size", block_size, prefix="PagedKVCache ")
        check_int("num_cpu_blocks", num_cpu_blocks, 0, prefix="PagedKVCache ")
        if not specs:
            raise ValueError("PagedKVCache needs the spec of at least one layer")
        self.specs, self.num_blocks, self.block_size, self.num_cpu_blocks = list(specs), num_blocks, block_size, num_cpu_blocks
        self.device = torch.device(device)
        self.k_caches, self.v_caches = allocate(self.specs, (num_blocks, block_size), device)
        # pinned host memory: copies run at full PCIe speed
        cpu_specs = self.specs if num_cpu_blocks else []
        self.k_cpu, self.v_cpu = allocate(cpu_specs, (num_cpu_blocks, block_size), "cpu", self.device.type == "cuda")

    # ---- sizing ----------------------------------------------------------------------------------

    @staticmethod
    def block_bytes(specs: list[KVCacheSpec], block_size: int) -> int:
        """What one block holds in every layer: the spec's bytes per token x block_size."""
        return bytes_per_token(specs) * block_size

    @classmethod
    def blocks_for_memory(cls, specs: list[KVCacheSpec], block_size: int, device: torch.device,
                          gpu_memory_utilization: float) -> int:
        """How many blocks fit in the part of the GPU's memory we may use, after what is already taken
        (weights, activations of a warm-up pass): vLLM's gpu_memory_utilization."""
        check_float("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
        if device.type != "cuda":
            raise ValueError("sizing the KV cache from free memory needs a GPU; pass num_gpu_blocks on a CPU")
        # An engine dropped earlier in this process may still hold its pool: its CUDA-graph steps are
        # closures over the runner that owns them (a reference cycle), freed only by the collector
        gc.collect()
        torch.cuda.empty_cache()  # blocks cached by the allocator but unused are free for the pool
        free, total = torch.cuda.mem_get_info(device)
        # this process: weights and whatever else it holds. Activations and CUDA graphs come later, out
        # of the (1 - gpu_memory_utilization) share left over (no profiling pass yet, unlike vLLM)
        mine = torch.cuda.memory_reserved(device)
        # Our share of the whole GPU, less what we already hold; never more than is actually free
        # (other processes may share the GPU: parallel test workers, a notebook).
        budget = min(int(total * gpu_memory_utilization) - mine, int(free * 0.95))
        n = budget // cls.block_bytes(specs, block_size)
        if n < 2:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for the KV cache "
                             f"({mine / 2**30:.1f} GiB held by this process, {free / 2**30:.1f} of "
                             f"{total / 2**30:.1f} GiB free)")
        return int(n)

    # ---- block copies: copy-on-write and swapping --------------------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """GPU block src -> GPU block dst in every layer (copy-on-write of a shared, partly filled block)."""
        if not pairs:
            return
        src, dst = self._index(pairs, self.device)
        for c in self._tensors(self.k_caches, self.v_caches):
            c.index_copy_(0, dst, c.index_select(0, src))  # [n, block_size, Hkv, D] per layer

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """GPU block -> CPU block, for a sequence preempted by swapping."""
        self._swap(pairs, self._tensors(self.k_caches, self.v_caches), self._tensors(self.k_cpu, self.v_cpu))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """CPU block -> GPU block, when a swapped sequence comes back."""
        self._swap(pairs, self._tensors(self.k_cpu, self.v_cpu), self._tensors(self.k_caches, self.v_caches))

    def _swap(self, pairs, sources, targets) -> None:
        if not pairs:
            return
        if not self.num_cpu_blocks:
            raise RuntimeError("this cache has no CPU blocks to swap with (num_cpu_blocks=0)")
        for s, t in zip(sources, targets):
            src, dst = self._index(pairs, s.device)
            rows = s.index_select(0, src)  # [n, block_size, Hkv, D] on the source device
            # A blocking copy: the CPU-side index_copy_ must not read rows still in flight from the GPU.
            t.index_copy_(0, dst.to(t.device), rows.to(t.device))

    @staticmethod
    def _tensors(ks: list, vs: list) -> list[torch.Tensor]:
        # an fp8 cache is moved as its bytes: PyTorch's CPU index_copy_ has no fp8 kernel
        return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in ks + vs if t is not None]

    @staticmethod
    def _index(pairs, device) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(pairs, dtype=torch.int64).T  # [2, n]
        return idx[0].to(device), idx[1].to(device)
