"""The vocabulary as the automaton sees it: each token id's bytes, padded into one matrix so that a
DFA can walk all 49,152 tokens at once with numpy (token_index.py).

Special tokens (<|im_start|>, ...) are never allowed inside constrained text: their bytes are not
what the model means by them. Stop tokens (EOS) are allowed exactly when the automaton accepts.
"""

from __future__ import annotations

import hashlib

import numpy as np


class TokenVocab:
    """token_bytes[i]: the bytes token i stands for (b"" = never allowed); stop_ids: EOS-like ids;
    vocab_size: the logits' width (may exceed len(token_bytes): padded embedding rows)."""

    def __init__(self, token_bytes, stop_ids=(), vocab_size: int | None = None, excluded=()):
        self.vocab_size = vocab_size or len(token_bytes)
        if len(token_bytes) > self.vocab_size:
            raise ValueError(f"{len(token_bytes)} tokens do not fit a vocab_size of {self.vocab_size}")
        excluded = set(excluded) | set(stop_ids)
        self.token_bytes = [b"" if i in excluded else bytes(t) for i, t in enumerate(token_bytes)]
        self.stop_ids = sorted(set(stop_ids))
        for i in self.stop_ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"stop token id {i} is outside the vocabulary (0..{self.vocab_size - 1})")
        self.num_words = (self.vocab_size + 31) // 32  # int32 words in one bitmask row
        V = self.vocab_size
        lengths = np.zeros(V, dtype=np.int64)
        lengths[: len(self.token_bytes)] = [len(t) for t in self.token_bytes]
        self.lengths = lengths  # [V]
        L = max(1, int(lengths.max()))
        mat = np.zeros((V, L), dtype=np.uint8)  # [V, L] bytes, zero-padded past each length
        flat = np.frombuffer(b"".join(self.token_bytes), dtype=np.uint8)
        rows = np.repeat(np.arange(V), lengths)
        cols = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        mat[rows, cols] = flat
        self.mat = mat
        # Tokens grouped by first byte: a DFA state's first-byte edges pick their tokens by slicing.
        real = np.nonzero(lengths > 0)[0]
        first = mat[real, 0]
        order = np.argsort(first, kind="stable")
        self.by_first = real[order]  # token ids sorted by first byte
        self.first_starts = np.searchsorted(first[order], np.arange(257))  # [257] slice bounds per byte
        h = hashlib.sha256()
        for t in self.token_bytes:
            h.update(len(t).to_bytes(2, "little") + t)
        h.update(repr((self.stop_ids, self.vocab_size)).encode())
        self.hash = h.hexdigest()[:16]

    @classmethod
    def from_tokenizer(cls, tok, vocab_size: int | None = None, stop_ids=None) -> TokenVocab:
        """From minillm's Tokenizer: its vocab bytes, its special tokens excluded, EOS as the stop."""
        if stop_ids is None:
            stop_ids = [] if tok.eos_token_id is None else [tok.eos_token_id]
        return cls(tok.vocab, stop_ids=stop_ids, vocab_size=vocab_size, excluded=tok.special_ids)
