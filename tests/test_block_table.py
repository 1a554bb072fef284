"""Chapter 13: the worker's persistent block table, fed only the block manager's changes, equals
the padded tables the engine used to send every step, after any random run of allocations, prefix
hits, forks with copy-on-write, multi-token allocations, trims, frees, swaps out and back."""

from __future__ import annotations

import random

import numpy as np
import pytest

from minillm.engine import BlockManager, HashPrefixCache, RadixPrefixCache
from minillm.worker.block_table import PersistentBlockTable


def padded(bm: BlockManager, seq_ids: list[int]) -> np.ndarray:
    """What prepare_model_input built before chapter 13: the lists, padded with block 0 to the widest."""
    tables = [bm.block_tables[s] for s in seq_ids]
    width = max(max(len(t) for t in tables), 1)
    return np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int32).reshape(len(tables), width)


@pytest.mark.parametrize("kind", [None, "hash", "radix"])
def test_the_kept_table_equals_the_block_managers_lists(seed, kind):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    cache = {"hash": HashPrefixCache, "radix": RadixPrefixCache}[kind](bs) if kind else None
    bm = BlockManager(rng.randrange(12, 60), bs, num_cpu_blocks=rng.randrange(0, 30), prefix_cache=cache,
                      track_changes=True)
    kept = PersistentBlockTable(max_rows=2, max_blocks=2)  # small: rows and width must grow
    seqs, swapped, next_id = {}, {}, 0
    system = [rng.randrange(5) for _ in range(rng.randrange(0, 9))]
    for step in range(400):
        for _ in range(rng.randrange(1, 4)):  # a few changes per step, as a scheduler pass makes
            op = rng.random()
            if op < 0.25 or not seqs:
                tokens = system[: rng.randrange(len(system) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(1, 9))]
                hits = bm.match_prefix(tokens)
                if bm.allocate_slots(next_id, len(tokens), len(tokens) - len(hits) * bs, hits):
                    bm.count_prefix_hits(tokens, len(hits))
                    bm.cache_full_blocks(next_id, tokens, len(tokens))
                    seqs[next_id] = tokens
                next_id += 1
            elif op < 0.35:
                parent = rng.choice(list(seqs))
                bm.fork(parent, next_id)
                seqs[next_id] = list(seqs[parent])
                next_id += 1
            elif op < 0.7:  # 1 token, or a chunk with draft slots (chapter 09) that may be trimmed after
                sid = rng.choice(list(seqs))
                n = 1 if rng.random() < 0.6 else rng.randrange(2, 7)
                tokens = seqs[sid] + [rng.randrange(5) for _ in range(n)]
                if bm.allocate_slots(sid, len(tokens), n):
                    if n > 1:  # drafts: some rejected, their slots trimmed in a later step
                        tokens = tokens[: len(tokens) - rng.randrange(0, n)]
                    seqs[sid] = tokens
                    bm.cache_full_blocks(sid, tokens, len(tokens))
            elif op < 0.75:
                sid = rng.choice(list(seqs))
                bm.trim(sid, len(seqs[sid]))
            elif op < 0.8 and bm.free_cpu_blocks:
                sid = rng.choice(list(seqs))
                if bm.can_swap_out(sid):
                    bm.swap_out(sid)
                    swapped[sid] = seqs.pop(sid)
            elif op < 0.9 and swapped:
                sid = rng.choice(list(swapped))
                if bm.can_swap_in(sid):
                    bm.swap_in(sid)
                    seqs[sid] = swapped.pop(sid)
            else:
                sid = rng.choice(list(seqs))
                bm.free(sid)
                del seqs[sid]
            bm.pending_copies.clear()
        kept.apply(*bm.take_table_changes())  # one step's message
        live = [s for s in seqs if s in bm.block_tables]
        if live:
            order = rng.sample(live, k=rng.randrange(1, len(live) + 1))  # a step schedules some, in any order
            assert np.array_equal(kept.gather(order), padded(bm, order)), (step, order)
        assert set(kept.row_of) == set(bm.block_tables), step  # no leaked rows, none missing
        for sid, table in bm.block_tables.items():  # each row is its list, then zeros (any width gathers right)
            row = kept.table[kept.row_of[sid]]
            assert row[: len(table)].tolist() == table and not row[len(table):].any(), (step, sid)
        assert not kept.table[kept.free_rows].any(), step  # a freed row is clean for its next sequence
    for sid in list(seqs):
        bm.free(sid)
    kept.apply(*bm.take_table_changes())
    assert kept.row_of == {} and not kept.table.any()


def test_nothing_changed_means_nothing_sent():
    bm = BlockManager(20, 4, track_changes=True)
    assert bm.allocate_slots(1, 6, 6)
    dropped, updates = bm.take_table_changes()
    assert dropped == [] and updates == [(1, 0, bm.block_tables[1])]
    assert bm.allocate_slots(1, 7, 1)  # room in the last block: the table is unchanged
    assert bm.take_table_changes() == ([], [])
    assert bm.allocate_slots(1, 9, 2)  # a third block: only it travels
    assert bm.take_table_changes() == ([], [(1, 2, bm.block_tables[1][2:])])


def test_without_tracking_the_block_manager_records_nothing():
    bm = BlockManager(20, 4)
    assert bm.allocate_slots(1, 6, 6)
    bm.free(1)
    assert bm.take_table_changes() == ([], [])
