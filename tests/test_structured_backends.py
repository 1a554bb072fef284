"""The structured-output backend switch (vLLM's structured_outputs_backend): "minillm" (ours) and
"xgrammar" (the PyPI package) behind the same mask point.

Oracle: random grammars (regexes, choices, JSON schemas, GBNF, written in the subset where both
backends mean the same language: no '.', no negated classes, no free-text strings), a batch of them
beside a free request, greedy, over SmolLM2's real 49,152-token vocabulary: the two engines produce
identical tokens, request for request, and every output is in its language. Also: the flag reaches
EngineConfig, LLM and `minillm serve`; an unknown backend and a missing xgrammar are clear errors.
"""

from __future__ import annotations

import json
import random
import re
import sys

import pytest
from tiny_models import random_model

from minillm.engine import EngineConfig, LLMEngine
from minillm.sampling import SamplingParams
from minillm.structured_output import StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

_L, _H = "abcdefghijklmnopqrstuvwxyz", "0123456789abcdef"
# (a regex, a sampler of its strings)
_PIECES = [
    (r"[a-z]{1,3}", lambda r: "".join(r.choice(_L) for _ in range(r.randint(1, 3)))),
    (r"\d{2}", lambda r: f"{r.randrange(100):02d}"),
    (r"(ab|cd|ef)", lambda r: r.choice(["ab", "cd", "ef"])),
    (r"x?", lambda r: r.choice(["", "x"])),
    (r"[A-Z]", lambda r: r.choice(_L.upper())),
    ("-", lambda r: "-"),
    (r"[0-9a-f]{1,2}", lambda r: "".join(r.choice(_H) for _ in range(r.randint(1, 2)))),
    (r"(yes|no)", lambda r: r.choice(["yes", "no"])),
    (" ", lambda r: " "),
]
_WORDS = ["red", "green", "blue", "a", "ok", "Zed", "é", "42"]


def random_regex(rng: random.Random, with_samples: bool = False):
    pieces = [rng.choice(_PIECES) for _ in range(rng.randint(2, 4))]
    regex = "".join(p for p, _ in pieces)
    return (regex, lambda r: "".join(f(r) for _, f in pieces)) if with_samples else regex


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "boolean", "enum", "pattern", "null"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-20, 20)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 300)}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(1, 3))}
    if kind == "pattern":
        return {"type": "string", "pattern": random_regex(rng)}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    if kind == "object":
        names = rng.sample(["id", "name", "ok", "v", "tags"], rng.randint(1, 3))
        props = {n: random_schema(rng, depth + 1) for n in names}
        return {"type": "object", "properties": props, "required": names, "additionalProperties": False}
    return {"type": kind}


def random_spec(rng: random.Random) -> tuple[str, object]:
    kind = rng.choice(["regex", "choice", "json", "json", "grammar"])
    if kind == "regex":
        return kind, random_regex(rng)
    if kind == "choice":
        return kind, rng.sample(_WORDS, rng.randint(2, 4))
    if kind == "grammar":
        a, b = random_regex(rng), random_regex(rng)  # GBNF writes the same classes and counts
        return kind, f"root ::= part (\",\" part){{0,{rng.randint(0, 2)}}}\npart ::= {_gbnf(a)} | {_gbnf(b)}"
    return kind, {"type": "object", "properties": {"x": random_schema(rng), "y": random_schema(rng)},
                  "required": ["x", "y"], "additionalProperties": False}


def _gbnf(regex: str) -> str:
    """One of our random regexes in GBNF: literals quoted, classes and counts as they are."""
    out = []
    for tok in re.findall(r"\[[^\]]*\](?:\{\d+,\d+\})?|\(\w+(?:\|\w+)*\)|\\d\{2\}|x\?|.", regex):
        if tok == r"\d{2}":
            out.append("[0-9]{2}")
        elif tok == "x?":
            out.append('"x"?')
        elif tok.startswith("("):
            out.append("(" + " | ".join(f'"{w}"' for w in tok[1:-1].split("|")) + ")")
        elif tok.startswith("["):
            out.append(tok)
        else:
            out.append(json.dumps(tok))
    return "(" + " ".join(out) + ")"


