"""The engine labs' checks (chapters 05-07) bite at the function level: minillm's own code and the
labs' solutions pass; plausible wrong answers fail with CheckFailed. (test_lab_notebooks.py proves
it for the notebooks and their generated student versions.)"""

from __future__ import annotations

from pathlib import Path

import jupytext
import pytest

from minillm.engine.block_manager import BlockManager
from minillm.engine.prefix_cache import RadixPrefixCache
from minillm.labs import CheckFailed, ch05, ch06, ch07

LABS = Path(__file__).resolve().parent.parent / "notebooks" / "labs"


def solution(stem: str) -> dict:
    """The names a solution lab defines (its code cells, check cells left out)."""
    ns: dict = {}
    for cell in jupytext.read(LABS / f"{stem}.py").cells:
        if cell.cell_type == "code" and "check" not in cell.metadata.get("tags", []):
            exec(compile(cell.source, f"{stem}.py", "exec"), ns)
    return ns


def fails(check, fn, **kw):
    with pytest.raises(CheckFailed):
        check(fn, **kw)


# ---- 05: slot mapping ------------------------------------------------------------------------------


def test_ch05_slot_mapping():
    assert ch05.check_slot_mapping(solution("05_paged_kv")["slot_mapping"]).passed

    def slots(table, bs, start, end, *, shift=0, lookup=True, scale=True, relative=False):
        out = []
        for p in range(start + shift, end + shift):
            i = p - start if relative else p
            block = table[i // bs] if lookup else i // bs
            out.append(block * (bs if scale else 1) + i % bs)
        return out

    assert ch05.check_slot_mapping(slots).passed
    fails(ch05.check_slot_mapping, lambda *a: slots(*a, shift=1))  # off by one: the slot after the token's
    fails(ch05.check_slot_mapping, lambda *a: slots(*a, lookup=False))  # contiguous: no block table
    fails(ch05.check_slot_mapping, lambda *a: slots(*a, scale=False))  # block id used as a row
    fails(ch05.check_slot_mapping, lambda *a: slots(*a, relative=True))  # counts from start, not from 0


# ---- 05: block allocator ---------------------------------------------------------------------------


class BlockManagerAsAllocator:
    """minillm's BlockManager behind the lab's interface: the oracle must pass its own check."""

    def __init__(self, num_blocks, block_size):
        self.bm, self.lens = BlockManager(num_blocks + 1, block_size), {}

    @property
    def block_tables(self):
        return self.bm.block_tables

    @property
    def num_free_blocks(self):
        return self.bm.num_free_blocks

    def allocate(self, seq, n):
        ok = self.bm.allocate_slots(seq, n, n)
        if ok:
            self.lens[seq] = n
        return ok

    def fork(self, parent, child):
        self.bm.fork(parent, child)
        self.lens[child] = self.lens[parent]

    def append(self, seq):
        self.lens[seq] += 1
        assert self.bm.allocate_slots(seq, self.lens[seq], 1)
        copies, self.bm.pending_copies = self.bm.pending_copies, []
        return copies[0] if copies else None

    def free(self, seq):
        self.bm.free(seq)
        del self.lens[seq]


def test_ch05_block_allocator_passes_minillm_and_the_solution():
    assert ch05.check_block_allocator(BlockManagerAsAllocator).passed
    assert ch05.check_block_allocator(solution("05_paged_kv")["BlockAllocator"]).passed


def _allocator_mutants():
    Good = solution("05_paged_kv")["BlockAllocator"]

    class NoCopyOnWrite(Good):  # writes into the shared block
        def append(self, seq):
            n = self.num_tokens[seq]
            self.num_tokens[seq] = n + 1
            if n % self.block_size == 0:
                self.block_tables[seq].append(self._new_block())

    class CopiesUnsharedBlocks(Good):  # copy-on-write even when nobody else holds the block
        def append(self, seq):
            n = self.num_tokens[seq]
            if n % self.block_size == 0:
                return super().append(seq)
            self.num_tokens[seq] = n + 1
            table = self.block_tables[seq]
            src, dst = table[-1], self._new_block()
            self._drop(src)
            table[-1] = dst
            return src, dst

    class CopyLeaksSource(Good):  # the copy never lets go of the shared block
        def append(self, seq):
            copy = super().append(seq)
            if copy is not None:
                self.ref_counts[copy[0]] += 1
            return copy

    class ForkWithoutReferences(Good):
        def fork(self, parent, child):
            self.block_tables[child] = list(self.block_tables[parent])
            self.num_tokens[child] = self.num_tokens[parent]

    class ForkSharesTheList(Good):  # the child's table is the parent's list object
        def fork(self, parent, child):
            super().fork(parent, child)
            self.block_tables[child] = self.block_tables[parent]

    class FreeIgnoresReferences(Good):
        def free(self, seq):
            for b in self.block_tables.pop(seq):
                self.ref_counts[b] = 0
                if b not in self.free_blocks:
                    self.free_blocks.append(b)
            del self.num_tokens[seq]

    class OneBlockTooMany(Good):  # n // block_size + 1 instead of the ceiling
        def allocate(self, seq, n_tokens):
            need = n_tokens // self.block_size + 1
            if need > len(self.free_blocks):
                return False
            self.block_tables[seq] = [self._new_block() for _ in range(need)]
            self.num_tokens[seq] = n_tokens
            return True

    class PartialAllocation(Good):  # takes what there is, then says no
        def allocate(self, seq, n_tokens):
            need = -(-n_tokens // self.block_size)
            self.block_tables[seq] = [self._new_block() for _ in range(min(need, len(self.free_blocks)))]
            self.num_tokens[seq] = n_tokens
            return need <= len(self.block_tables[seq])

    return [NoCopyOnWrite, CopiesUnsharedBlocks, CopyLeaksSource, ForkWithoutReferences, ForkSharesTheList,
            FreeIgnoresReferences, OneBlockTooMany, PartialAllocation]


@pytest.mark.parametrize("mutant", _allocator_mutants(), ids=lambda c: c.__name__)
def test_ch05_block_allocator_catches(mutant):
    fails(ch05.check_block_allocator, mutant)


def test_ch05_allocator_check_renames_blocks():
    """Handing out blocks in another order (a stack instead of a queue) is not a mistake."""
    Good = solution("05_paged_kv")["BlockAllocator"]

    class Stack(Good):
        def _new_block(self):
            b = self.free_blocks.pop()
            self.ref_counts[b] = 1
            return b

    assert ch05.check_block_allocator(Stack).passed


# ---- 06: chained block keys ------------------------------------------------------------------------


def test_ch06_block_keys():
    assert ch06.check_block_keys(solution("06_prefix_cache")["block_keys"]).passed

    def whole_prefix(tokens, bs):  # right, just quadratic
        return [tuple(tokens[: (i + 1) * bs]) for i in range(len(tokens) // bs)]

    assert ch06.check_block_keys(whole_prefix).passed

    def unchained(tokens, bs):  # a block's own tokens only: equal blocks after different prefixes collide
        return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(len(tokens) // bs)]

    def with_partial(tokens, bs):  # a key for the partial last block too
        return [tuple(tokens[: (i + 1) * bs]) for i in range(-(-len(tokens) // bs))]

    def sum_chain(tokens, bs):  # a chain, but of an order-blind digest
        keys, key = [], 0
        for i in range(len(tokens) // bs):
            key += sum(tokens[i * bs : (i + 1) * bs])
            keys.append((i, key))
        return keys

    for wrong in (unchained, with_partial, sum_chain):
        fails(ch06.check_block_keys, wrong)


# ---- 06: radix tree --------------------------------------------------------------------------------


class RadixAsLab(RadixPrefixCache):
    def match(self, tokens):
        return super().match(tokens, len(tokens) // self.block_size)


def test_ch06_radix_cache_passes_minillm_and_the_solution():
    assert ch06.check_radix_cache(RadixAsLab).passed
    assert ch06.check_radix_cache(solution("06_prefix_cache")["RadixCache"]).passed


def _radix_mutants():
    Good = solution("06_prefix_cache")["RadixCache"]

    def evict_from(candidates, self, pick=min):
        if not candidates:
            return None
        b = pick(candidates, key=lambda b: self.node_of[b].last_used)
        node = self.node_of.pop(b)
        if node.parent is not None:
            node.parent.children.pop(node.tokens, None)
        self.unused.discard(b)
        return b

    class EvictsInnerNodes(Good):  # any unused block, leaf or not
        def evict(self):
            return evict_from(list(self.unused), self)

    class EvictsReferencedBlocks(Good):  # any leaf, used or not
        def evict(self):
            return evict_from([b for b, n in self.node_of.items() if not n.children], self)

    class MostRecentlyUsed(Good):
        def evict(self):
            return evict_from([b for b in self.unused if not self.node_of[b].children], self, pick=max)

    class MatchDoesNotTouch(Good):  # recency only from inserts and releases
        def match(self, tokens):
            saved = {b: n.last_used for b, n in self.node_of.items()}
            found = super().match(tokens)
            for b, t in saved.items():
                self.node_of[b].last_used = t
            return found

    class ReleaseDoesNotTouch(Good):
        def release(self, block):
            self.unused.add(block)

    class LastWriterWins(Good):  # a second block for the same tokens replaces the first
        def insert(self, tokens, blocks):
            node, now = self.root, next(self.clock)
            Node = type(self.root)
            for t, b in zip(self._blocks(tokens, len(blocks)), blocks):
                child = node.children.get(t)
                if child is None or child.block != b:
                    old = node.children.get(t)
                    child = node.children[t] = Node(t, b, node)
                    if old is not None:
                        child.children = old.children
                        self.node_of.pop(old.block, None)
                    self.node_of[b] = child
                child.last_used = now
                node = child

    return [EvictsInnerNodes, EvictsReferencedBlocks, MostRecentlyUsed, MatchDoesNotTouch, ReleaseDoesNotTouch,
            LastWriterWins]


@pytest.mark.parametrize("mutant", _radix_mutants(), ids=lambda c: c.__name__)
def test_ch06_radix_cache_catches(mutant):
    fails(ch06.check_radix_cache, mutant)


# ---- 07: one scheduler step ------------------------------------------------------------------------


def schedule(running, waiting, free_blocks, block_size, budget, max_num_seqs, *, use_budget=True,
             seq_limit=True, victim="lowest", fcfs_stop=True, admit_after_preempt=False,
             decode_first="within priority"):
    """The lab's answer with switches for the classic slips (the defaults are right)."""

    def blocks_for(n):
        return -(-n // block_size)

    def order(s):
        return s.priority, s.arrival

    def running_order(s):
        prefilling = s.num_tokens - s.num_computed > 1
        if decode_first == "within priority":
            return s.priority, prefilling, s.arrival
        return (prefilling, s.priority, s.arrival) if decode_first == "over priority" else order(s)

    queue = sorted(running, key=running_order)
    scheduled, preempted, num_running = [], [], 0
    while queue:
        seq = queue.pop(0)
        left = seq.num_tokens - seq.num_computed
        n = min(left, budget) if use_budget else left
        if n > 0:
            need = blocks_for(seq.num_computed + n) - seq.num_blocks
            while need > free_blocks:
                if victim == "self" or not queue:
                    v = seq
                else:
                    v = queue.pop() if victim == "lowest" else queue.pop(0)
                free_blocks += v.num_blocks
                preempted.append(v.seq_id)
                if v is seq:
                    break
            if seq.seq_id in preempted:
                continue
            free_blocks -= need
            scheduled.append((seq.seq_id, n))
            budget -= n
        num_running += 1
    if not preempted or admit_after_preempt:
        for seq in sorted(waiting, key=order):
            if (use_budget and budget <= 0) or (seq_limit and num_running >= max_num_seqs):
                break
            n = min(seq.num_tokens, budget) if use_budget else seq.num_tokens
            if blocks_for(n) > free_blocks:
                if fcfs_stop:
                    break
                continue
            free_blocks -= blocks_for(n)
            budget -= n
            num_running += 1
            scheduled.append((seq.seq_id, n))
    return scheduled, preempted


def test_ch07_schedule_passes_the_solution():
    assert ch07.check_schedule(solution("07_scheduler")["schedule"]).passed
    assert ch07.check_schedule(schedule).passed


@pytest.mark.parametrize("slip", [
    {"use_budget": False},  # ignores the token budget: no chunked prefill
    {"seq_limit": False},  # admits past max_num_seqs
    {"victim": "self"},  # preempts itself instead of the lowest-priority sequence
    {"victim": "highest"},  # preempts the highest-priority sequence not yet handled
    {"fcfs_stop": False},  # lets a smaller request overtake the head of the queue
    {"admit_after_preempt": True},  # admits in a step that had to preempt
    {"decode_first": "over priority"},  # decodes before prefills, whatever their priority
    {"decode_first": "no"},  # prompt chunks and decodes of one priority by arrival alone
], ids=lambda s: "-".join(f"{k}={v}".replace(" ", "_") for k, v in s.items()))
def test_ch07_schedule_catches(slip):
    fails(ch07.check_schedule, lambda *a: schedule(*a, **slip))


def test_ch07_check_builds_the_state_it_describes():
    """The scheduler sees the free blocks and budget the student is told about."""
    from minillm.labs.ch07 import SeqState, reference_schedule

    running = [SeqState(0, 0, 0, 9, 8, 2), SeqState(1, 1, 1, 5, 4, 1)]  # block_size 4: 0 needs a third block
    waiting = [SeqState(2, 0, 2, 3, 0, 0)]
    assert reference_schedule(running, waiting, 0, 4, 100, 8) == ([(0, 1)], [1])  # 1 preempted for 0
    assert reference_schedule(running, waiting, 2, 4, 100, 8) == ([(0, 1), (1, 1)], [])  # 2 does not fit
    assert reference_schedule(running, waiting, 3, 4, 100, 8) == ([(0, 1), (1, 1), (2, 3)], [])
    assert reference_schedule(running, waiting, 3, 4, 100, 2) == ([(0, 1), (1, 1)], [])  # max_num_seqs
    assert reference_schedule(running, waiting, 3, 4, 3, 8) == ([(0, 1), (1, 1), (2, 1)], [])  # a chunk of 1
