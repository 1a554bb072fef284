# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 05 · Paged KV blocks
#
# Chapter 03 gave every sequence one contiguous slot of `max_len` rows, most of it never written.
# A paged cache cuts the memory into small **blocks** of `block_size` tokens and gives each sequence
# a **block table**: the list of blocks that hold its tokens, in order, wherever they lie in the pool
# (vLLM's PagedAttention, Kwon et al., 2023). Write the two pieces of bookkeeping that make it work:
# where each token's K/V goes (the slot mapping), and who owns which block (an allocator with
# reference counts and copy-on-write). The checks compare your code with minillm's
# `prepare_model_input` (`minillm/engine/step_input.py`) and `BlockManager` (`minillm/engine/`) on fresh random inputs.

# %%
from collections import deque

from minillm.labs import ch05


# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch05.hint("slot_mapping", 1)`, then 2, then 3. This lists the exercises:

# %%
ch05.hint()

# %% [markdown]
# ## Exercise 1 — the slot mapping
#
# Token $p$ of a sequence lives in block `block_table[p // block_size]`, at offset
# `p % block_size` inside it. The pool of every layer is `[num_blocks, block_size, Hkv, D]`; viewed as
# `[num_blocks * block_size, Hkv, D]`, block $b$'s offset $o$ is flat row (*slot*)
# $b \cdot \text{block_size} + o$ — the row the attention layer writes the new K/V into.
#
# Return the slots of positions `start, start + 1, ..., end - 1` (the tokens a step computes for a
# sequence with `start` tokens cached), as a list of ints.

# %%
def slot_mapping(block_table, block_size, start, end):
    ### BEGIN SOLUTION
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    ### END SOLUTION


# %% tags=["check"]
ch05.check_slot_mapping(slot_mapping)

# %% [markdown]
# ## Exercise 2 — a block allocator with reference counts and copy-on-write
#
# Parallel sampling (`n > 1`) runs several completions of one prompt. Their prompt's K/V are the same,
# so a **fork** gives the child the parent's block table and bumps each block's reference count
# instead of copying anything. A shared block is read-only: when a sequence is about to write a token
# into a block another sequence also uses (the last, partly filled one), it first gets a private
# copy — **copy-on-write** — and the allocator reports the copy `(src, dst)` for the GPU to do.
# A block goes back on the free list when its count drops to 0.
#
# The class below holds the state; write its four operations:
#
# * `allocate(seq, n_tokens)`: a new sequence's first `n_tokens` need
#   $\lceil n / \text{block_size} \rceil$ fresh blocks. Return `False` (and change nothing) if the free
#   list is too short, else `True`.
# * `fork(parent, child)`: the child's table is a copy of the parent's list, each block counted once
#   more; the child has as many tokens as the parent.
# * `append(seq)`: room for one more token. If it starts a new block (the sequence's length is a
#   multiple of `block_size`), take a fresh block and return `None`. If it lands in the last block and
#   that block is shared, replace it with a fresh one and return `(src, dst)`. Otherwise `None`.
#   (The check only calls `append` when there is room.)
# * `free(seq)`: drop the sequence and one reference to each of its blocks.
#
# The check runs the same random operations on your class and on minillm's `BlockManager`, and after
# each compares what can be seen from outside: the number of free blocks, the length of every table,
# which tables share which blocks, and the copies. Block ids themselves may differ.

# %%
class BlockAllocator:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_blocks = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables = {}  # seq -> [block ids]
        self.num_tokens = {}  # seq -> tokens it has room for

    @property
    def num_free_blocks(self):
        return len(self.free_blocks)

    def _new_block(self):
        b = self.free_blocks.popleft()
        self.ref_counts[b] = 1
        return b

    def _drop(self, b):
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            self.free_blocks.append(b)

    def allocate(self, seq, n_tokens):
        ### BEGIN SOLUTION
        need = -(-n_tokens // self.block_size)  # ceil
        if need > len(self.free_blocks):
            return False
        self.block_tables[seq] = [self._new_block() for _ in range(need)]
        self.num_tokens[seq] = n_tokens
        return True
        ### END SOLUTION

    def fork(self, parent, child):
        ### BEGIN SOLUTION
        for b in self.block_tables[parent]:
            self.ref_counts[b] += 1
        self.block_tables[child] = list(self.block_tables[parent])  # a new list: the tables diverge later
        self.num_tokens[child] = self.num_tokens[parent]
        ### END SOLUTION

    def append(self, seq):
        ### BEGIN SOLUTION
        table, n = self.block_tables[seq], self.num_tokens[seq]
        self.num_tokens[seq] = n + 1
        if n % self.block_size == 0:  # token n opens a new block
            table.append(self._new_block())
            return None
        last = table[-1]
        if self.ref_counts[last] == 1:  # ours alone: write in place
            return None
        dst = self._new_block()
        self._drop(last)
        table[-1] = dst
        return last, dst
        ### END SOLUTION

    def free(self, seq):
        ### BEGIN SOLUTION
        for b in self.block_tables.pop(seq):
            self._drop(b)
        del self.num_tokens[seq]
        ### END SOLUTION


# %% tags=["check"]
ch05.check_block_allocator(BlockAllocator)

# %% [markdown]
# ## What you built
#
# The slot mapping is one line of `prepare_model_input`; the Triton kernel `store_kv` writes each new
# token's K/V to its slot, and the paged attention kernels read K/V through the same block table. The
# allocator is `BlockManager`: the same free list and reference counts, with `allocate_slots` growing a
# table by any number of tokens at once (a prefill chunk or one decode token) and queuing its copies in
# `pending_copies` for the model runner. With blocks, a sequence wastes at most `block_size - 1` rows,
# and `n` completions of one prompt store it once. Chapter 06 keeps blocks alive after their sequence
# ends, so the next request with the same prefix can borrow them.
