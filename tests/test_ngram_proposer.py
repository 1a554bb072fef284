"""The n-gram proposer's incremental index proposes exactly what a full rescan (ngram_lookup) does."""

from __future__ import annotations

import random

from minillm import SamplingParams
from minillm.sequence import Sequence
from minillm.spec_decode.config import SpeculativeConfig
from minillm.spec_decode.ngram import NgramIndex, NgramProposer, ngram_lookup


def test_index_matches_a_rescan_as_tokens_arrive(seed):
    rng = random.Random(seed)
    for _ in range(200):
        min_n = rng.randint(1, 3)
        max_n, vocab = rng.randint(min_n, 5), rng.choice([2, 3, 5, 50])  # small vocabularies: many repeats
        index, tokens = NgramIndex(min_n, max_n), []
        for _ in range(25):
            new = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 7]))]
            tokens += new
            index.extend(new)
            k = rng.randint(1, 6)
            assert index.lookup(k) == ngram_lookup(tokens, min_n, max_n, k), (min_n, max_n, tokens, k)


def test_proposer_follows_each_sequence(seed):
    """Sequences grow by accepted runs of different lengths, side by side; a new sequence gets its own index."""
    rng = random.Random(seed)
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                          "prompt_lookup_max": 3})
    proposer = NgramProposer(config)
    seqs = [Sequence(i, [rng.randrange(6) for _ in range(rng.randint(1, 20))], SamplingParams(), 0, None, [], 10**6)
            for i in range(4)]
    for _ in range(30):
        ks = [rng.randint(0, 4) for _ in seqs]
        drafts, q = proposer.propose(seqs, ks, {})
        assert q is None
        assert drafts == [ngram_lookup(s.token_ids, 1, 3, k) if k else [] for s, k in zip(seqs, ks)]
        for s in seqs:
            for t in [rng.randrange(6) for _ in range(rng.randint(1, 5))]:
                s.append(t)  # (append keeps num_tokens up to date)
    assert len(proposer.indexes) == len(seqs)
