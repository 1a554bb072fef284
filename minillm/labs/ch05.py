"""Checks for lab 05: the slot mapping of a paged cache, and a block allocator with reference counts
and copy-on-write.

The allocator check drives the student's class and minillm's BlockManager with the same random
operations and compares what can be observed after every one. Block ids are the allocator's own
choice (a free list may hand them out in any order), so the comparison renames blocks by first
appearance: two allocators agree when their tables have the same lengths, share blocks in the same
places, free the same number of blocks and issue the same copies.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

from ..engine.block_manager import BlockManager, cdiv
from ..engine.step_input import prepare_model_input
from .checker import CheckFailed, Verdict, _short, check
from .hints import Hints

SKIP = object()  # the reference could not do this operation (no room): it is not asked of the student


def replay(name: str, make_student: Callable, make_reference: Callable,
           make_ops: Callable[[random.Random], tuple[tuple, list]], *, cases: int, seed: int | None = None) -> Verdict:
    """Apply the same random operations to a student object and a reference, both wrapped as drivers
    whose methods return comparable observations; raise at the first observation that differs.
    make_ops(rng) -> (args of both constructors, [(method, *args), ...])."""
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    rng = random.Random(seed)
    for case in range(cases):
        init, ops = make_ops(rng)
        student, reference = make_student(*init), make_reference(*init)
        done = [f"new{init}"]
        for op, *args in ops:
            want = getattr(reference, op)(*args)
            if want is SKIP:
                continue
            done.append(f"{op}{tuple(args)}" if len(args) != 1 else f"{op}({args[0]!r})")
            try:
                got = getattr(student, op)(*args)
            except NotImplementedError:
                raise
            except Exception as e:  # a crash in the student's code is a disagreement too, with its story
                raise CheckFailed(f"❌ {name}: case {case + 1} of {cases} (seed {seed}): {done[-1]} raised "
                                  f"{type(e).__name__}: {e}\n   operations so far: {_short(done, 600)}") from e
            if got != want:
                raise CheckFailed(
                    f"❌ {name}: case {case + 1} of {cases} (seed {seed}) disagrees with minillm after "
                    f"{len(done)} operations\n   operations: {_short(done, 600)}\n"
                    f"   expected: {_short(want)}\n   got:      {_short(got)}"
                )
    print(f"✅ {name}: {cases} random workloads agree with minillm")
    return Verdict(name, "passed", cases)


# ---- exercise 1: slot mapping --------------------------------------------------------------------


def check_slot_mapping(fn, cases: int = 200):
    """fn(block_table, block_size, start, end) -> the flat cache slot (block * block_size + offset)
    of every position in [start, end) of a sequence whose blocks are block_table."""

    def case(rng: random.Random):
        bs = rng.choice([1, 2, 4, 16])
        end = rng.randint(1, 12 * bs)
        start = rng.randint(0, end - 1)
        table = rng.sample(range(1, 64), cdiv(end, bs))  # any blocks, in any order
        return table, bs, start, end

    def reference(table, bs, start, end):
        # the engine's own step packing, for one sequence that has start tokens cached and brings end - start
        seq = SimpleNamespace(seq_id=0, num_computed_tokens=start, prompt_ids=[0] * end, output_ids=[], num_tokens=end,
                              spec_token_ids=[], num_pending=0)
        return prepare_model_input([(seq, end - start)], {0: table}, bs, [end - start - 1]).slot_mapping

    def as_list(table, bs, start, end):
        try:
            out = fn(list(table), bs, start, end)
        except (IndexError, KeyError, TypeError, ValueError) as e:  # shown as the answer, with its input
            return f"raised {type(e).__name__}: {e}"
        return [int(s) for s in out] if hasattr(out, "__iter__") and not isinstance(out, str) else out

    return check("slot_mapping", as_list, reference, case, cases=cases)


# ---- exercise 2: a block allocator ---------------------------------------------------------------


def _canonical(tables: dict) -> tuple[dict, dict]:
    """Rename blocks 0, 1, 2, ... in order of first appearance (sequences by id, blocks in table order)."""
    names: dict[int, int] = {}
    out = {}
    for seq in sorted(tables):
        if tables[seq]:
            out[seq] = [names.setdefault(b, len(names)) for b in tables[seq]]
    return out, names


class _Driver:
    """Runs the lab's operations on an allocator and reports what it observes after each."""

    def __init__(self, alloc, block_tables: Callable[[], dict], num_free: Callable[[], int]):
        self.alloc, self._tables, self._free = alloc, block_tables, num_free

    def state(self):
        tables, _ = _canonical(self._tables())
        return {"free blocks": self._free(), "tables": tables}

    def allocate(self, seq, n):
        return {"returned": self._allocate(seq, n), **self.state()}

    def fork(self, parent, child):
        self._fork(parent, child)
        return self.state()

    def append(self, seq):
        _, before = _canonical(self._tables())
        copy = self._append(seq)
        if copy is SKIP:
            return SKIP
        _, after = _canonical(self._tables())
        if copy is not None:  # (src, dst), renamed: src as the tables were, dst as they are now
            try:
                copy = (before.get(copy[0], "not in any table"), after.get(copy[1], "not in any table"))
            except (TypeError, IndexError):
                pass  # not a pair: compared as it is
        return {"copy": copy, **self.state()}

    def free(self, seq):
        self._free_seq(seq)
        return self.state()


