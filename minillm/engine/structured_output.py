"""StructuredOutputManager: each structured request's grammar, followed token by token (chapter 14).

A request with `SamplingParams(structured_outputs=StructuredOutputsParams(...))` gets its grammar
compiled once (GrammarCompiler: a cache keyed by the schema's hash) when the engine accepts it, and
each of its sequences a Matcher. Every step, the engine writes each sampling sequence's allowed
tokens into one row of a packed bitmask ([S, ceil(V / 32)] int32, numpy: the engine imports no
torch); the worker applies it at its one mask point (sampling/token_mask.py), so greedy, seeded
sampling, logprobs and n > 1 all pick among the grammar's tokens. The token sampled is then fed to
the matcher; once the grammar is complete only EOS is allowed, and the sequence ends on it.

Two backends fill the same mask (vLLM's `structured_outputs_backend`): "minillm", our compiler
(structured_output/, the one the chapter builds), and "xgrammar", the C++ library vLLM and SGLang use
(structured_output/xgrammar_backend.py), built on the same vocabulary bytes, excluded tokens and stop
ids. The engine, the worker and the mask point do not know which one filled a row.

A request is checked (`validate`) where the client waits, cheaply: our front-end and automaton without
the token index, or xgrammar's compile (milliseconds, cached); the full compile comes when the engine
accepts the request (`compile`, a cache hit for a repeated schema).

Under overlap scheduling (overlap_steps.py) a step's mask needs the token the step before sampled,
which reaches the host only once that step has run: the engine queues the step's forward pass first,
then waits for the previous tokens, feeds them to the matchers (`accept`), fills this step's mask
(`bitmask`) and only then queues the sampling, so the GPU computes the forward pass meanwhile
(chapters/bench/structured-overlap-design.md).

What this version leaves to later: structured requests get no draft tokens (chapter 09's verify would
need the matcher's rollback).
"""

from __future__ import annotations

import numpy as np

from ..checks import check_choice
from ..structured_output import GrammarCompiler, Matcher, StructuredOutputsParams, TokenVocab
from ..structured_output.xgrammar_backend import XgrammarCompiler, XgrammarMatcher, import_xgrammar

BACKENDS = ("minillm", "xgrammar")


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], backend: str = "minillm"):
        check_choice("structured_outputs_backend", backend, BACKENDS)
        if backend == "xgrammar":
            import_xgrammar()  # not installed: fail now, naming the package, not at the first request
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.backend = backend
        self._compiler = None  # the vocabulary's bytes are read at the first use
        self._matcher = Matcher if backend == "minillm" else XgrammarMatcher
        self.matchers: dict[int, object] = {}  # seq_id -> its matcher (Matcher or XgrammarMatcher)

    @property
    def compiler(self) -> GrammarCompiler | XgrammarCompiler:
        if self._compiler is None:
            vocab = TokenVocab.from_tokenizer(self.tokenizer, self.vocab_size, stop_ids=self.eos_token_ids)
            self._compiler = (GrammarCompiler if self.backend == "minillm" else XgrammarCompiler)(vocab)
        return self._compiler

    def validate(self, params: StructuredOutputsParams, name: str) -> None:
        """Refuse a bad schema, regex or grammar (a ValueError naming the request and the field) without
        the full compile where that is the costly part."""
        self._compiling(lambda: self.compiler.check(params), params, name)

    def compile(self, params: StructuredOutputsParams, name: str):
        """-> the compiled grammar (cached); errors as validate's."""
        return self._compiling(lambda: self.compiler.compile(params), params, name)

    def _compiling(self, fn, params, name: str):
        if not self.eos_token_ids:
            raise ValueError(f"{name}: structured output needs an EOS token to end on; this engine has none")
        try:
            return fn()
        except (ValueError, TypeError) as e:
            field, text = f"structured_outputs.{params.kind}", str(e)
            raise ValueError(f"{name}: {text if text.startswith(field) else f'{field}: {text}'}") from None

    def add(self, seq_id: int, compiled) -> None:
        self.matchers[seq_id] = self._matcher(compiled)

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def any_structured(self, seqs) -> bool:
        """Whether some sequence of the step follows a grammar (the usual step: one test)."""
        matchers = self.matchers
        return bool(matchers) and any(s.seq_id in matchers for s in seqs)

    def bitmask(self, seqs) -> np.ndarray | None:
        """[S, ceil(V / 32)] int32, row i the allowed tokens of seqs[i] (-1: a free row); None when no
        sequence of the step is structured (the usual step pays one test)."""
        matchers = self.matchers
        if not self.any_structured(seqs):
            return None
        rows = np.full((len(seqs), (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        for i, s in enumerate(seqs):
            m = matchers.get(s.seq_id)
            if m is None:
                continue
            if m.is_terminated():  # it accepted EOS last step (overlap: this step's token is thrown away);
                rows[i] = 0  # xgrammar refuses to fill then: only the stop tokens, as our Matcher writes
                for t in self.eos_token_ids:
                    rows[i, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
            else:
                m.fill_bitmask(rows[i])
        return rows

    def accept(self, seq_id: int, token: int) -> None:
        """Feed the sampled token to the sequence's matcher (if it has one). A token outside the mask
        cannot come from the masked sampler; if one does, the request fails rather than break its
        grammar silently."""
        m = self.matchers.get(seq_id)
        if m is not None and not m.accept_token(token):
            raise ValueError(f"token {token} does not follow the request's grammar here")
