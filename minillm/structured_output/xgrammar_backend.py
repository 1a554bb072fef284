"""The second backend: xgrammar (PyPI) behind the same mask point (vLLM's structured_outputs_backend).

    compiler = XgrammarCompiler(TokenVocab.from_tokenizer(tok))
    compiled = compiler.compile(StructuredOutputsParams(json=schema))
    m = XgrammarMatcher(compiled)
    m.fill_bitmask(row)        # [ceil(V/32)] int32, the layout ours fills: the worker cannot tell them apart
    m.accept_token(t)

Ours teaches; xgrammar is the fast path for users (its compiler and masks are C++). Both see the same
vocabulary: TokenVocab's token bytes, its excluded tokens (special tokens) handed to xgrammar as empty
ones, which it never allows, and the same stop ids. The languages are the same as ours (compact JSON,
", " and ": " separators, properties in order) except where xgrammar 0.2.9 departs from valid JSON text
(peer.py and json_schema.py list the departures): its strings admit the surrogates U+D800..U+DFFF as
bytes, and a string with minLength/maxLength admits raw control characters (a tiny random model writes
{"name": "\x12\x12"}, which json.loads refuses unless strict=False). Ours keeps to JSON text.

xgrammar is an optional dependency: imported only when this backend is chosen, and a clear ImportError
naming the package when it is not installed.
"""

from __future__ import annotations

import json
import re

import numpy as np

from .params import StructuredOutputsParams
from .vocab import TokenVocab

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[02:28:26] /project/cpp/x.cc:106: " before each message


def import_xgrammar():
    """-> the xgrammar module, or an ImportError that names the package and how to get it."""
    try:
        import xgrammar  # lazy: optional dependency xgrammar
    except ImportError as e:
        raise ImportError("structured_outputs_backend='xgrammar' needs the Python package xgrammar, which is not "
                          f"installed ({e}): `pip install xgrammar`, or use structured_outputs_backend='minillm'"
                          ) from None
    return xgrammar


def xgrammar_tokenizer_info(vocab: TokenVocab):
    """The same vocabulary for xgrammar: excluded tokens as empty bytes (xgrammar's "special")."""
    xgr = import_xgrammar()
    return xgr.TokenizerInfo(list(vocab.token_bytes), xgr.VocabType.RAW, vocab_size=vocab.vocab_size,
                             stop_token_ids=vocab.stop_ids)


class XgrammarCompiler:
    """StructuredOutputsParams -> xgrammar's CompiledGrammar, cached by xgrammar (keyed by the spec)."""

    def __init__(self, vocab: TokenVocab, max_threads: int = 1):
        self.xgr = import_xgrammar()
        self.vocab = vocab
        self._compiler = self.xgr.GrammarCompiler(xgrammar_tokenizer_info(vocab), max_threads=max_threads)

    def compile(self, params: StructuredOutputsParams):
        """-> xgrammar.CompiledGrammar; a bad spec is a ValueError naming the field, with xgrammar's reason."""
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"expected StructuredOutputsParams, not {type(params).__name__}")
        kind, field = params.kind, f"structured_outputs.{params.kind}"
        try:
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "grammar":
                return self._compiler.compile_grammar(params.grammar)
            if kind == "choice":  # one EBNF alternative per string: JSON's string escapes are EBNF's
                return self._compiler.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
            # json_object is ours too: the schema {"type": "object"}, compact
            schema = '{"type":"object"}' if kind == "json_object" else params.spec()
            return self._compiler.compile_json_schema(schema, any_whitespace=False)
        except RuntimeError as e:  # xgrammar's parse and conversion errors
            reason = " ".join(_XGR_PREFIX.sub("", line).strip() for line in str(e).splitlines() if line.strip())
            raise ValueError(f"{field}: {reason}") from None

    check = compile  # the request check: xgrammar compiles in milliseconds, and the result is cached


class XgrammarMatcher:
    """One sequence's xgrammar.GrammarMatcher, with Matcher's interface (fill_bitmask, accept_token)."""

    def __init__(self, compiled):
        self._m = import_xgrammar().GrammarMatcher(compiled)
        self._torch = None

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed tokens into `row` ([ceil(V/32)] int32 numpy, a view into the step's mask)."""
        if self._torch is None:
            import torch  # lazy: xgrammar itself imports torch; only its fill needs a tensor

            self._torch = torch
        self._m.fill_next_token_bitmask(self._torch.from_numpy(row[None]), 0)  # [1, W] view, filled in place

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def reset(self) -> None:
        self._m.reset()
