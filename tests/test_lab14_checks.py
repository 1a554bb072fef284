"""Lab 14's checks pass the lab's solutions and catch the slips a student makes: EOS allowed in every state,
a token judged by its first byte, the bits packed in the wrong order; a mask that writes -1e9 instead of
-inf, or masks the padded columns past the bitmask. And the hook the checks plug the student's rows in
through (CompiledGrammar.set_index_rows) refuses what it cannot serve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from structured_output_utils import tiny_vocab

from minillm.labs import CheckFailed, ch14
from minillm.labs.student import solution_namespace
from minillm.structured_output import GrammarCompiler, Matcher, StructuredOutputsParams
from minillm.structured_output.token_index import BITS

LAB = Path(__file__).resolve().parent.parent / "notebooks" / "labs" / "14_structured_output.py"


@pytest.fixture(scope="module")
def ns() -> dict:
    return solution_namespace(LAB)


def test_set_index_rows_is_what_the_matcher_serves():
    vocab = tiny_vocab()
    compiled = GrammarCompiler(vocab).compile(StructuredOutputsParams(regex=r"[a-z]+[0-9]"))
    m = Matcher(compiled)
    before = m.allowed_tokens()
    assert len(before) > 1
    rows = compiled.index.acc.copy()
    t = int(before[0])
    rows[compiled.pda.start, t >> 5] &= ~BITS[t & 31]
    compiled.set_index_rows(rows)
    assert t not in Matcher(compiled).allowed_tokens() and len(Matcher(compiled).allowed_tokens()) == len(before) - 1
    with pytest.raises(ValueError, match="int32 array of shape"):
        compiled.set_index_rows(rows[:1])
    with pytest.raises(ValueError, match="without calls"):
        GrammarCompiler(vocab).compile(StructuredOutputsParams(json={"type": "object"})).set_index_rows(rows)


@pytest.mark.slow
def test_solutions_pass(ns):
    assert ch14.check_dfa_token_bitmask(ns["dfa_token_bitmask"], cases=3).passed
    assert ch14.check_apply_bitmask(ns["apply_bitmask"], cases=8).passed


@pytest.mark.slow
@pytest.mark.parametrize("slip", ["eos everywhere", "first byte only", "big-endian bits"])
def test_token_bitmask_slips_fail(ns, slip):
    right = ns["dfa_token_bitmask"]

    def slipped(trans, final, state, token_bytes, stop_ids):
        if slip == "eos everywhere":
            return right(trans, np.ones_like(final), state, token_bytes, stop_ids)
        if slip == "first byte only":
            return right(trans, final, state, [b[:1] for b in token_bytes], stop_ids)
        row = right(trans, final, state, token_bytes, stop_ids)
        return np.packbits(np.unpackbits(row.view(np.uint8), bitorder="little"), bitorder="big").view("<i4")

    with pytest.raises(CheckFailed):
        ch14.check_dfa_token_bitmask(slipped, cases=6)


@pytest.mark.slow
@pytest.mark.parametrize("slip", ["-1e9", "masks the padding"])
def test_apply_slips_fail(ns, slip):
    def slipped(logits, bitmask):
        if slip == "-1e9":
            return torch.where(torch.isinf(ns["apply_bitmask"](logits.clone(), bitmask)), -1e9, logits)
        wide = torch.cat([bitmask, torch.zeros_like(bitmask[:, :1])], dim=1)  # one more word: all disallowed
        return ns["apply_bitmask"](logits, wide)

    with pytest.raises(CheckFailed):
        ch14.check_apply_bitmask(slipped, cases=20)
