"""The BPE merge loop: how a chunk of bytes becomes token ids.

Training (train.py) produced an ordered list of merges: "first join these two tokens, then these".
Encoding replays that list on a new chunk. Start from one token per byte, then repeatedly find the
adjacent pair whose merge was learned *earliest* (lowest rank), and join every occurrence of it,
left to right. Stop when no adjacent pair has a merge. The result is deterministic and reproduces
exactly how the training run would have cut this chunk.

    ids = [b"l", b"o", b"w", b"e", b"r"]   merges: (l,o)->lo rank 3, (lo,w)->low rank 7, (e,r)->er rank 5
    step 1: lowest rank among (l,o)=3 (o,w)=- (w,e)=- (e,r)=5  -> join (l,o): [lo, w, e, r]
    step 2: (lo,w)=7 (w,e)=- (e,r)=5                         -> join (e,r): [lo, w, er]
    step 3: (lo,w)=7 (w,er)=-                                -> join (lo,w): [low, er]
    step 4: (low,er) has no merge                            -> done
"""

from __future__ import annotations

from itertools import pairwise

# (left id, right id) -> (rank, merged id). Rank is the merge's position in the training order.
Merges = dict[tuple[int, int], tuple[int, int]]

_NO_MERGE = (1 << 62, -1)


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


def bpe(ids: list[int], merges: Merges) -> list[int]:
    """Apply the merges to one chunk (already one id per byte) until none applies."""
    while len(ids) >= 2:
        # the adjacent pair learned earliest; min() over a short list beats a heap for chunk sizes
        _, new_id, pair = min((merges.get(p, _NO_MERGE) + (p,) for p in pairwise(ids)), key=lambda t: t[0])
        if new_id < 0:
            break
        ids = merge_pair(ids, pair, new_id)
    return ids
