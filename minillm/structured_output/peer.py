"""xgrammar (PyPI), the peer and the oracle: the same vocabulary handed to both backends, and a
random walk that compares their allowed-token sets at every step and times both.

    python -m minillm.structured_output.peer        # the table: compile ms, mask us p50/p99, both
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .compiler import GrammarCompiler
from .matcher import Matcher
from .params import StructuredOutputsParams
from .token_index import unpack_bits
from .vocab import TokenVocab
from .xgrammar_backend import xgrammar_tokenizer_info

# The test set, written so both backends mean the same language: no '.' in regexes (xgrammar's matches
# a newline, `re`'s and ours do not); negated classes leave out the surrogates U+D800..U+DFFF, which
# xgrammar's include (as bytes ED A0..BF xx, not valid UTF-8) and ours never do; for JSON,
# xgrammar_strings=True (see json_schema.py).
PARITY_REGEXES = [
    r"\d{3}-\d{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]+ [A-Z][a-z]+, \d{1,3} years", r"\w+@\w+\.(com|org)",
    r"[^\n\ud800-\udfff]{0,12}x", r"[^a-z\ud800-\udfff]{2,5}", r"é[α-ω]+|😀{1,3}", r"(-?\d+(\.\d+)?|0x[0-9a-f]{1,4})",
]
PARITY_SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                                              "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"}, "born": {"type": "string", "format": "date"}, "none": {"type": "null"}},
        "required": ["name", "age"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}}},
    "anyof": {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": -40, "maximum": 40}]},
    "event": {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"},
                                               "code": {"type": "string", "pattern": "[A-Z]{2}-[0-9]+"}}, "required": ["at", "code"]},
    "nested": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "v": {"type": ["string", "null"]}}, "required": ["id", "v"]}}},
        "required": ["items"]},
    "tree": {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "kids"]}}, "$ref": "#/$defs/node"},
    "json_object": {"type": "object"},
}

# GBNF grammars, recursive ones included. xgrammar 0.2.9 masks wrongly when the start rule `root` is
# itself called from inside the grammar (it leaves out tokens such as "]," that close a nested root
# and go on in the outer one, though its accept_token takes them): hence `root ::= lst`.
PARITY_GRAMMARS = {
    "arith": r'''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")" | "-" factor''',
    "lists": r'''root ::= lst
lst ::= "[" ws (item ("," ws item)*)? ws "]"
item ::= [a-z]{1,8} | lst   # nested lists
ws ::= [ \t\n]{0,2}''',
    "kv": r'''root ::= pair ("\n" pair)*
pair ::= key "=" value
key ::= [a-zA-Z_] [a-zA-Z0-9_]*
value ::= "\"" [a-z é]* "\"" | "true" | "false" | [0-9]+ ("." [0-9]+)?''',
}


@dataclass
class WalkResult:
    steps: int = 0
    mismatches: list = field(default_factory=list)
    ours_us: list = field(default_factory=list)
    theirs_us: list = field(default_factory=list)
    finished: list = field(default_factory=list)  # the byte strings of completed outputs

    def p(self, which: str, q: float) -> float:
        return float(np.percentile(getattr(self, which), q)) if getattr(self, which) else float("nan")


def parity_walk(ours, theirs, steps: int, rng: random.Random, max_mismatches: int = 3,
                theirs_first: bool = False) -> WalkResult:
    """Walk `steps` tokens, picking among the allowed ones (EOS with p=0.2 when allowed, a short
    token with p=0.4, else any), comparing the two packed masks word for word at every step.
    theirs_first: fill xgrammar's mask before ours at each step (a benchmark alternates the order, so
    neither backend always runs on the caches the other one just warmed)."""
    import xgrammar as xgr  # lazy: optional dependency (the dev extra), only the peer needs it

    vocab = ours.vocab
    m, xm = Matcher(ours), xgr.GrammarMatcher(theirs)
    row = np.zeros(vocab.num_words, dtype=np.int32)
    xrow = xgr.allocate_token_bitmask(1, vocab.vocab_size)
    res, text = WalkResult(), b""
    short = np.array([0 < len(b) <= 2 for b in vocab.token_bytes] + [False] * (vocab.vocab_size - len(vocab.token_bytes)))
    fill = {"ours": lambda: m.fill_bitmask(row), "theirs": lambda: xm.fill_next_token_bitmask(xrow)}
    order = ("theirs", "ours") if theirs_first else ("ours", "theirs")
    for _ in range(steps):
        for who in order:
            t0 = time.perf_counter()
            fill[who]()
            getattr(res, f"{who}_us").append((time.perf_counter() - t0) * 1e6)
        res.steps += 1
        theirs_row = xrow[0].numpy()
        if not np.array_equal(row, theirs_row):
            a, b = unpack_bits(row, vocab.vocab_size), unpack_bits(theirs_row, vocab.vocab_size)
            res.mismatches.append((text, np.nonzero(a & ~b)[0][:10].tolist(), np.nonzero(b & ~a)[0][:10].tolist()))
            if len(res.mismatches) >= max_mismatches:
                break
        allowed = np.nonzero(unpack_bits(row, vocab.vocab_size))[0]
        stops = [t for t in vocab.stop_ids if t in set(allowed[:8].tolist()) or t in allowed]
        r = rng.random()
        if stops and r < 0.2:
            t = stops[0]
        elif r < 0.6 and short[allowed].any():
            t = int(rng.choice(allowed[short[allowed]]))
        else:
            t = int(rng.choice(allowed))
        if not (m.accept_token(t) and xm.accept_token(t)):
            res.mismatches.append((text, "accept_token disagrees", t))
            break
        if m.is_terminated():
            res.finished.append(text)
            m.reset()
            xm.reset()
            text = b""
        else:
            text += vocab.token_bytes[t]
    return res


def compile_both(vocab: TokenVocab, kind: str, spec, max_whitespace: int | None = None):
    """(ours, theirs, our compile ms, their compile ms) for kind 'regex', 'json' or 'grammar'."""
    import xgrammar as xgr  # lazy: optional dependency (the dev extra), only the peer needs it

    ours_c = GrammarCompiler(vocab, max_whitespace=max_whitespace, xgrammar_strings=True)
    theirs_c = xgr.GrammarCompiler(xgrammar_tokenizer_info(vocab), max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    if kind == "regex":
        theirs = theirs_c.compile_regex(spec)
    elif kind == "grammar":
        theirs = theirs_c.compile_grammar(spec)
    else:
        theirs = theirs_c.compile_json_schema(json.dumps(spec), any_whitespace=max_whitespace is not None,
                                              max_whitespace_cnt=max_whitespace)
    their_ms = (time.perf_counter() - t0) * 1e3
    ours = ours_c.compile(StructuredOutputsParams(**{kind: spec}))
    return ours, theirs, ours.compile_ms, their_ms


def main(steps: int = 1000, seed: int = 0) -> None:
    from ..tokenizer import load_tokenizer  # lazy: loads the embedded model's files, only for the table

    vocab = TokenVocab.from_tokenizer(load_tokenizer())
    print(f"vocabulary: {vocab.vocab_size} tokens; {steps} random-walk steps per grammar")
    print(f"{'grammar':<42} {'compile ms':>16} {'mask us p50':>14} {'mask us p99':>14}  equal")
    print(f"{'':<42} {'ours / xgr':>16} {'ours / xgr':>14} {'ours / xgr':>14}")
    cases = [("regex", p, None) for p in PARITY_REGEXES]
    cases += [("json", s, ws) for s in PARITY_SCHEMAS.values() for ws in (None, 2)]
    cases += [("grammar", g, None) for g in PARITY_GRAMMARS.values()]
    names = list(PARITY_REGEXES) + [f"json {n} ws={ws}" for n in PARITY_SCHEMAS for ws in (None, 2)]
    names += [f"gbnf {n}" for n in PARITY_GRAMMARS]
    for name, (kind, spec, ws) in zip(names, cases):
        ours, theirs, oms, tms = compile_both(vocab, kind, spec, ws)
        r = parity_walk(ours, theirs, steps, random.Random(seed))
        print(f"{name[:42]:<42} {oms:>7.1f} / {tms:>6.1f} {r.p('ours_us', 50):>6.1f} / {r.p('theirs_us', 50):>5.1f} "
              f"{r.p('ours_us', 99):>6.1f} / {r.p('theirs_us', 99):>5.1f}  {'yes' if not r.mismatches else r.mismatches[:1]}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
