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
from minillm.structured_output.peer import PARITY_REGEXES, PARITY_SCHEMAS, compile_both, parity_walk

xgr = pytest.importorskip("xgrammar")

STEPS = 470  # x 22 grammars = 10,340 steps
CASES = [("regex", p, None) for p in PARITY_REGEXES] + [
    ("json", name, ws) for name in PARITY_SCHEMAS for ws in (None, 2)]


@pytest.fixture(scope="module")
def vocab(tok):
    return TokenVocab.from_tokenizer(tok)


@pytest.mark.parametrize(("kind", "spec", "ws"), CASES, ids=[f"{k}-{s}-ws{w}" for k, s, w in CASES])
def test_masks_equal_xgrammar(vocab, kind, spec, ws, seed):
    import jsonschema

    schema = PARITY_SCHEMAS[spec] if kind == "json" else None
    ours, theirs, our_ms, their_ms = compile_both(vocab, kind, schema if kind == "json" else spec, ws)
    r = parity_walk(ours, theirs, STEPS, random.Random(seed))
    print(f"\n{kind} {spec} ws={ws}: compile {our_ms:.1f} ms (xgrammar {their_ms:.1f}); mask p50 "
          f"{r.p('ours_us', 50):.1f} us p99 {r.p('ours_us', 99):.1f} (xgrammar {r.p('theirs_us', 50):.1f} / "
          f"{r.p('theirs_us', 99):.1f}); {len(r.finished)} outputs finished")
    assert not r.mismatches, (seed, r.mismatches[:2])
    assert r.steps == STEPS
    for text in r.finished:  # what both allowed is in the language
        s = text.decode("utf-8", "surrogatepass")  # xgrammar_strings lets surrogates and controls in
        if kind == "regex":
            assert re.fullmatch(spec, s, re.ASCII), (spec, text)
        else:
            jsonschema.validate(json.loads(s, strict=False), schema)


def test_special_tokens_are_xgrammars_too(vocab):
    """Both backends see the same excluded set: SmolLM2's special tokens (EOS apart)."""
    from minillm.structured_output.peer import xgrammar_tokenizer_info

    info = xgrammar_tokenizer_info(vocab)
    empty = {i for i, b in enumerate(vocab.token_bytes) if not b}
    assert set(info.special_token_ids) | set(info.stop_token_ids) == empty
    assert np.all(vocab.lengths[list(empty)] == 0)
