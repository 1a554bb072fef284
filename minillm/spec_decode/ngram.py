"""N-gram (prompt lookup) proposer: no model, just the sequence's own tokens.

Output that quotes its input (a summary, an edit of given code, an answer grounded in a document)
repeats n-grams of the prompt. Take the last n tokens of prompt + output; find their first earlier
occurrence; propose the k tokens that followed it. The longest n in [prompt_lookup_min,
prompt_lookup_max] that matches wins (a longer match is a better predictor). The drafts carry no
probabilities: the rejection sampler treats them as one-hot guesses (vLLM's rule).
"""

from __future__ import annotations

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


class NgramProposer(Proposer):
    method = "ngram"

    def __init__(self, config):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs, num_spec, block_tables):
        return [ngram_lookup(s.token_ids, self.min_n, self.max_n, k) if k else [] for s, k in zip(seqs, num_spec)], None
