"""EngineStats: the engine's counters in one object, shared by the parts that count.

The block manager counts the pool's peak use, the scheduler its preemptions, the prefix cache its
lookups and hits, the engine its steps and tokens; all of them write here, so one `snapshot()` /
`restore()` pair (LLMEngine.warm_up) puts every counter back as it was, and a reader (the bench, a
notebook, chapter 12's /metrics) finds them in one place.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from ..distributed.kv_transfer.base import KVTransferStats
from ..spec_decode.metrics import SpecDecodeMetrics


@dataclass
class EngineStats:
    peak_used_blocks: int = 0  # most KV blocks in use at once
    num_preemptions: int = 0
    prefix_queries: int = 0  # admitted sequences that looked up the prefix cache
    prefix_query_tokens: int = 0  # full-block prompt tokens looked up
    prefix_hit_tokens: int = 0  # of those, found cached (not computed again)
    num_steps: int = 0  # engine steps that ran the model
    num_prompt_tokens: int = 0  # prompt tokens computed (a preempted prompt counts again)
    num_generation_tokens: int = 0  # tokens sampled
    num_failed_requests: int = 0  # requests ended by an error in their step (finish_reason "error")
    num_lora_slot_loads: int = 0  # LoRA adapters copied into a GPU slot (chapter 16: swap-ins)
    num_lora_disk_loads: int = 0  # LoRA adapters read from disk into the CPU pool
    # the KV offload tier (chapter 15, kv_offload.py): blocks evicted from the GPU pool copied to a CPU slot,
    # CPU slots copied back into a GPU block on a prefix hit, prompt tokens those hits skipped (GPU hits are
    # prefix_hit_tokens), CPU copies forgotten (the CPU pool's LRU), and the bytes each way (one worker's)
    offload_saved_blocks: int = 0
    offload_restored_blocks: int = 0
    offload_hit_tokens: int = 0
    offload_dropped_blocks: int = 0
    offload_bytes_to_cpu: int = 0
    offload_bytes_to_gpu: int = 0
    spec: SpecDecodeMetrics = field(default_factory=SpecDecodeMetrics)  # drafts and acceptance (chapter 09)
    kv: KVTransferStats = field(default_factory=KVTransferStats)  # KV moved by a connector (chapter 17)

    @property
    def prefix_hit_rate(self) -> float:
        """Share of the full-block tokens asked for that were found."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def snapshot(self) -> EngineStats:
        return copy.deepcopy(self)

    def restore(self, snap: EngineStats) -> None:
        for f in fields(self):
            setattr(self, f.name, copy.deepcopy(getattr(snap, f.name)))

    def as_dict(self) -> dict:
        counters = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("spec", "kv")}
        return {**counters, "prefix_hit_rate": self.prefix_hit_rate,
                **{f"spec_{k}": v for k, v in self.spec.as_dict().items()}, **self.kv.as_dict()}
