"""Parity with xgrammar, the peer backend (issue 47): over SmolLM2's 49,152-token vocabulary, along
random walks through every grammar of the parity set (regexes; JSON schemas, compact and with
bounded whitespace; json_object), our allowed-token set equals xgrammar's at every step - more than
10,000 steps in all - and both accept the same tokens. Timings are printed (`pytest -s`), not
asserted: five engineers share two cores here; `python -m minillm.structured_output.peer` is the
measurement."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from minillm.structured_output import TokenVocab
from minillm.structured_output.peer import (
    PARITY_GRAMMARS,
    PARITY_REGEXES,
    PARITY_SCHEMAS,
    compile_both,
    parity_walk,
)

xgr = pytest.importorskip("xgrammar")

STEPS = 420  # x 24 grammars + 200 = 10,280 steps
SHORT = {"lists": 200}  # xgrammar's own mask takes up to ~0.3 s a step on nested lists: keep CI fast
CASES = [("regex", p, None) for p in PARITY_REGEXES] + [
    ("json", name, ws) for name in PARITY_SCHEMAS for ws in (None, 2)] + [("grammar", g, None) for g in PARITY_GRAMMARS]


@pytest.fixture(scope="module")
def vocab(tok):
    return TokenVocab.from_tokenizer(tok)


@pytest.mark.parametrize(("kind", "spec", "ws"), CASES, ids=[f"{k}-{s}-ws{w}" for k, s, w in CASES])
def test_masks_equal_xgrammar(vocab, kind, spec, ws, seed):
    import jsonschema

    schema = PARITY_SCHEMAS[spec] if kind == "json" else None
    text = {"json": schema, "grammar": PARITY_GRAMMARS.get(spec), "regex": spec}[kind]
    ours, theirs, our_ms, their_ms = compile_both(vocab, kind, text, ws)
    steps = SHORT.get(spec, STEPS)
    r = parity_walk(ours, theirs, steps, random.Random(seed))
    print(f"\n{kind} {spec} ws={ws}: compile {our_ms:.1f} ms (xgrammar {their_ms:.1f}); mask p50 "
          f"{r.p('ours_us', 50):.1f} us p99 {r.p('ours_us', 99):.1f} (xgrammar {r.p('theirs_us', 50):.1f} / "
          f"{r.p('theirs_us', 99):.1f}); {len(r.finished)} outputs finished")
    assert not r.mismatches, (seed, r.mismatches[:2])
    assert r.steps == steps
    for text in r.finished:  # what both allowed is in the language
        s = text.decode("utf-8", "surrogatepass")  # xgrammar_strings lets surrogates and controls in
        if kind == "regex":
            assert re.fullmatch(spec, s, re.ASCII), (spec, text)
        elif kind == "json":
            jsonschema.validate(json.loads(s, strict=False), schema)


def test_special_tokens_are_xgrammars_too(vocab):
    """Both backends see the same excluded set: SmolLM2's special tokens (EOS apart)."""
    from minillm.structured_output.peer import xgrammar_tokenizer_info

    info = xgrammar_tokenizer_info(vocab)
    empty = {i for i, b in enumerate(vocab.token_bytes) if not b}
    assert set(info.special_token_ids) | set(info.stop_token_ids) == empty
    assert np.all(vocab.lengths[list(empty)] == 0)


def test_xgrammar_root_recursion_mask_bug(vocab):
    """Documents a peer bug found by the parity walk (xgrammar 0.2.9): with the start rule called
    recursively, after "[[" its mask leaves out "]," although its own accept_token takes it. Ours
    allows it. If this test fails, xgrammar fixed the bug: drop the `root ::= lst` detour in peer.py."""
    from minillm.structured_output import GrammarCompiler, Matcher
    from minillm.structured_output.peer import xgrammar_tokenizer_info
    from minillm.structured_output.token_index import unpack_bits

    g = PARITY_GRAMMARS["lists"].replace("root ::= lst\n", "").replace("lst", "root")
    tid = {b: i for i, b in enumerate(vocab.token_bytes)}
    xm = xgr.GrammarMatcher(xgr.GrammarCompiler(xgrammar_tokenizer_info(vocab), max_threads=1).compile_grammar(g))
    m = Matcher(GrammarCompiler(vocab).compile_grammar(g))
    for t in (b"[", b"["):
        assert xm.accept_token(tid[t]) and m.accept_token(tid[t])
    bm = xgr.allocate_token_bitmask(1, vocab.vocab_size)
    xm.fill_next_token_bitmask(bm)
    assert tid[b"],"] in m.allowed_tokens()
    assert not unpack_bits(bm[0].numpy(), vocab.vocab_size)[tid[b"],"]]  # xgrammar's mask: left out
    assert xm.accept_token(tid[b"],"])  # ... yet accepted


def test_xgrammar_date_admits_year_0000(vocab):
    """Documents a peer departure (xgrammar 0.2.9): its format date takes "0000-01-01", which
    jsonschema refuses (no year 0); ours refuses it. The parity walk compares against our
    xgrammar_strings mode, which copies xgrammar's looser date (XGR_DATE in json_schema.py). If this
    test fails, xgrammar tightened its date: drop XGR_DATE and compare the strict grammar."""
    import jsonschema

    from minillm.structured_output import GrammarCompiler, Matcher
    from minillm.structured_output.peer import xgrammar_tokenizer_info

    schema = {"type": "string", "format": "date"}
    xc = xgr.GrammarCompiler(xgrammar_tokenizer_info(vocab), max_threads=1, cache_enabled=False)
    xm = xgr.GrammarMatcher(xc.compile_json_schema(json.dumps(schema)))
    assert xm.accept_string('"0000-01-01"') and xm.accept_token(vocab.stop_ids[0])  # the whole output, ended
    assert not Matcher(GrammarCompiler(vocab).compile_json_schema(schema)).accept_string('"0000-01-01"')
    assert not jsonschema.FormatChecker().conforms("0000-01-01", "date")
