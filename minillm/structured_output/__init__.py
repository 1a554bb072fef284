"""Chapter 14: structured output. A request's grammar (JSON Schema, regex, choice, GBNF) compiled to
an automaton over bytes, aligned with the vocabulary into per-state token bitmasks.

    compiler = GrammarCompiler(TokenVocab.from_tokenizer(tok))
    compiled = compiler.compile(StructuredOutputsParams(json=schema))
    matcher = Matcher(compiled)
    bitmask = allocate_token_bitmask(batch, vocab.vocab_size)   # [B, ceil(V/32)] int32
    matcher.fill_bitmask(bitmask[i]); apply_token_bitmask(logits, bitmask); matcher.accept_token(t)
"""

from .bitmask import allocate_token_bitmask, apply_token_bitmask, fill_bitmasks
from .compiler import GrammarCompiler
from .grammar import Grammar, compile_grammar
from .matcher import CompiledGrammar, Matcher
from .params import StructuredOutputsParams
from .regex import parse_regex
from .vocab import TokenVocab

__all__ = [
    "CompiledGrammar",
    "Grammar",
    "GrammarCompiler",
    "Matcher",
    "StructuredOutputsParams",
    "TokenVocab",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "compile_grammar",
    "fill_bitmasks",
    "parse_regex",
]
