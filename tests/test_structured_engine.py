"""Structured output through the engine (chapter 14): the worker's one mask point applies each request's
grammar, so every output is in the grammar's language, whatever the sampling and the batch.

Oracles: Python's `re.fullmatch`, `jsonschema` and the list of choices on every output; the requests
without a grammar in the same batch get exactly their tokens alone; a constrained greedy token is the
argmax of the raw logits over the grammar's allowed set (a plain-PyTorch reference).
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from tiny_models import random_model

from minillm.engine import EngineConfig, LLMEngine
from minillm.sampling import SamplingParams
from minillm.structured_output import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
REGEXES = [r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"]
CHOICES = ["Paris", "London", "Rome"]


def _engine(rng, tok):
    model, _ = random_model(rng, vocab_size=len(tok.vocab))  # the real vocabulary: grammars meet BPE tokens
    return LLMEngine(model, tok, [tok.eos_token_id], EngineConfig(block_size=8, num_gpu_blocks=256)), model


def _drain(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    return outs


def _valid(kind, spec, text) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    try:
        jsonschema.validate(json.loads(text), spec)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.slow
def test_every_output_follows_its_grammar_in_a_mixed_batch(seed, tok):
    """Regexes, a choice and a JSON Schema; greedy, seeded sampling and n = 2; beside free requests."""
    rng = random.Random(seed)
    engine, _ = _engine(rng, tok)
    cases = [("regex", r) for r in REGEXES] + [("choice", CHOICES), ("json", SCHEMA)]
    free = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    asked = {}
    for i, (kind, spec) in enumerate(cases):
        so = StructuredOutputsParams(**{kind: spec})
        for j, sp in enumerate([SamplingParams(max_tokens=80, temperature=0, structured_outputs=so),
                                SamplingParams(max_tokens=80, temperature=1.0, seed=rng.randrange(1 << 30), n=2,
                                               structured_outputs=so)]):
            engine.add_request(f"s{i}-{j}", "Answer:", sp)
            asked[f"s{i}-{j}"] = (kind, spec)
        engine.add_request(f"f{i}", {"prompt_token_ids": [rng.randrange(1000) for _ in range(5)]}, free)
    outs = _drain(engine)
    for rid, (kind, spec) in asked.items():
        for c in outs[rid].outputs:
            assert c.finish_reason == "stop", (rid, c.text, c.finish_reason)
            assert _valid(kind, spec, c.text), (rid, kind, c.text)
    assert not engine.structured.matchers  # every finished sequence's matcher is gone
    for i in range(len(cases)):  # the free requests got what they get alone
        alone, _ = _engine(random.Random(seed), tok)
        prompt = outs[f"f{i}"].prompt_token_ids
        alone.add_request("a", {"prompt_token_ids": prompt}, free)
        assert _drain(alone)["a"].outputs[0].token_ids == outs[f"f{i}"].outputs[0].token_ids


def test_a_constrained_greedy_token_is_the_argmax_over_the_allowed_set(seed, tok, monkeypatch):
    """The mask point against a reference: each step's raw logits, the matcher's allowed tokens, argmax."""
    rng = random.Random(seed)
    engine, _ = _engine(rng, tok)
    runner, seen = engine.executor.worker.runner, []
    real = runner.execute

    def execute(*args):
        logits = real(*args)
        seen.append(logits.clone())
        return logits

    monkeypatch.setattr(runner, "execute", execute)
    so = StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{2,6}){0,3}")
    engine.add_request("r", "Say:", SamplingParams(max_tokens=40, temperature=0, structured_outputs=so))
    out = _drain(engine)["r"].outputs[0]
    assert re.fullmatch(so.regex, out.text)
    from minillm.structured_output import Matcher

    matcher = Matcher(engine.structured.compile(so, "reference"))
    for logits, token in zip(seen, out.token_ids):
        allowed = torch.from_numpy(matcher.allowed_tokens()).long()
        assert token == int(allowed[logits[-1, allowed].argmax()])
        assert matcher.accept_token(token)


def test_bad_structured_outputs_are_refused_naming_the_field(seed, tok):
    engine, _ = _engine(random.Random(seed), tok)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        engine.add_request("r", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")))
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_outputs={"choice": ["a"]}, ignore_eos=True)
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", "x", SamplingParams(max_tokens=20, temperature=0,
                                                  structured_outputs={"choice": CHOICES}))  # the engine serves on
    assert _drain(engine)["ok"].outputs[0].text in CHOICES
