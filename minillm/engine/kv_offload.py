"""The KV offload tier: prefix-cache blocks evicted from the GPU live on in CPU memory (chapter 15).

The prefix cache (prefix_cache.py) keeps blocks nobody uses until the pool runs dry, then forgets the
least recently used: the next prompt that starts with them computes them again. A GPU pool holds
minutes of traffic at most, but a server's CPU has ten times the memory and a PCIe link that moves a
block in microseconds, so SGLang's HiCache, LMCache and vLLM's KV offloading give the cache a second
tier. This file is its bookkeeping, on the engine's side (the copies are cache/offload.py's):

    evicted:   the GPU block's K/V (every layer, K and V) is queued to be copied into a CPU slot,
               named by the block's chain key (prefix_cache.chain_keys), the same name on both tiers;
               a key already on the CPU is only touched (a block restored earlier and evicted again
               costs no second copy: a full block's K/V never change)
    CPU full:  the least recently used slot is reused (its key forgotten), so the CPU tier is a
               second LRU behind the GPU's: recently used prefixes survive longest on both
    admitted:  after the GPU hits, the prompt's next blocks are looked up here; each hit gets a fresh
               GPU block and a copy back, the scheduler counts those tokens as computed, and the
               prefill runs on the rest only

A step's copies travel with its other block moves (SchedulerOutput.offload_save / offload_load, in
Executor.swap_and_copy), all of them together, before the forward pass. Order inside a step, which
cache/offload.py and the fake executor keep:

    1. read every saved GPU block (before this step writes any block: an evicted block is handed out
       again at once, maybe as a restore target);
    2. write them into their CPU slots;
    3. read the restored slots and write their GPU blocks (after 2: a block evicted and looked up again
       in the same scheduling pass is restored from the slot step 2 just wrote).

A slot looked up for a restore is pinned until the step's copies are taken, so an eviction later in the
same pass never reuses it (step 2 would overwrite it before step 3 reads it).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from .prefix_cache import chain_keys
from .stats import EngineStats


class KVOffloadPool:
    """num_slots CPU blocks, least recently used reused first; the engine-side half of the tier."""

    def __init__(self, num_slots: int, block_size: int, stats: EngineStats | None = None):
        if num_slots < 1:
            raise ValueError(f"KVOffloadPool num_slots must be >= 1, not {num_slots}")
        self.num_slots, self.block_size = num_slots, block_size
        self.stats = stats or EngineStats()
        self.free_slots: deque[int] = deque(range(num_slots))
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # chain key -> slot, least recently used first
        self._pinned: set[int] = set()  # slots a restore of this step reads (never reused before it)
        self._saves: list[tuple[int, int]] = []  # (GPU block, CPU slot) of this step
        self._loads: list[tuple[int, int]] = []  # (CPU slot, GPU block) of this step

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def keys(self) -> list[bytes]:
        """The keys held, least recently used first (the order they would be dropped in)."""
        return list(self._slot_of)

    def offload(self, block: int, key: bytes) -> None:
        """The prefix cache is evicting GPU `block` named `key` (PrefixCache.on_evict): keep a copy."""
        if key in self._slot_of:  # already here (restored from here earlier): same K/V, no copy
            self._slot_of.move_to_end(key)
            return
        slot = self._free_slot()
        if slot is None:  # every slot is read by this step's restores: this block is dropped
            self.stats.offload_dropped_blocks += 1
            return
        self._slot_of[key] = slot
        self._saves.append((block, slot))
        self.stats.offload_saved_blocks += 1

    def _free_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.popleft()
        for key, slot in self._slot_of.items():  # least recently used first
            if slot not in self._pinned:
                del self._slot_of[key]
                self.stats.offload_dropped_blocks += 1
                return slot
        return None

    def match(self, token_ids: list[int], start: int, max_blocks: int, extra_key: int = 0) -> list[int]:
        """Slots holding full blocks start, start + 1, ... of token_ids (up to max_blocks in all),
        as far as they go in a row. They count as used now, and are pinned for this step."""
        if not self._slot_of or start >= max_blocks:
            return []
        found = []
        for i, key in enumerate(chain_keys(token_ids, self.block_size, max_blocks, extra_key)):
            if i < start:
                continue
            slot = self._slot_of.get(key)
            if slot is None:
                break
            self._slot_of.move_to_end(key)
            self._pinned.add(slot)
            found.append(slot)
        return found

    def restore(self, slots: list[int], blocks: list[int]) -> None:
        """Copy slots[i] into GPU blocks[i] this step (the slots stay: the GPU copy may be evicted again)."""
        self._loads += zip(slots, blocks)
        self.stats.offload_restored_blocks += len(slots)

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (saves, loads), and a new step begins. A slot saved twice (a tiny pool) keeps only
        its last save: the bookkeeping already names the last block's key."""
        saves, seen = [], set()
        for block, slot in reversed(self._saves):
            if slot not in seen:
                seen.add(slot)
                saves.append((block, slot))
        saves.reverse()
        loads = self._loads
        self._saves, self._loads, self._pinned = [], [], set()
        return saves, loads
