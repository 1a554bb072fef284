"""BlockManager: which KV-cache blocks belong to which sequence (chapter 05).

The pool of blocks is PagedKVCache's memory; this is its bookkeeping, all on the CPU:

  * a free list of block ids, and a reference count per block;
  * a block table per sequence: block_tables[seq_id][i] holds that sequence's tokens
    [i * block_size, (i + 1) * block_size);
  * sharing: `fork` gives a child sequence the parent's table and bumps every count (parallel
    sampling, n > 1, prefills the prompt once). A shared block is read-only: before a sequence writes
    into one (its last, partly filled block) it gets a private copy (copy-on-write), and the copy
    (src, dst) is queued in `pending_copies` for the model runner to do on the GPU;
  * with a prefix cache (chapter 06), full blocks are named by their tokens, a new sequence starts
    from the blocks it shares with earlier ones, and blocks nobody uses stay cached until evicted;
  * swapping (chapter 07): a preempted sequence's blocks move to a CPU pool and back;
  * change tracking (chapter 13, track_changes=True): which tables changed since the last
    `take_table_changes()`, from which entry, and which were dropped, so the worker can keep its own
    copy of every table and receive only the differences each step (worker/block_table.py).

  * eviction (chapter 15, kv_eviction.py): before a step's slots are made, the entries its policy
    says no query reads again (sliding windows, StreamingLLM), or that got the least attention (H2O,
    `observe_attention`), give their blocks back and point at block 0 instead. A sequence holds at
    most policy.max_blocks(its length) blocks (`max_blocks_held`).
    Prefix caching with eviction: full blocks are named as they fill, as always; once a sequence has
    evicted entries it names no further block (a block's name is the chain of everything before it,
    which the sequence no longer holds), so prefix hits reach at most up to where its eviction began.
    A sequence admitted with hits takes only the hit blocks its policy keeps (the others point at block
    0 from the start). With the radix cache, named blocks are not given back before the sequence ends
    (a tree node may only be unused if its subtree is) and hits are taken whole, so the bound grows by
    the named blocks a sequence holds. A sequence with evicted entries is preempted by recompute, never swapped.

  * offloading (chapter 15, kv_offload.py): with a KVOffloadPool, a cached block the prefix cache
    evicts is queued to be copied to a CPU slot first, and `match_offloaded` / `restore_offloaded`
    bring the blocks after a prompt's GPU hits back into fresh GPU blocks, named in the cache at once.

Block 0 is reserved: padded rows of a CUDA-graph batch point at it, so it is never handed out, and
evicted table entries point at it (it is never written: it holds zeros).
"""

from __future__ import annotations

from collections import deque