class _ReferenceDriver(_Driver):
    def __init__(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks + 1, block_size)  # + block 0, which minillm reserves
        self.lens: dict[int, int] = {}
        super().__init__(self.bm, lambda: self.bm.block_tables, lambda: self.bm.num_free_blocks)

    def _allocate(self, seq, n):
        ok = self.bm.allocate_slots(seq, n, n)
        if ok:
            self.lens[seq] = n
        return ok

    def _fork(self, parent, child):
        self.bm.fork(parent, child)
        self.lens[child] = self.lens[parent]

    def _append(self, seq):
        n = self.lens[seq] + 1
        if not self.bm.allocate_slots(seq, n, 1):
            return SKIP  # no room for the copy or the new block: not asked of the student
        self.lens[seq] = n
        copies, self.bm.pending_copies = self.bm.pending_copies, []
        return copies[0] if copies else None

    def _free_seq(self, seq):
        self.bm.free(seq)
        del self.lens[seq]


class _StudentDriver(_Driver):
    def __init__(self, cls, num_blocks, block_size):
        alloc = cls(num_blocks, block_size)
        super().__init__(alloc, lambda: alloc.block_tables, lambda: alloc.num_free_blocks)
        self._allocate, self._fork, self._free_seq = alloc.allocate, alloc.fork, alloc.free
        self._append = lambda seq: _pair(alloc.append(seq))


def _pair(copy):
    return tuple(copy) if isinstance(copy, list) else copy


def _allocator_ops(rng: random.Random, num_blocks: int, block_size: int) -> list:
    """Random operations that are legal on the sequences alive at that point (by the reference's
    bookkeeping); an allocation may fail for lack of blocks, and the student must say so too."""
    ops, alive, next_id = [], [], 0
    ref = _ReferenceDriver(num_blocks, block_size)
    for _ in range(rng.randint(5, 40)):
        kind = rng.choices(["allocate", "fork", "append", "free"], [3, 2, 6, 2] if alive else [1, 0, 0, 0])[0]
        if kind == "allocate":
            op = ("allocate", next_id, rng.randint(1, 3 * block_size))
            next_id += 1
        elif kind == "fork":
            op = ("fork", rng.choice(alive), next_id)
            next_id += 1
        else:
            op = (kind, rng.choice(alive))
        getattr(ref, op[0])(*op[1:])
        alive = sorted(ref.lens)
        ops.append(op)
    return ops


def check_block_allocator(cls, cases: int = 100):
    """cls(num_blocks, block_size): an allocator of blocks 0..num_blocks-1 with
        allocate(seq, n_tokens) -> bool     blocks for a new sequence's first n_tokens (False: no room, nothing changed)
        fork(parent, child)                 the child shares all the parent's blocks
        append(seq) -> (src, dst) | None    room for one more token; copy-on-write if it lands in a shared block
        free(seq)                           the sequence is gone
        block_tables: {seq: [block ids]}, num_free_blocks: int"""
    if not callable(cls):
        raise TypeError(f"block_allocator: pass your class itself, not {type(cls).__name__}")

    def make_ops(rng):
        num_blocks, block_size = rng.randint(2, 12), rng.choice([1, 2, 4])
        return (num_blocks, block_size), _allocator_ops(rng, num_blocks, block_size)

    return replay("block_allocator", lambda n, bs: _StudentDriver(cls, n, bs), _ReferenceDriver, make_ops, cases=cases)


hint = Hints("05", {
    "slot_mapping": (
        'Position p of a sequence lives in its (p // block_size)-th block, at offset p % block_size.',
        "The block table maps the sequence's block index to a physical block; the flat slot is physical_block * block_size + offset.",
        'return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]',
    ),
    "BlockAllocator": (
        'Each block has a reference count: forks share blocks, and a block goes back to the free list at count 0.',
        "allocate: ceil(n / block_size) new blocks or refuse. fork: the child gets a copy of the parent's table and every block's count goes up. append: a token at n % block_size == 0 opens a new block; otherwise a shared last block (count > 1) is copied first (copy-on-write: return (src, dst)). free: drop each block.",
        'append: table, n = ...; num_tokens += 1\nif n % bs == 0: table.append(new()); return None\nif ref_counts[table[-1]] == 1: return None\ndst = new(); drop(table[-1]); src, table[-1] = table[-1], dst; return src, dst',
    ),
})
