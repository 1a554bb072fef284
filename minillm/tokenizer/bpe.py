"""The BPE merge loop: how a chunk of bytes becomes token ids.

Training (train.py) produced an ordered list of merges: "first join these two tokens, then these".
Encoding replays that list on a new chunk. Start from one token per byte, then repeatedly find the
adjacent pair whose merge was learned *earliest* (lowest rank) and join it (the leftmost one if it
occurs twice). Stop when no adjacent pair has a merge. The result is deterministic and reproduces
exactly how the training run would have cut this chunk.

    ids = [b"l", b"o", b"w", b"e", b"r"]   merges: (l,o)->lo rank 3, (lo,w)->low rank 7, (e,r)->er rank 5
    step 1: lowest rank among (l,o)=3 (o,w)=- (w,e)=- (e,r)=5  -> join (l,o): [lo, w, e, r]
    step 2: (lo,w)=7 (w,e)=- (e,r)=5                         -> join (e,r): [lo, w, er]
    step 3: (lo,w)=7 (w,er)=-                                -> join (lo,w): [low, er]
    step 4: (low,er) has no merge                            -> done
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import pairwise

from .budget import CHECK_EVERY, check_stop

# (left id, right id) -> (rank, merged id). Rank is the merge's position in the training order.
Merges = dict[tuple[int, int], tuple[int, int]]


def merge_pair(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every non-overlapping occurrence of `pair` in `ids`, scanning left to right.

    [5, 5, 5] with pair (5, 5) -> [new, 5]: the scan consumes both halves of a match before looking
    again, which is also what training did.
    """
    out, i, n = [], 0, len(ids)
    while i < n:
        if i + 1 < n and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def bpe(ids: list[int], merges: Merges, should_stop: Callable[[], bool] | None = None) -> list[int]:
    """Apply the merges to one chunk (already one id per byte) until none applies.

    One merge per step: the adjacent pair with the lowest rank, the leftmost one on a tie. For
    merges in training order this equals joining every occurrence at once (what training did); for
    any other order it is what HF tokenizers and tiktoken do, so it is the rule we follow.
    should_stop: checked every CHECK_EVERY merges of a long chunk (EncodeStopped when it says so).
    """
    if len(ids) > LONG_CHUNK:
        return bpe_heap(ids, merges, should_stop)
    ids = list(ids)
    while len(ids) >= 2:
        best = min(((merges[p][0], i) for i, p in enumerate(pairwise(ids)) if p in merges), default=None)
        if best is None:
            break
        i = best[1]
        ids[i : i + 2] = [merges[ids[i], ids[i + 1]][1]]
    return ids


# The loop above rescans the chunk after every merge: O(n^2). Chunks are words, so n is small, but a
# prompt can hold one long run without spaces (base64, a DNA string, minified code). Past this many
# bytes we switch to the same algorithm with a heap, as HF's Rust BPE does: O(n log n).
LONG_CHUNK = 64


def bpe_heap(ids: list[int], merges: Merges, should_stop: Callable[[], bool] | None = None) -> list[int]:
    """bpe() for long chunks: the symbols in a linked list, the candidate merges in a heap.

    The heap pops the lowest rank first and, for equal ranks (the same pair), the leftmost position,
    so it merges exactly what the loop merges. An entry whose symbols changed since it was pushed
    is stale and skipped.
    """
    n = len(ids)
    ids = list(ids)
    nxt = list(range(1, n + 1))  # index of the next live symbol (n: none)
    prv = list(range(-1, n - 1))  # index of the previous live symbol (-1: none)
    alive = [True] * n
    # An entry is one int, rank * n + position: ints compare several times faster than tuples, and a
    # rank names its pair (each pair has one), so the entry needs no copy of the pair.
    heap = [merges[p][0] * n + i for i, p in enumerate(pairwise(ids)) if p in merges]
    heapq.heapify(heap)
    get, pop, push = merges.get, heapq.heappop, heapq.heappush
    pops = 0
    while heap:
        pops += 1
        if pops % CHECK_EVERY == 0:
            check_stop(should_stop)
        rank, i = divmod(pop(heap), n)
        j = nxt[i]
        if not alive[i] or j >= n:
            continue
        merge = get((ids[i], ids[j]))
        if merge is None or merge[0] != rank:
            continue  # stale: one of its symbols was merged away since
        ids[i] = merge[1]  # symbol i absorbs symbol j
        alive[j] = False
        k = nxt[i] = nxt[j]
        if k < n:
            prv[k] = i
            right = get((ids[i], ids[k]))
            if right is not None:
                push(heap, right[0] * n + i)
        h = prv[i]
        if h >= 0:
            left = get((ids[h], ids[i]))
            if left is not None:
                push(heap, left[0] * n + h)
    return [t for t, keep in zip(ids, alive) if keep]
