"""N-gram (prompt lookup) proposer: no model, just the sequence's own tokens.

Output that quotes its input (a summary, an edit of given code, an answer grounded in a document)
repeats n-grams of the prompt. Take the last n tokens of prompt + output; find their first earlier
occurrence; propose the k tokens that followed it. The longest n in [prompt_lookup_min,
prompt_lookup_max] that matches wins (a longer match is a better predictor). The drafts carry no
probabilities: the rejection sampler treats them as one-hot guesses (vLLM's rule).

`ngram_lookup` says what is proposed, on the whole token list (the lab checks against it). The engine
asks every running sequence every step, and rescanning a growing list costs tens of microseconds a
sequence (at batch 64, more than the H100's whole forward pass). So the proposer keeps, per sequence, the
earliest start of every n-gram seen so far (`NgramIndex`) and adds only the tokens appended since the last
step: a lookup is then max_n - min_n + 1 dictionary probes, whatever the length.
"""

from __future__ import annotations

import weakref

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .proposer import Proposer


def ngram_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The k (or fewer) tokens after the earliest earlier occurrence of the longest suffix of tokens
    of length n in [min_n, max_n]; [] when no such suffix occurs earlier."""
    a = np.asarray(tokens, dtype=np.int64)
    L = len(a)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # windows of a[:L-1] start at 0..L-1-n: each has at least one token after it, and none is
        # the suffix itself (which starts at L - n)
        windows = sliding_window_view(a[: L - 1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == a[L - n :]).all(axis=1))
        if hits.size:
            i = int(hits[0]) + n
            return a[i : i + k].tolist()
    return []


class NgramIndex:
    """One sequence's n-grams (n in [min_n, max_n]) -> the earliest position where each starts, over the
    windows that have a token after them: ngram_lookup's answer without rescanning."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> earliest start (n is the tuple's length)

    def extend(self, new: list[int]) -> None:
        old, toks = len(self.tokens), self.tokens
        toks += new
        L = len(toks)
        for n in range(self.min_n, self.max_n + 1):
            # windows starting at s with s + n <= L - 1 (a token after them): the new ones since old
            for s in range(max(0, old - n), L - n):
                self.first.setdefault(tuple(toks[s : s + n]), s)

    def lookup(self, k: int) -> list[int]:
        toks, L = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            s = self.first.get(tuple(toks[L - n :]))  # never the suffix itself: it has no token after it
            if s is not None:
                return toks[s + n : s + n + k]
        return []


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, config):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> NgramIndex

    def propose(self, seqs, num_spec, tables=None):
        return [self._index(s).lookup(k) if k else [] for s, k in zip(seqs, num_spec)], None

    def _index(self, seq) -> NgramIndex:
        """seq's index, brought up to its current tokens (prompt and output only grow; if they ever did
        not, the index starts again)."""
        index = self.indexes.get(seq)
        if index is None or len(index.tokens) > seq.num_tokens:
            index = self.indexes[seq] = NgramIndex(self.min_n, self.max_n)
        have, P = len(index.tokens), len(seq.prompt_ids)
        if have < seq.num_tokens:
            new = seq.prompt_ids[have:] + seq.output_ids[max(0, have - P):] if have < P else seq.output_ids[have - P:]
            index.extend(new)
        return index
