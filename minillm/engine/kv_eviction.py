"""KV eviction (chapter 15): which of a sequence's KV blocks no query will read again, block by block.

A sequence's block table maps its positions to blocks: entry i holds positions [i * bs, (i + 1) * bs).
An eviction policy names, for a step whose first new token is at position `start`, the table entries
[lo, hi) that no query at `start` or later reads. The BlockManager gives those blocks back to the pool
and puts NULL_BLOCK (block 0, reserved, never written, zeros) in their place, so the table keeps its
shape: a slot is still table[p // bs] * bs + p % bs, and a position is still the token's own.

  * SlidingWindow(W): every attention layer sees only the last W positions (Mistral; Qwen2/Gemma when
    every layer slides): the query at `start` reads keys >= start + 1 - W, so the blocks wholly before
    that go, [0, (start + 1 - W) // bs). Exact: the kernels' own window masks those positions, and
    they may still *load* a null entry (flash_attn's left-edge tile rounds down to a tile; the torch
    reference gathers every key and masks the scores): block 0 holds zeros, so a masked score times a
    zero value adds exactly 0. A model with any full-attention layer keeps every block (`make_kv_eviction`
    gives no policy: "auto" stays off, "sliding" is refused).
  * StreamingLLM(sink_tokens, kv_budget) (Xiao et al., 2023): keep the first cdiv(sink_tokens, bs)
    blocks (the attention sinks) and the R = kv_budget // bs - sink blocks ending with start's block;
    the ones between go, [sink, start // bs - R + 1). kv_positions="original": keys keep the positions
    they were rotated with; "cache": positions within the cache, as the paper (worker/kv_compaction.py
    SinkRotation: rotated copies of the sinks, in blocks the worker reserves, `reserved_blocks`). The kernels must not see the null
    entries here (no window masks them): the worker compacts each row of the table, dropping its null
    entries, and shortens seq_lens by bs per dropped entry (`compact_tables`); the kept keys stay in
    order and the new tokens last, so the causal mask (queries aligned to the end) is unchanged and each
    query attends to exactly sinks + recent blocks + the step's own earlier tokens.

  * H2O(kv_budget) (Zhang et al., 2023, "heavy hitters"): every step, each layer's attention also adds
    the probability each cached key got from the step's queries (summed over queries and heads) to that
    key's mass (kernels/attn_mass.py; the worker returns it per table entry, ModelRunnerOutput); the
    policy keeps, per sequence, the running sum per entry over layers and steps. Before a step, if the
    sequence holds more than kv_budget // bs blocks before the step's own, the lightest go, except the
    last half of the budget (the recent window H2O keeps beside its heavy hitters). Block-granular,
    with compaction as StreamingLLM: the pool, the table and the kernels are shared by every layer and
    head, so a block is the unit that can be given back and skipped; a token-granular H2O (the paper's,
    per head) would need per-layer, per-head tables and a kernel that gathers single slots, and would
    free memory only once a block's every slot had gone. Preemption recomputes with a fresh mass.
  * SnapKV(kv_budget, window) (Li et al., 2024): the step that ends a prompt (its last chunk) also
    measures the mass its last `window` queries give each key (the observation window; shorter if the
    chunk is); before the first decode step the prompt's lightest full blocks go, except the window's,
    until kv_budget // bs blocks remain with the step's. Once: generated tokens are all kept. Summing
    over heads and pooling over a block's tokens stand in for the paper's per-head, pooled choice.

Eviction happens between steps (BlockManager.allocate_slots, before a step's slots are made): a prefill
chunk attends to everything kept at its start and to itself, so a sequence holds at most
`max_blocks` blocks, which grows with the chunk (max_num_batched_tokens), not with its length.
"""

from __future__ import annotations

from ..worker.kv_compaction import NULL_BLOCK, compact_tables, reserved_sink_blocks

