"""Checks for lab 06: chained block keys (vLLM's automatic prefix caching) and a radix tree of blocks
with LRU eviction of unused leaves (SGLang's RadixAttention).

Both checks play the block manager: random requests drawn from a few shared "system prompts" over a
tiny vocabulary (so blocks collide often) are matched against the cache, take blocks, are computed,
finish and release their blocks, and evict when the pool runs dry, on the student's structure and on
minillm's (HashPrefixCache, RadixPrefixCache) side by side. Block ids are chosen by the check, so
they are compared as they are.
"""

from __future__ import annotations

import random

from ..engine.block_manager import cdiv
from ..engine.prefix_cache import HashPrefixCache, RadixPrefixCache
from .ch05 import replay
from .hints import Hints


def _prompt(rng: random.Random, prefixes: list[list[int]], block_size: int) -> list[int]:
    head = list(rng.choice(prefixes))[: rng.randint(0, 4 * block_size)]
    return head + [rng.randrange(3) for _ in range(rng.randint(1, 3 * block_size))]


def _prefixes(rng: random.Random, block_size: int) -> list[list[int]]:
    return [[rng.randrange(3) for _ in range(4 * block_size)] for _ in range(rng.randint(1, 3))]


# ---- exercise 1: chained block keys --------------------------------------------------------------


