"""Helpers of the structured-output tests: a tiny byte-level vocabulary, a brute-force mask, and a
random walk that favours short tokens and EOS so walks finish documents."""

from __future__ import annotations

import random

import numpy as np

from minillm.structured_output import Matcher, TokenVocab
from minillm.structured_output.token_index import unpack_bits

EOS = 0


def tiny_vocab(seed: int = 0, extra: int = 400) -> TokenVocab:
    """Id 0 = EOS; every single byte; then multi-byte tokens over JSON's and the regexes' alphabet,
    some of them halves of UTF-8 characters (the boundary problem a byte automaton must meet)."""
    rng = random.Random(seed)
    alphabet = list('{}[]":, \n\tabcxyzAZ019-.+eE_@\\/tfnrul') + ["é", "α", "😀"]
    toks = [b""] + [bytes([b]) for b in range(256)]
    seen = set(toks)
    pieces = ['{"', '":', '", "', '},', '"]', "true", "false", "null", ", ", ": ", '"}', "[{", "}]", "\\u00", "é".encode()[:1].decode("latin1")]
    for p in pieces:
        b = p.encode("latin1") if len(p) == 1 else p.encode()
        if b not in seen:
            seen.add(b)
            toks.append(b)
    while len(toks) < 257 + len(pieces) + extra:
        t = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5))).encode()
        if rng.random() < 0.1:
            t = t[: rng.randint(1, len(t))]  # may cut a UTF-8 character in half
        if t not in seen:
            seen.add(t)
            toks.append(t)
    return TokenVocab(toks, stop_ids=[EOS])


def allowed(m: Matcher) -> np.ndarray:
    row = np.zeros(m.compiled.vocab.num_words, dtype=np.int32)
    m.fill_bitmask(row)
    return np.nonzero(unpack_bits(row, m.compiled.vocab.vocab_size))[0]


def brute_force_allowed(m: Matcher) -> np.ndarray:
    """The oracle for the token index: walk every token's bytes through the automaton directly."""
    pda, vocab = m.compiled.pda, m.compiled.vocab
    ok = [t for t, b in enumerate(vocab.token_bytes) if b and pda.walk(m.state, b)[0]]
    if m.can_end():
        ok += vocab.stop_ids
    return np.array(sorted(ok), dtype=np.int64)


def pick(rng: random.Random, ids: np.ndarray, vocab: TokenVocab, stop_ids) -> int:
    """A random allowed token: EOS when allowed with p=0.3, else a short token with p=0.5 (so the
    walk reaches closing brackets), else any."""
    stops = [t for t in ids.tolist() if t in stop_ids]
    if stops and rng.random() < 0.3:
        return stops[0]
    if rng.random() < 0.5:
        short = [t for t in ids.tolist() if 0 < len(vocab.token_bytes[t]) <= 2]
        if short:
            return rng.choice(short)
    return int(rng.choice(ids))
