"""Front-end dispatch and the compile cache: StructuredOutputsParams -> CompiledGrammar.

Compiling costs milliseconds to a second (the token index walks the whole vocabulary); requests that
repeat a schema, as an application's requests do, find it in an LRU cache keyed by the hash of
(kind, canonical spec, options, vocabulary).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict

from . import ir
from .gbnf import parse_gbnf
from .grammar import Grammar, compile_grammar
from .json_schema import schema_to_grammar
from .matcher import CompiledGrammar
from .params import StructuredOutputsParams
from .regex import parse_regex
from .vocab import TokenVocab


class GrammarCompiler:
    """Compiles structured-output specs against one vocabulary.

    max_whitespace: JSON's whitespace policy. None (default) = compact JSON with xgrammar's
    separators ", " and ": " and no other whitespace; an int N = up to N of [ \\n\\r\\t] wherever JSON
    allows whitespace (xgrammar's any_whitespace=True with max_whitespace_cnt=N). Unbounded whitespace
    is not offered: a small model can loop on spaces forever.
    xgrammar_strings: see json_schema.schema_to_grammar (parity tests only).
    """

    def __init__(self, vocab: TokenVocab, cache_size: int = 64, max_whitespace: int | None = None,
                 xgrammar_strings: bool = False):
        self.vocab = vocab
        self.xgrammar_strings = xgrammar_strings
        self.cache_size = cache_size
        self.max_whitespace = max_whitespace
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._checked: OrderedDict[str, None] = OrderedDict()  # keys check() has passed
        self.hits = self.misses = 0

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"expected StructuredOutputsParams, not {type(params).__name__}")
        spec = params.spec()
        key = self._key(params.kind, spec)
        if key in self._cache:
            self.hits += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        self.misses += 1
        t0 = time.perf_counter()
        grammar = self._grammar(params.kind, spec, params)
        pda = compile_grammar(grammar)
        compiled = CompiledGrammar(pda, self.vocab, source=grammar.source)
        compiled.compile_ms = (time.perf_counter() - t0) * 1e3
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _key(self, kind: str, spec) -> str:
        return hashlib.sha256(repr((kind, spec, self.max_whitespace, self.xgrammar_strings, self.vocab.hash)).encode()).hexdigest()

    def check(self, params: StructuredOutputsParams) -> None:
        """Refuse what compile() would refuse, without building the token index (the walk over the whole
        vocabulary, most of compile's time): the front-end and the automaton only. A server checks every
        request with it where the client waits; the engine compiles later, off the event loop."""
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"expected StructuredOutputsParams, not {type(params).__name__}")
        key = self._key(params.kind, params.spec())
        if key in self._cache or key in self._checked:  # a request of many prompts checks one grammar once
            return
        compile_grammar(self._grammar(params.kind, params.spec(), params))
        self._checked[key] = None
        if len(self._checked) > 4 * self.cache_size:
            self._checked.popitem(last=False)

    def _grammar(self, kind: str, spec, params: StructuredOutputsParams) -> Grammar:
        if kind == "regex":
            return Grammar({"root": parse_regex(params.regex, "structured_outputs.regex")}, source="structured_outputs.regex")
        if kind == "choice":
            return Grammar({"root": ir.alt(*(ir.lit(c) for c in params.choice))}, source="structured_outputs.choice")
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else json.loads(spec)
            return schema_to_grammar(schema, max_whitespace=self.max_whitespace,
                                     source=f"structured_outputs.{kind}", xgrammar_strings=self.xgrammar_strings)
        if kind == "grammar":
            return parse_gbnf(params.grammar, source="structured_outputs.grammar")
        raise AssertionError(kind)

    # Shorthands, as xgrammar's GrammarCompiler names them.
    def compile_regex(self, pattern: str) -> CompiledGrammar:
        return self.compile(StructuredOutputsParams(regex=pattern))

    def compile_json_schema(self, schema) -> CompiledGrammar:
        return self.compile(StructuredOutputsParams(json=schema))

    def compile_grammar(self, text: str) -> CompiledGrammar:
        return self.compile(StructuredOutputsParams(grammar=text))

