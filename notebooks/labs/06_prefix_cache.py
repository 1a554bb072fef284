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
# # Lab 06 · Prefix caching
#
# A token's keys and values depend only on the tokens before it. So when two requests begin alike — a
# system prompt, the earlier turns of a chat — the K/V of their common full blocks are the same, and
# the second request can borrow the first one's blocks instead of computing them. A full block is
# therefore *named by everything up to its end*. Write both ways minillm finds those names, and check
# them against `HashPrefixCache` and `RadixPrefixCache` (`minillm/engine/prefix_cache.py`) under
# random workloads of requests that share prefixes.

# %%
import itertools

from minillm.labs import ch06


# %% [markdown]
# Stuck? Each exercise has three hints, from a nudge to a near-solution: run
# `ch06.hint("block_keys", 1)`, then 2, then 3. This lists the exercises:

# %%
ch06.hint()

# %% [markdown]
# ## Exercise 1 — chained block keys (vLLM)
#
# Return one key per **full** block of `token_ids` (a partial last block has none yet): key $i$ must
# be equal for two sequences exactly when their tokens agree from the start to the end of block $i$.
# Hashing the whole prefix each time works but costs $O(n^2)$; chain instead:
# $\text{key}_i = \text{hash}((\text{key}_{i-1}, \text{tokens of block } i))$, starting from `None`.
# Then one dictionary lookup per block finds the longest cached prefix.

# %%
def block_keys(token_ids, block_size):
    ### BEGIN SOLUTION
    keys, key = [], None
    for i in range(len(token_ids) // block_size):
        key = hash((key, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        keys.append(key)
    return keys
    ### END SOLUTION


# %% tags=["check"]
ch06.check_block_keys(block_keys)

# %% [markdown]
# ## Exercise 2 — a radix tree with LRU eviction (SGLang)
#
# A tree whose edges are blocks: a node holds one block's token tuple and the id of the KV block that
# holds it; the path from the root spells a prefix. The block manager keeps a reference count per
# block and tells the tree when a cached block loses its last user (`release`) or gets one back
# (`acquire`). Unused blocks stay cached until the pool runs dry; then `evict` gives back the **least
# recently used unused leaf** — never a block someone uses, never an inner node (its children are
# named through it).
#
# * `match(tokens)`: walk down the full blocks of `tokens`; return the blocks of the longest cached
#   prefix. Every node it returns was just used.
# * `insert(tokens, blocks)`: `blocks[i]` holds full block $i$ of `tokens`. Walk down, creating missing
#   nodes. If a node for these tokens already exists with a *different* block (another request
#   computed the same tokens first), stop there: the first writer keeps the name. Every node walked or
#   created was just used.
# * `release(block)`: the block is unused now (and was just used); `acquire(block)`: it is used again.
# * `evict()`: remove the least recently used leaf among the unused blocks and return its block, or
#   `None` if there is none.
#
# "Just used" is a logical clock: take the next tick of `self.clock` once per call (one tick for a
# whole `match` or `insert`) and store it in the nodes.

# %%
class Node:
    def __init__(self, tokens, block, parent):
        self.tokens, self.block, self.parent = tokens, block, parent
        self.children = {}  # token tuple -> Node
        self.last_used = 0


class RadixCache:
    def __init__(self, block_size):
        self.block_size = block_size
        self.root = Node((), None, None)
        self.node_of = {}  # block -> its node
        self.unused = set()  # cached blocks that no sequence uses
        self.clock = itertools.count(1)

    def _blocks(self, tokens, n):
        """The token tuples of the first n full blocks."""
        bs = self.block_size
        return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(n)]

    def match(self, tokens):
        ### BEGIN SOLUTION
        node, found, now = self.root, [], next(self.clock)
        for t in self._blocks(tokens, len(tokens) // self.block_size):
            node = node.children.get(t)
            if node is None:
                break
            node.last_used = now
            found.append(node.block)
        return found
        ### END SOLUTION

    def insert(self, tokens, blocks):
        ### BEGIN SOLUTION
        node, now = self.root, next(self.clock)
        for t, b in zip(self._blocks(tokens, len(blocks)), blocks):
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = Node(t, b, node)
                self.node_of[b] = child
            elif child.block != b:  # named by another block first: keep that one
                return
            child.last_used = now
            node = child
        ### END SOLUTION

    def release(self, block):
        ### BEGIN SOLUTION
        self.unused.add(block)
        self.node_of[block].last_used = next(self.clock)
        ### END SOLUTION

    def acquire(self, block):
        ### BEGIN SOLUTION
        self.unused.discard(block)
        ### END SOLUTION

    def evict(self):
        ### BEGIN SOLUTION
        leaves = [b for b in self.unused if not self.node_of[b].children]
        if not leaves:
            return None
        b = min(leaves, key=lambda b: self.node_of[b].last_used)
        node = self.node_of.pop(b)
        del node.parent.children[node.tokens]
        self.unused.discard(b)
        return b
        ### END SOLUTION


# %% tags=["check"]
ch06.check_radix_cache(RadixCache)

# %% [markdown]
# ## What you built
#
# Exercise 1 is the heart of `HashPrefixCache`: a dictionary from chained key to block, plus an
# ordered dictionary of unused blocks for LRU eviction. Exercise 2 is `RadixPrefixCache`. In the engine
# the `BlockManager` asks the cache for a new request's hits (leaving at least one token to compute: the
# model must run on the last token to predict the next), takes them with `acquire`, names the full
# blocks a step computed with `insert`, and on `free` hands blocks whose count reaches 0 to `release`
# instead of the free list. Both structures find the same hits; the tree also knows the shape of what
# is cached, which is what lets SGLang schedule requests that share a prefix together.