class _KeyCache:
    """A hash prefix cache whose keys come from a block-key function: key -> block, first writer wins."""

    def __init__(self, block_keys, block_size):
        self.keys, self.block_size, self.block_of = block_keys, block_size, {}

    def _keys(self, tokens, n):
        keys = list(self.keys(list(tokens), self.block_size))
        full = len(tokens) // self.block_size
        if len(keys) != full:
            raise ValueError(f"block_keys gave {len(keys)} keys for {len(tokens)} tokens: {full} full blocks")
        return keys[:n]

    def match(self, tokens):
        found = []
        for key in self._keys(tokens, len(tokens) // self.block_size):
            if key not in self.block_of:
                break
            found.append(self.block_of[key])
        return found

    def insert(self, tokens, blocks):
        for key, block in zip(self._keys(tokens, len(blocks)), blocks):
            self.block_of.setdefault(key, block)


class _HashReference:
    def __init__(self, block_size):
        self.cache = HashPrefixCache(block_size)

    def match(self, tokens):
        return self.cache.match(tokens, len(tokens) // self.cache.block_size)

    def insert(self, tokens, blocks):
        self.cache.insert(tokens, blocks)


def check_block_keys(fn, cases: int = 100):
    """fn(token_ids, block_size) -> one hashable key per full block, such that two sequences' keys of
    block i are equal exactly when their tokens agree up to the end of block i. Checked by using the
    keys as a prefix cache's dictionary and comparing its matches with minillm's HashPrefixCache."""

    def make_ops(rng):
        bs = rng.choice([1, 2, 3])
        prefixes, ops, block = _prefixes(rng, bs), [], 1
        for _ in range(rng.randint(5, 30)):
            tokens = _prompt(rng, prefixes, bs)
            ops.append(("match", tokens))
            if rng.random() < 0.7:
                full = len(tokens) // bs
                ops.append(("insert", tokens, list(range(block, block + full))))
                block += full
        return (bs,), ops

    return replay("block_keys", lambda bs: _KeyCache(fn, bs), _HashReference, make_ops, cases=cases)


# ---- exercise 2: a radix tree with LRU eviction ----------------------------------------------------


class _RadixReference(RadixPrefixCache):
    """RadixPrefixCache with the lab's match(tokens): every full block of tokens may match."""

    def match(self, tokens):
        return super().match(tokens, len(tokens) // self.block_size)


def _radix_ops(rng: random.Random, bs: int, num_blocks: int) -> list:
    """A workload played on minillm's RadixPrefixCache; the ops (with the reference's answers deciding
    the next ones) are then replayed on both caches."""
    ref = _RadixReference(bs)
    free, refs, seqs, ops, next_seq = list(range(num_blocks)), [0] * num_blocks, {}, [], 0
    prefixes = _prefixes(rng, bs)

    def call(*op):
        ops.append(op)
        return getattr(ref, op[0])(*op[1:])

    for _ in range(rng.randint(10, 60)):
        r = rng.random()
        if r < 0.25:  # the scheduler looks up the head of its waiting queue, which does not fit yet
            call("match", _prompt(rng, prefixes, bs))
        elif r < 0.55 or not seqs:  # a request arrives: match, take its hits, fresh blocks for the rest
            tokens = _prompt(rng, prefixes, bs)
            hits = call("match", tokens)
            need = cdiv(len(tokens), bs) - len(hits)
            if need > len(free) + ref.num_evictable - sum(refs[b] == 0 for b in hits):
                continue  # no room: it waits (its match still counted as a use)
            for b in hits:
                if refs[b] == 0:
                    call("acquire", b)
                refs[b] += 1
            blocks = list(hits)
            for _ in range(need):
                b = free.pop(rng.randrange(len(free))) if free else call("evict")  # any free block
                refs[b] = 1
                blocks.append(b)
            seqs[next_seq] = (tokens, blocks, False)
            next_seq += 1
        elif r < 0.7:  # a request's prompt is computed: its full blocks are named
            seq = rng.choice(sorted(seqs))
            tokens, blocks, _ = seqs[seq]
            call("insert", tokens, blocks[: len(tokens) // bs])
            seqs[seq] = (tokens, blocks, True)
        elif r < 0.9:  # a request finishes: its blocks are released, tail first
            tokens, blocks, _ = seqs.pop(rng.choice(sorted(seqs)))
            for b in reversed(blocks):
                refs[b] -= 1
                if refs[b] == 0:
                    if b in ref:
                        call("release", b)
                    else:
                        free.append(b)
        else:  # memory pressure from elsewhere: give one cached block back
            b = call("evict")
            if b is not None:
                free.append(b)
    return ops


def check_radix_cache(cls, cases: int = 500):
    """cls(block_size): a radix tree of block-sized token tuples with
        match(tokens) -> [blocks]    the blocks of the longest cached prefix of tokens' full blocks
        insert(tokens, blocks)       blocks[i] holds full block i of tokens (where those tokens are
                                     named by another block already, that one stays and the insert stops)
        release(block) / acquire(block)   the block's last user let go / a user took it back
        evict() -> block | None      forget the least recently used unused leaf
    Recency: match touches the blocks it returns, insert the blocks it walks, release its block."""
    if not callable(cls):
        raise TypeError(f"radix_cache: pass your class itself, not {type(cls).__name__}")

    def make_ops(rng):
        bs = rng.choice([1, 2, 3])
        return (bs,), _radix_ops(rng, bs, rng.randint(3, 12))

    return replay("radix_cache", cls, _RadixReference, make_ops, cases=cases)


hint = Hints("06", {
    "block_keys": (
        'Two blocks with the same tokens but different prefixes must get different keys.',
        "Chain the hashes: block i's key hashes (key of block i - 1, the block's tokens as a tuple). Only full blocks get keys.",
        'key = None\nfor i in range(len(token_ids) // block_size):\n    key = hash((key, tuple(token_ids[i*block_size:(i+1)*block_size]))); keys.append(key)',
    ),
    "RadixCache": (
        'Each tree node is one block of tokens; a path from the root spells a prefix.',
        'match: walk children by block tuples, touching last_used, and collect the blocks. insert: create missing children (keep an existing node even if another block wants the same tokens). evict: among unused blocks choose a leaf (no children) with the oldest last_used, unlink it from its parent.',
        'leaves = [b for b in self.unused if not self.node_of[b].children]\nb = min(leaves, key=lambda b: self.node_of[b].last_used)\nnode = self.node_of.pop(b); del node.parent.children[node.tokens]; self.unused.discard(b); return b',
    ),
})