from .kv_eviction import NULL_BLOCK, KVEvictionPolicy
from .kv_offload import KVOffloadPool
from .prefix_cache import PrefixCache, RadixPrefixCache
from .stats import EngineStats


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 prefix_cache: PrefixCache | None = None, stats: EngineStats | None = None,
                 track_changes: bool = False, eviction: KVEvictionPolicy | None = None,
                 offload: KVOffloadPool | None = None):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), not {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict[int, list[int]] = {}
        self.prefix_cache = prefix_cache
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, for the runner
        self.free_cpu_blocks: deque[int] = deque(range(num_cpu_blocks))
        self.cpu_tables: dict[int, list[int]] = {}  # swapped-out sequences' CPU blocks
        self.stats = stats or EngineStats()  # counts peak_used_blocks; shared with the prefix cache
        if prefix_cache is not None:
            prefix_cache.stats = self.stats
        self.track_changes = track_changes
        self._changed_from: dict[int, int] = {}  # seq_id -> first table entry changed since the last take
        self._dropped: set[int] = set()  # seq_ids whose table went away (freed, swapped out)
        self.eviction = eviction
        self._evicted_upto: dict[int, int] = {}  # seq_id -> entries [eviction.lo, this) point at NULL_BLOCK
        self._held: dict[int, list[int]] = {}  # seq_id -> named blocks evicted from its table, held (radix)
        self.offload = offload
        if offload is not None:
            if prefix_cache is None or eviction is not None:
                raise ValueError("a KV offload pool needs a prefix cache and no KV eviction policy")
            offload.stats = self.stats
            prefix_cache.on_evict = offload.offload

    # ---- change tracking (chapter 13) ------------------------------------------------------------

    def _changed(self, seq_id: int, index: int) -> None:
        if self.track_changes:
            self._changed_from[seq_id] = min(index, self._changed_from.get(seq_id, index))

    def _gone(self, seq_id: int) -> None:
        if self.track_changes:
            self._changed_from.pop(seq_id, None)
            self._dropped.add(seq_id)

    def take_table_changes(self) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
        """(dropped seq_ids, [(seq_id, start, table[start:])]) since the last call: a table that went
        away, and each table's entries from its first change on (its new length is start + len). A
        copy kept up to date with these, dropped ones first, equals block_tables."""
        changes = self.peek_table_changes()
        self._changed_from, self._dropped = {}, set()
        return changes

    def peek_table_changes(self) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
        """take_table_changes without forgetting them: applying the same changes twice leaves a copy as
        once (chapter 09's proposer reads the tables before the step that takes them)."""
        dropped = sorted(self._dropped - self._changed_from.keys())  # re-created ones: sent whole below
        updates = [(seq_id, start, self.block_tables[seq_id][start:])
                   for seq_id, start in self._changed_from.items() if seq_id in self.block_tables]
        return dropped, updates

    @property
    def peak_used(self) -> int:
        return self.stats.peak_used_blocks

    # ---- counting --------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: never used, or cached but unused (evictable)."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return len(self.free_blocks) + evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Table entries of a sequence of num_tokens tokens (evicted ones included)."""
        return cdiv(num_tokens, self.block_size)

    def max_blocks_held(self, num_tokens: int) -> int:
        """Pool blocks a sequence of up to num_tokens tokens holds at once: all of its table's, unless its
        eviction policy gives some back (check_request's "can it ever fit")."""
        eviction = getattr(self, "eviction", None)  # (core_process's _Pool borrows this method)
        if eviction is not None:
            return eviction.max_blocks(num_tokens)
        return cdiv(num_tokens, self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], extra_key: int = 0) -> list[int]:
        """Cached blocks a new sequence can start from. At least one token is left to compute, since
        the model must run on the last token to predict the next one. extra_key: the sequence's
        adapter (chapter 16; 0: none): only blocks computed under it match."""
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.match(token_ids, (len(token_ids) - 1) // self.block_size, extra_key)

    def count_prefix_hits(self, token_ids: list[int], num_hits: int) -> None:
        """Hit statistics, once per admitted sequence (not per admission attempt)."""
        if self.prefix_cache is not None:
            self.prefix_cache.count((len(token_ids) - 1) // self.block_size, num_hits)

    def match_offloaded(self, token_ids: list[int], num_hits: int, extra_key: int = 0) -> list[int]:
        """CPU slots of the full blocks right after a new sequence's num_hits GPU hits (the offload tier)."""
        if self.offload is None:
            return []
        return self.offload.match(token_ids, num_hits, (len(token_ids) - 1) // self.block_size, extra_key)

    def restore_offloaded(self, seq_id: int, token_ids: list[int], num_hits: int, slots: list[int],
                          extra_key: int = 0) -> None:
        """After allocate_slots counted them as new blocks: table entries num_hits.. take slots' K/V
        (copied before the step's forward pass) and are named in the prefix cache now, so a sequence
        admitted later in this step shares them instead of restoring them again."""
        if not slots:
            return
        table = self.block_tables[seq_id]
        self.offload.restore(slots, table[num_hits : num_hits + len(slots)])
        self.stats.offload_hit_tokens += len(slots) * self.block_size
        self.prefix_cache.insert(token_ids, table[: num_hits + len(slots)], extra_key)

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed: int, extra_key: int = 0) -> None:
        """Name the full blocks whose K/V are now computed (under adapter extra_key), so later
        sequences can find them."""
        if self.prefix_cache is not None:
            full = num_computed // self.block_size
            if seq_id in self._evicted_upto:  # its chain is broken from the policy's lo on
                full = min(full, self.eviction.lo)
            self.prefix_cache.insert(token_ids, self.block_tables[seq_id][:full], extra_key)

    # ---- allocation ------------------------------------------------------------------------------

    def allocate_slots(self, seq_id: int, num_tokens: int, num_new: int, computed_blocks: list[int] = ()) -> bool:
        """Make room for tokens [num_tokens - num_new, num_tokens) of a sequence; False (and nothing
        changed) if the pool cannot. computed_blocks: prefix-cache hits, for a sequence's first call."""
        table = self.block_tables.get(seq_id, [])
        hits_upto = 0  # prefix hits [lo, hits_upto) the policy does not keep
        if self.eviction is not None and table:  # dead entries go first (even if this call fails: they are dead)
            self._evict(seq_id, table, num_tokens - num_new)
        elif self.eviction is not None and computed_blocks and not isinstance(self.prefix_cache, RadixPrefixCache):
            lo, hi = self.eviction.evictable(num_tokens - num_new)
            hits_upto = min(hi, len(computed_blocks))
            computed_blocks = [NULL_BLOCK if lo <= i < hi else b for i, b in enumerate(computed_blocks)]
        if num_new == 1 and not computed_blocks:  # the common case, a decode: room in an unshared last block?
            i = (num_tokens - 1) // self.block_size
            if i < len(table) and self.ref_counts[table[i]] == 1:
                return True
        if computed_blocks and table:
            raise ValueError(f"sequence {seq_id} already has blocks; prefix hits only start a sequence")
        have = len(table) + len(computed_blocks)
        new = max(0, self.blocks_needed(num_tokens) - have)
        first, last = (num_tokens - num_new) // self.block_size, (num_tokens - 1) // self.block_size
        cow = [i for i in range(first, min(last + 1, len(table))) if self.ref_counts[table[i]] > 1]
        # evictable now, taken back (NULL_BLOCK: a hit the policy does not keep)
        revived = [b for b in computed_blocks if b != NULL_BLOCK and self.ref_counts[b] == 0]
        if new + len(cow) + len(revived) > self.num_free_blocks:
            return False
        for b in computed_blocks:
            if b != NULL_BLOCK:
                self._take(b)
        if hits_upto > self.eviction_lo:
            self._evicted_upto[seq_id] = hits_upto
        table = self.block_tables.setdefault(seq_id, [])
        if computed_blocks or cow or new:
            self._changed(seq_id, min(cow, default=len(table)))
        table.extend(computed_blocks)
        for i in cow:  # a shared block about to be written: this sequence gets its own copy
            dst = self._new_block()
            self.pending_copies.append((table[i], dst))
            self._drop(table[i])
            table[i] = dst
        table.extend(self._new_block() for _ in range(new))
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, self.num_used_blocks)
        return True

    @property
    def eviction_lo(self) -> int:
        return self.eviction.lo if self.eviction is not None else 0

    def _evict(self, seq_id: int, table: list[int], start: int) -> None:
        """The entries the policy names for the step at `start` give their blocks back (kv_eviction.py)."""
        victims = self.eviction.victims(seq_id, table, start, self._evicted_upto.get(seq_id))
        victims = [i for i in victims if table[i] != NULL_BLOCK]  # entries null already stay so
        if not victims:
            return
        keep_named = isinstance(self.prefix_cache, RadixPrefixCache)
        for i in victims:
            # A radix tree counts an unused node as evictable only if its subtree is unused too: a named
            # block stays held until the sequence lets go of its named children. A window masks its K/V
            # (the entry stays); a compacting policy must not see it (held aside, the entry nulled).
            if keep_named and table[i] in self.prefix_cache:
                if not self.eviction.compacts:
                    continue
                self._held.setdefault(seq_id, []).append(table[i])
            else:
                self._drop(table[i])
            table[i] = NULL_BLOCK
        self._evicted_upto[seq_id] = max(self._evicted_upto.get(seq_id, 0), victims[-1] + 1)
        self._changed(seq_id, victims[0])

    def observe_attention(self, block_mass: dict) -> None:
        """A step's attention mass per kept table entry, {seq_id: (entries, masses)}, for the policy (H2O)."""
        for seq_id, (entries, masses) in block_mass.items():
            if seq_id in self.block_tables:
                self.eviction.observe(seq_id, entries, masses)

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens tokens (chapter 09: slots reserved for draft
        tokens that were rejected; they were never named for the prefix cache)."""
        table = self.block_tables.get(seq_id)
        keep = self.blocks_needed(num_tokens)
        if table is not None and len(table) > keep:
            self._changed(seq_id, keep)
        while table is not None and len(table) > keep:
            self._drop(table.pop())

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (copy-on-write later)."""
        table = self.block_tables[parent_id]
        for b in table:
            if b != NULL_BLOCK:
                self.ref_counts[b] += 1
        self.block_tables[child_id] = list(table)
        if parent_id in self._evicted_upto:
            self._evicted_upto[child_id] = self._evicted_upto[parent_id]
        if parent_id in self._held:
            self._held[child_id] = list(self._held[parent_id])
            for b in self._held[child_id]:
                self.ref_counts[b] += 1
        if self.eviction is not None:
            self.eviction.fork(parent_id, child_id)
        self._changed(child_id, 0)

    def free(self, seq_id: int) -> None:
        self._gone(seq_id)
        self._evicted_upto.pop(seq_id, None)
        if self.eviction is not None:
            self.eviction.forget(seq_id)
        for b in reversed(self._held.pop(seq_id, [])):  # named descendants of the table's named head
            self._drop(b)
        for b in reversed(self.block_tables.pop(seq_id, [])):  # tail first: the prefix stays cached longest
            self._drop(b)
        for b in self.cpu_tables.pop(seq_id, []):
            self.free_cpu_blocks.append(b)

    def _new_block(self) -> int:
        if self.free_blocks:
            b = self.free_blocks.popleft()
        else:
            b = self.prefix_cache.evict() if self.prefix_cache else None
            if b is None:
                raise RuntimeError("no free KV block (the scheduler should have checked)")
        self.ref_counts[b] = 1
        return b

    def _take(self, b: int) -> None:
        if self.ref_counts[b] == 0:
            self.prefix_cache.acquire(b)
        self.ref_counts[b] += 1

    def _drop(self, b: int) -> None:
        if b == NULL_BLOCK:  # an evicted entry holds nothing
            return
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            if self.prefix_cache is not None and b in self.prefix_cache:
                self.prefix_cache.release(b)  # keep its K/V: a later prompt may share it
            else:
                self.free_blocks.append(b)

    # ---- swapping --------------------------------------------------------------------------------

    def can_swap_out(self, seq_id: int) -> bool:
        if seq_id in self._evicted_upto:  # null entries: recompute instead (kv_eviction.py)
            return False
        return len(self.block_tables.get(seq_id, [])) <= len(self.free_cpu_blocks)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move a sequence's blocks to the CPU pool; returns (gpu, cpu) pairs to copy."""
        table = self.block_tables.pop(seq_id)
        self._gone(seq_id)
        cpu = [self.free_cpu_blocks.popleft() for _ in table]
        self.cpu_tables[seq_id] = cpu
        pairs = list(zip(table, cpu))
        for b in reversed(table):
            self._drop(b)
        return pairs

    def can_swap_in(self, seq_id: int) -> bool:
        return len(self.cpu_tables[seq_id]) <= self.num_free_blocks

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring a swapped sequence back into fresh GPU blocks; returns (cpu, gpu) pairs to copy."""
        cpu = self.cpu_tables.pop(seq_id)
        table = [self._new_block() for _ in cpu]
        self.block_tables[seq_id] = table
        self._changed(seq_id, 0)
        self.free_cpu_blocks.extend(cpu)
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, self.num_used_blocks)
        return list(zip(cpu, table))