__all__ = [
    "H2O",
    "KINDS",
    "NULL_BLOCK",
    "KVEvictionPolicy",
    "SlidingWindow",
    "StreamingLLM",
    "compact_tables",
    "make_kv_eviction",
]
KINDS = ("auto", "none", "sliding", "streaming", "h2o", "snapkv")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVEvictionPolicy:
    """What the BlockManager asks of a policy."""

    name = ""
    compacts = False  # True: the kernels must see each table without its null entries (compact_tables)
    lo = 0  # the first entry the policy may ever evict; entries before it stay (and stay cacheable)

    def __init__(self, block_size: int, max_chunk: int):
        self.block_size, self.max_chunk = block_size, max_chunk

    def evictable(self, start: int) -> tuple[int, int]:
        """Table entries [lo, hi) that no query at position >= start reads (hi <= lo: none)."""
        raise NotImplementedError

    def max_blocks(self, num_tokens: int) -> int:
        """The most pool blocks a sequence of up to num_tokens tokens holds at once (steps of at most
        max_chunk new tokens)."""
        raise NotImplementedError

    def victims(self, seq_id: int, table: list[int], start: int, done: int | None) -> list[int]:
        """The table entries to evict before the step that starts at `start`. done: where the last
        eviction of this sequence ended (None: none yet). A range policy evicts [lo, hi) once."""
        lo, hi = self.evictable(start)
        return list(range(max(lo, lo if done is None else done), min(hi, len(table))))

    # what the block manager tells a policy that keeps per-sequence state (H2O)
    def fork(self, parent_id: int, child_id: int) -> None:
        pass

    def forget(self, seq_id: int) -> None:
        pass


class SlidingWindow(KVEvictionPolicy):
    name = "sliding"

    def __init__(self, window: int, block_size: int, max_chunk: int):
        super().__init__(block_size, max_chunk)
        self.window = window

    def evictable(self, start):
        return 0, max(0, start + 1 - self.window) // self.block_size

    def max_blocks(self, num_tokens):
        # a step of n tokens from c holds blocks (c + 1 - W) // bs .. (c + n - 1) // bs
        held = (self.window + self.max_chunk - 2) // self.block_size + 2
        return min(cdiv(num_tokens, self.block_size), held)


