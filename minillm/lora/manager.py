"""LoRAManager: which adapters are on the CPU, which sit in the GPU slots, and what a step loads
(chapter 16; S-LoRA's unified memory in miniature, vLLM's LRUCacheLoRAModelManager).

Two pools, both least-recently-used:

    CPU   up to max_cpu_loras adapters read from disk and checked (adapter.py); an adapter that an
          unfinished request uses is never evicted (the pool may hold more than max_cpu_loras then),
          so a step never reads the disk
    GPU   max_loras slots in every LoRA layer (layers.py). The scheduler never runs more than
          max_loras distinct adapters in one step; `prepare` gives each of the step's adapters a
          slot: the one it has, else a free one, else the slot of the least recently used adapter
          that this step does not need. The step message carries the loads (slot, adapter) and
          one slot per sequence; the worker copies the adapters in before the forward pass.

This object lives with the engine (it decides); the worker only copies tensors and reads the slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from .adapter import LoRAModel, load_adapter, lora_targets
from .request import LoRARequest


class LoRAManager:
    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 in_use: Callable[[], set[int]] = set, stats: Any = None):
        self.targets = lora_targets(model)
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.in_use = in_use  # -> the lora_int_ids unfinished requests use (the engine's view)
        self.requests: dict[int, LoRARequest] = {}  # every id seen: one id names one adapter
        self.cpu: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> GPU slot, LRU first
        # the engine's EngineStats (its counters reach /metrics), or counters of its own
        self.stats = stats or SimpleNamespace(num_lora_slot_loads=0, num_lora_disk_loads=0)

    @property
    def num_slot_loads(self) -> int:
        return self.stats.num_lora_slot_loads

    @property
    def num_disk_loads(self) -> int:
        return self.stats.num_lora_disk_loads

    def check(self, request: LoRARequest) -> LoRAModel:
        """The adapter of a new request, read and checked now (a bad folder fails the request here,
        before it is queued); one lora_int_id must keep naming the same folder."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) != (request.lora_path, request.lora_name):
            raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter {known.lora_name!r} at "
                             f"{known.lora_path!r}, not {request.lora_name!r} at {request.lora_path!r}: "
                             "give each adapter its own id")
        lora = self._get(request)
        self.requests[request.lora_int_id] = request
        return lora

    def _get(self, request: LoRARequest) -> LoRAModel:
        lora = self.cpu.get(request.lora_int_id)
        if lora is not None:
            self.cpu.move_to_end(request.lora_int_id)
            return lora
        lora = load_adapter(request, self.targets, self.max_lora_rank)
        self.stats.num_lora_disk_loads += 1
        self.cpu[request.lora_int_id] = lora
        if len(self.cpu) > self.max_cpu_loras:
            busy = self.in_use() | {request.lora_int_id}
            for old in [i for i in self.cpu if i not in busy][: len(self.cpu) - self.max_cpu_loras]:
                del self.cpu[old]
        return lora

    def prepare(self, lora_ids: list[int]) -> tuple[list[int], list[tuple[int, LoRAModel]]]:
        """One step's sequences' lora_int_ids (0: none) -> (their GPU slots, -1 for none; the
        (slot, adapter) loads the worker does first)."""
        needed = list(dict.fromkeys(i for i in lora_ids if i))
        if len(needed) > self.max_loras:  # the scheduler's limit: a bug if it fails
            raise RuntimeError(f"a step with {len(needed)} adapters, but max_loras={self.max_loras}")
        for i in needed:
            if i in self.slots:
                self.slots.move_to_end(i)  # used now: the last to be evicted
        loads = []
        for i in needed:
            if i in self.slots:
                continue
            taken = set(self.slots.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:  # the least recently used adapter this step does not need (the first in LRU order)
                victim = next(v for v in self.slots if v not in needed)
                slot = self.slots.pop(victim)
            self.slots[i] = slot
            loads.append((slot, self._get(self.requests[i])))
            self.stats.num_lora_slot_loads += 1
        slots = self.slots
        return [slots[i] if i else -1 for i in lora_ids], loads