def _valid(kind: str, spec, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    if kind == "grammar":
        return True  # its own language: the equality between backends is the check here
    try:
        jsonschema.validate(json.loads(text), spec)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _run(backend: str, seed: int, tok, specs) -> dict[str, tuple[list[int], str, str]]:
    model, _ = random_model(random.Random(seed), vocab_size=len(tok.vocab))
    engine = LLMEngine(model, tok, [tok.eos_token_id], EngineConfig(block_size=8, num_gpu_blocks=256,
                                                                    structured_outputs_backend=backend))
    assert engine.structured.backend == backend
    for i, (kind, spec) in enumerate(specs):
        so = StructuredOutputsParams(**{kind: spec})
        engine.add_request(f"s{i}", "Answer:", SamplingParams(max_tokens=48, temperature=0, structured_outputs=so))
    engine.add_request("free", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8, temperature=0))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0]
    return {rid: (c.token_ids, c.text, c.finish_reason) for rid, c in outs.items()}


@pytest.mark.slow
def test_both_backends_give_identical_greedy_tokens_on_random_grammars(seed, tok):
    rng = random.Random(seed)
    specs = [random_spec(rng) for _ in range(8)]
    ours, theirs = _run("minillm", seed, tok, specs), _run("xgrammar", seed, tok, specs)
    assert ours == theirs, [(specs[int(r[1:])] if r != "free" else r, ours[r], theirs[r]) for r in ours
                            if ours[r] != theirs.get(r)][:2]
    for i, (kind, spec) in enumerate(specs):
        _, text, reason = ours[f"s{i}"]
        if reason == "stop":  # 48 tokens may cut a long one: what finished is in the language
            assert _valid(kind, spec, text), (kind, spec, text)


def test_the_gbnf_translation_means_the_regex(seed):
    """The test's own helper: a random regex and its GBNF accept the same strings (our compiler)."""
    from minillm.structured_output import GrammarCompiler, Matcher, TokenVocab

    vocab = TokenVocab([bytes([b]) for b in range(256)] + [b""], stop_ids=[256])
    compiler, rng = GrammarCompiler(vocab), random.Random(seed)
    for _ in range(10):
        regex, sample = random_regex(rng, with_samples=True)
        compiled = [compiler.compile(StructuredOutputsParams(**so))
                    for so in ({"regex": regex}, {"grammar": f"root ::= {_gbnf(regex)}"})]
        for _ in range(5):
            text = sample(rng)
            for bad, want in ((text, True), (text + "!", False)):
                assert (re.fullmatch(regex, bad) is not None) == want
                for c in compiled:
                    m = Matcher(c)
                    assert (m.accept_string(bad) and m.can_end() if bad else m.can_end()) == want, (regex, bad)


def test_a_small_batch_agrees_between_backends(seed, tok):
    """The fast tier's version: two regexes and a choice."""
    specs = [("regex", r"\d{3}-[a-z]{2}"), ("choice", ["Paris", "Rome"]), ("regex", r"(ab|cd)x?")]
    assert _run("minillm", seed, tok, specs) == _run("xgrammar", seed, tok, specs)


def test_the_backend_is_checked_and_xgrammar_missing_is_named(monkeypatch):
    with pytest.raises(ValueError, match="structured_outputs_backend must be one of 'minillm', 'xgrammar'"):
        EngineConfig(structured_outputs_backend="outlines")
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    with pytest.raises(ImportError, match="needs the Python package xgrammar.*pip install xgrammar"):
        EngineConfig(structured_outputs_backend="xgrammar")
    EngineConfig(structured_outputs_backend="minillm")  # ours needs nothing


def test_serve_takes_the_flag(monkeypatch, capsys):
    from minillm.cli import build_parser, main
    from minillm.entrypoints.openai.cli_args import engine_kwargs

    args = build_parser().parse_args(["serve", "--structured-outputs-backend", "xgrammar"])
    assert engine_kwargs(args)["structured_outputs_backend"] == "xgrammar"
    assert "structured_outputs_backend" not in engine_kwargs(build_parser().parse_args(["serve"]))
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    assert main(["serve", "--structured-outputs-backend", "xgrammar"]) == 2  # before any model loads
    assert "xgrammar" in capsys.readouterr().err
    assert main(["serve", "--structured-outputs-backend", "nope"]) == 2
    assert "structured_outputs_backend" in capsys.readouterr().err
