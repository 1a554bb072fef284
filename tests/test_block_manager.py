"""Chapters 05-06: the block bookkeeping, against a plain model of what it must mean.

The oracle is a shadow "KV memory": every block slot holds the (sequence, position, token) written
there. After any random sequence of allocations, forks, writes, frees and evictions, every
sequence's block table must read back its own tokens, and no block may be both free and in use.
"""

from __future__ import annotations

import random

import pytest

from minillm.engine import BlockManager, HashPrefixCache, RadixPrefixCache


class Shadow:
    """A fake KV cache: block -> {offset: token}, written the way the model runner would."""

    def __init__(self, bm: BlockManager):
        self.bm, self.mem = bm, {}

    def write(self, seq_id: int, tokens: list[int], start: int, end: int) -> None:
        for src, dst in self.bm.pending_copies:  # copy-on-write first, as the runner does
            self.mem[dst] = dict(self.mem.get(src, {}))
        self.bm.pending_copies.clear()
        table, bs = self.bm.block_tables[seq_id], self.bm.block_size
        for p in range(start, end):
            self.mem.setdefault(table[p // bs], {})[p % bs] = tokens[p]

    def read(self, seq_id: int, n: int) -> list[int]:
        table, bs = self.bm.block_tables[seq_id], self.bm.block_size
        return [self.mem.get(table[p // bs], {}).get(p % bs) for p in range(n)]


@pytest.mark.parametrize("kind", [None, "hash", "radix"])
def test_random_operations_keep_every_sequence_readable(seed, kind):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    cache = {"hash": HashPrefixCache, "radix": RadixPrefixCache}[kind](bs) if kind else None
    bm = BlockManager(rng.randrange(8, 40), bs, prefix_cache=cache)
    shadow, seqs, next_id = Shadow(bm), {}, 0
    system = [rng.randrange(5) for _ in range(rng.randrange(0, 9))]
    for _ in range(300):
        op = rng.random()
        if op < 0.3 or not seqs:  # a new sequence, maybe sharing a prefix with earlier ones
            tokens = system[: rng.randrange(len(system) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
            hits = bm.match_prefix(tokens)
            done = len(hits) * bs
            assert done < len(tokens)
            if bm.allocate_slots(next_id, len(tokens), len(tokens) - done, hits):
                shadow.write(next_id, tokens, done, len(tokens))
                seqs[next_id] = tokens
                bm.cache_full_blocks(next_id, tokens, len(tokens))
                next_id += 1
        elif op < 0.45:  # parallel sampling: a child shares everything
            parent = rng.choice(list(seqs))
            bm.fork(parent, next_id)
            seqs[next_id] = list(seqs[parent])
            next_id += 1
        elif op < 0.8:  # decode one token (copy-on-write if its block is shared)
            sid = rng.choice(list(seqs))
            tokens = seqs[sid] + [rng.randrange(5)]
            if bm.allocate_slots(sid, len(tokens), 1):
                shadow.write(sid, tokens, len(tokens) - 1, len(tokens))
                seqs[sid] = tokens
                bm.cache_full_blocks(sid, tokens, len(tokens))
        else:
            sid = rng.choice(list(seqs))
            bm.free(sid)
            del seqs[sid]
        for sid, tokens in seqs.items():  # the oracle: every sequence reads back its own tokens
            assert shadow.read(sid, len(tokens)) == tokens, (sid, tokens, bm.block_tables[sid])
        used = {b for t in bm.block_tables.values() for b in t}
        assert not used & set(bm.free_blocks) and 0 not in used
        assert all(bm.ref_counts[b] == sum(t.count(b) for t in bm.block_tables.values()) for b in used)
    for sid in list(seqs):
        bm.free(sid)
    assert bm.num_free_blocks == bm.num_blocks - 1 and sum(bm.ref_counts) == 0


def test_fork_then_write_copies_only_the_partly_filled_block():
    bm = BlockManager(10, 4)
    assert bm.allocate_slots(1, 6, 6)  # 2 blocks: one full, one half
    bm.fork(1, 2)
    assert bm.block_tables[1] == bm.block_tables[2]
    assert bm.allocate_slots(2, 7, 1)  # the child writes position 6: its own copy of block 2
    full, half = bm.block_tables[1]
    assert bm.block_tables[2][0] == full and bm.block_tables[2][1] != half
    assert bm.pending_copies == [(half, bm.block_tables[2][1])]
    assert bm.ref_counts[full] == 2 and bm.ref_counts[half] == 1


def test_hash_cache_evicts_least_recently_released_first():
    c = HashPrefixCache(2)
    c.insert([1, 2, 3, 4], [5, 6])
    c.insert([7, 8], [9])
    for b in (9, 6, 5):
        c.release(b)
    assert [c.evict(), c.evict(), c.evict(), c.evict()] == [9, 6, 5, None]
    assert c.match([1, 2, 3, 4], 2) == []


def test_radix_cache_evicts_leaves_only():
    c = RadixPrefixCache(2)
    c.insert([1, 2, 3, 4], [5, 6])
    c.insert([1, 2, 7, 7], [5, 8])
    for b in (5, 6, 8):  # the shared inner block is released first, yet must outlive its children
        c.release(b)
    order = [c.evict(), c.evict(), c.evict()]
    assert order[-1] == 5 and set(order[:2]) == {6, 8}
    assert c.evict() is None and c.match([1, 2, 3, 4], 2) == []


def test_radix_eviction_is_the_least_recently_used_leaf_over_long_runs(seed):
    """The radix cache finds its victim through a heap with stale entries (and compacts it); a brute-force
    scan of every evictable leaf must agree at every eviction, over thousands of operations."""
    rng = random.Random(seed)
    bs, num_blocks = 2, 40
    cache = RadixPrefixCache(bs)
    free, refs, owned = list(range(num_blocks)), [0] * num_blocks, []
    prefixes = [[rng.randrange(3) for _ in range(8)] for _ in range(3)]
    evictions = 0
    for _ in range(3000):
        r = rng.random()
        if r < 0.45:  # a request: match, take the hits, fresh blocks for the rest, name them all
            tokens = rng.choice(prefixes)[: rng.randrange(0, 9)] + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            hits = cache.match(tokens, len(tokens) // bs)
            need = len(tokens) // bs - len(hits)
            if need > len(free) + cache.num_evictable - sum(refs[b] == 0 for b in hits):
                continue
            for b in hits:
                if refs[b] == 0:
                    cache.acquire(b)
                refs[b] += 1
            blocks = list(hits)
            for _ in range(need):
                b = free.pop() if free else cache.evict()
                refs[b] = 1
                blocks.append(b)
            cache.insert(tokens, blocks)
            owned.append(blocks)
        elif r < 0.85 and owned:  # a request ends: tail first
            for b in reversed(owned.pop(rng.randrange(len(owned)))):
                refs[b] -= 1
                if refs[b] == 0:
                    cache.release(b) if b in cache else free.append(b)
        else:  # pressure from elsewhere
            leaves = [b for b in cache._evictable if not cache._node_of[b].children]
            want = min(leaves, key=lambda b: cache._node_of[b].last_used) if leaves else None
            got = cache.evict()
            assert got == want
            if got is not None:
                free.append(got)
                evictions += 1
        assert len(cache._leaves) <= 2 * cache.num_evictable + 64 + 1  # compacted, not growing without bound
    assert evictions > 50
