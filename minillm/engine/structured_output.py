"""StructuredOutputManager: each structured request's grammar, followed token by token (chapter 14).

A request with `SamplingParams(structured_outputs=StructuredOutputsParams(...))` gets its grammar
compiled once (GrammarCompiler: a cache keyed by the schema's hash) when the engine accepts it, and
each of its sequences a Matcher. Every step, the engine writes each sampling sequence's allowed
tokens into one row of a packed bitmask ([S, ceil(V / 32)] int32, numpy: the engine imports no
torch); the worker applies it at its one mask point (sampling/token_mask.py), so greedy, seeded
sampling, logprobs and n > 1 all pick among the grammar's tokens. The token sampled is then fed to
the matcher; once the grammar is complete only EOS is allowed, and the sequence ends on it.

What this first version leaves to later: structured requests get no draft tokens (chapter 09's
verify would need the matcher's rollback), and take the plain step, not the overlapped one (their
next mask needs the token just sampled on the host).
"""

from __future__ import annotations

import numpy as np

from ..structured_output import GrammarCompiler, Matcher, StructuredOutputsParams, TokenVocab
from ..structured_output.matcher import CompiledGrammar


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._compiler: GrammarCompiler | None = None  # the vocabulary's bytes are read at the first use
        self.matchers: dict[int, Matcher] = {}  # seq_id -> its matcher

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            vocab = TokenVocab.from_tokenizer(self.tokenizer, self.vocab_size, stop_ids=self.eos_token_ids)
            self._compiler = GrammarCompiler(vocab)
        return self._compiler

    def compile(self, params: StructuredOutputsParams, name: str) -> CompiledGrammar:
        """-> the compiled grammar (cached); a bad schema, regex or grammar is a ValueError naming the
        request and the field."""
        if not self.eos_token_ids:
            raise ValueError(f"{name}: structured output needs an EOS token to end on; this engine has none")
        try:
            return self.compiler.compile(params)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name}: structured_outputs.{params.kind}: {e}") from None

    def add(self, seq_id: int, compiled: CompiledGrammar) -> None:
        self.matchers[seq_id] = Matcher(compiled)

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def bitmask(self, seqs) -> np.ndarray | None:
        """[S, ceil(V / 32)] int32, row i the allowed tokens of seqs[i] (-1: a free row); None when no
        sequence of the step is structured (the usual step pays one test)."""
        matchers = self.matchers
        if not matchers or not any(s.seq_id in matchers for s in seqs):
            return None
        rows = np.full((len(seqs), (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            m = matchers.get(s.seq_id)
            if m is not None:
                m.fill_bitmask(rows[i])
        return rows

    def accept(self, seq_id: int, token: int) -> None:
        """Feed the sampled token to the sequence's matcher (if it has one). A token outside the mask
        cannot come from the masked sampler; if one does, the request fails rather than break its
        grammar silently."""
        m = self.matchers.get(seq_id)
        if m is not None and not m.accept_token(token):
            raise ValueError(f"token {token} does not follow the request's grammar here")