class StreamingLLM(KVEvictionPolicy):
    name, compacts = "streaming", True

    def __init__(self, sink_tokens: int, kv_budget: int, block_size: int, max_chunk: int):
        super().__init__(block_size, max_chunk)
        self.sink_blocks = cdiv(sink_tokens, block_size)
        self.recent_blocks = kv_budget // block_size - self.sink_blocks
        if self.recent_blocks < 1:
            raise ValueError(f"kv_budget={kv_budget} leaves no recent block beside {self.sink_blocks} sink block(s) "
                             f"of {block_size} tokens: it must be >= {(self.sink_blocks + 1) * block_size}")
        self.lo = self.sink_blocks

    def evictable(self, start):
        return self.sink_blocks, start // self.block_size - self.recent_blocks + 1

    def max_blocks(self, num_tokens):
        held = self.sink_blocks + self.recent_blocks + cdiv(self.max_chunk - 1, self.block_size)
        return min(cdiv(num_tokens, self.block_size), held)

    def kept(self, start: int, length: int) -> list[int]:
        """Positions < length a query of the step starting at `start` may read (the oracle's view;
        positions >= start, the step's own, are all kept)."""
        bs, (lo, hi) = self.block_size, self.evictable(start)
        return [p for p in range(length) if p >= start or not lo <= p // bs < hi]


class H2O(KVEvictionPolicy):
    name, compacts = "h2o", True

    def __init__(self, kv_budget: int, block_size: int, max_chunk: int):
        super().__init__(block_size, max_chunk)
        self.budget_blocks = kv_budget // block_size
        if self.budget_blocks < 2:
            raise ValueError(f"kv_budget={kv_budget} must hold at least 2 blocks of block_size={block_size} "
                             "(heavy hitters and a recent window)")
        self.recent_blocks = max(1, self.budget_blocks // 2)  # the current block among them
        self.mass: dict[int, dict[int, float]] = {}  # seq_id -> table entry -> attention mass so far

    def evictable(self, start):
        return 0, 0  # nothing by position alone (a prefix hit keeps every block)

    def max_blocks(self, num_tokens):
        # before a step: budget_blocks - 1 full blocks, then the step's first block and its chunk's others
        held = self.budget_blocks + cdiv(self.max_chunk - 1, self.block_size)
        return min(cdiv(num_tokens, self.block_size), held)

    def victims(self, seq_id, table, start, done):
        cur = start // self.block_size  # the step's first block (partly written, or new): kept
        held = [i for i in range(min(cur, len(table))) if table[i] != NULL_BLOCK]  # full blocks before it
        excess = len(held) + 1 - self.budget_blocks
        if excess <= 0:
            return []
        candidates = held[: len(held) - (self.recent_blocks - 1)]  # the recent window stays
        mass = self.mass.get(seq_id, {})
        return sorted(sorted(candidates, key=lambda i: mass.get(i, 0.0))[:excess])  # lightest; ties: oldest

    def observe(self, seq_id: int, entries: list[int], masses: list[float]) -> None:
        """One step's attention mass of a sequence's table entries (all layers), added to its sums."""
        acc = self.mass.setdefault(seq_id, {})
        for i, m in zip(entries, masses):
            acc[i] = acc.get(i, 0.0) + m

    def fork(self, parent_id, child_id):
        self.mass[child_id] = dict(self.mass.get(parent_id, {}))

    def forget(self, seq_id):
        self.mass.pop(seq_id, None)


class SnapKV(H2O):
    name = "snapkv"

    def __init__(self, kv_budget: int, window: int, block_size: int, max_chunk: int):
        super().__init__(kv_budget, block_size, max_chunk)
        self.window = window
        self.done: set[int] = set()  # sequences whose prompt was compressed

    def max_blocks(self, num_tokens):
        return cdiv(num_tokens, self.block_size)  # generated tokens are all kept

    def victims(self, seq_id, table, start, done):
        if seq_id in self.done or seq_id not in self.mass:  # once, after the prompt's window was observed
            return []
        self.done.add(seq_id)
        cur = start // self.block_size
        held = [i for i in range(min(cur, len(table))) if table[i] != NULL_BLOCK]
        first_seen = (start - min(self.window, start)) // self.block_size  # the window's first block
        candidates = [i for i in held if i < first_seen]
        excess = min(len(held) + 1 - self.budget_blocks, len(candidates))
        if excess <= 0:
            return []
        mass = self.mass[seq_id]
        return sorted(sorted(candidates, key=lambda i: mass.get(i, 0.0))[:excess])

    def fork(self, parent_id, child_id):
        super().fork(parent_id, child_id)
        if parent_id in self.done:
            self.done.add(child_id)

    def forget(self, seq_id):
        super().forget(seq_id)
        self.done.discard(seq_id)


def make_kv_eviction(config, model_config) -> KVEvictionPolicy | None:
    """The engine's policy for this model, or None (every block kept). config: an EngineConfig."""
    kind = config.kv_eviction
    windows = list(getattr(model_config, "sliding_windows", ()))  # (a fake model, executor/fake.py, has none)
    all_windowed = bool(windows) and None not in windows
    spec = config.speculative_config
    draft = spec is not None and spec.method == "draft_model"  # its layers attend to every key of the table
    bs, chunk = config.block_size, config.max_num_batched_tokens
    connector = getattr(config, "kv_transfer_config", None) is not None  # chapter 17 moves whole tables
    if kind == "none" or (kind == "auto" and (not all_windowed or draft or connector)):
        return None
    if connector:
        raise ValueError(f"kv_eviction={kind!r} cannot run with kv_transfer_config (a KV connector saves and loads "
                         "whole block tables): use 'none'")
    if draft:
        raise ValueError(f"kv_eviction={kind!r} cannot share its block tables with a draft model "
                         "(speculative_config method 'draft_model'): use 'none'")
    if kind in ("auto", "sliding"):
        if not all_windowed:
            raise ValueError(f"kv_eviction='sliding' needs a sliding window on every attention layer; this model's "
                             f"sliding_windows are {windows} (a full-attention layer reads every block)")
        return SlidingWindow(max(windows), bs, chunk)
    if any(w is not None for w in windows):  # compaction would shift a window's distances
        raise ValueError(f"kv_eviction={kind!r} needs full-attention layers; this model's sliding_windows are "
                         f"{windows} (use 'sliding')")
    if kind == "h2o":
        return H2O(config.kv_budget, bs, chunk)
    if kind == "snapkv":
        return SnapKV(config.kv_budget, config.snapkv_window, bs, chunk)
    return StreamingLLM(config.sink_tokens, config.kv_budget, bs, chunk)


def reserved_blocks(config) -> int:
    """The last pool blocks the worker keeps for itself, never handed out by the block manager: the
    rotated sink copies of kv_positions='cache' (worker/kv_compaction.py SinkRotation)."""
    if config.kv_eviction != "streaming" or config.kv_positions != "cache":
        return 0
    return reserved_sink_blocks(cdiv(config.sink_tokens, config.block_size), config.max_num_seqs)
