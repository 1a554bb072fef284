"""The workloads of `minillm bench structured` (chapter 14): the grammars it compiles and walks, the
schemas whose outputs it validates, and what each output is checked against.

Compile and mask timings use the parity set of minillm/structured_output/peer.py (regexes, JSON
schemas compact and with bounded whitespace, GBNF grammars), where our masks and xgrammar's are known
to be the same sets, so the two backends are timed on the same work. Validity runs the fixed set plus
fresh random JSON schemas (seeded) through the engine and checks every output with `jsonschema`,
`re.fullmatch` or the list of choices (validity_rows), and replays each output through a fresh
matcher to count the steps whose token lay inside bytes the grammar forced: what jump-forward
decoding could have appended without a forward pass (a bound: it would retokenize the forced bytes).
"""

from __future__ import annotations

import json
import random
import re

from ..sampling import SamplingParams
from ..structured_output import Matcher, StructuredOutputsParams
from ..structured_output.peer import PARITY_GRAMMARS, PARITY_REGEXES, PARITY_SCHEMAS

# The decode-speed workload's constrained requests: a list of records, JSON structure at every few tokens
# (keys, quotes, separators: the states whose masks cost most) and no end before the model chooses one.
PEOPLE_SCHEMA = {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"], "additionalProperties": False}}
PEOPLE_PROMPT = "Write a JSON list of 100 fictional people, each with a name, an age and a city."


def timing_cases(quick: bool) -> list[tuple[str, str, object, int | None]]:
    """(name, kind, spec, max_whitespace) per grammar of the compile/mask table."""
    cases = [(f"regex {p}", "regex", p, None) for p in PARITY_REGEXES]
    cases += [(f"json {n}" + (" ws=2" if ws else ""), "json", s, ws) for n, s in PARITY_SCHEMAS.items() for ws in (None, 2)]
    cases += [(f"gbnf {n}", "grammar", g, None) for n, g in PARITY_GRAMMARS.items()]
    if quick:  # one of each kind, the cheap ones
        keep = {f"regex {PARITY_REGEXES[0]}", "json anyof", "gbnf arith"}
        cases = [c for c in cases if c[0] in keep]
    return cases


def _leaf(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "enum", "integer", "boolean", "null", "date"] + (["array", "object"] if depth < 2 else [])
    k = rng.choice(kinds)
    if k == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(1, 12)}
    if k == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "a b", "x\"y", "é"], rng.randint(1, 4))}
    if k == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if k == "date":
        return {"type": "string", "format": "date"}
    if k == "array":
        return {"type": "array", "items": _leaf(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    if k == "object":
        return random_schema(rng, depth + 1)
    return {"type": k}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema of OpenAI's strict subset: 1-4 properties of bounded size (strings with
    maxLength, integers with bounds, enums, dates, booleans, nulls, short arrays, nested objects)."""
    names = rng.sample(["id", "name", "kind", "size", "when", "tags", "ok", "note", "score", "owner"], rng.randint(1, 4))
    props = {n: _leaf(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def validity_cases(quick: bool, num_random: int, seed: int) -> list[tuple[str, str, object]]:
    """(name, kind, spec): the parity set's regexes and schemas, a choice, and num_random fresh schemas."""
    cases = [(f"regex {p}", "regex", p) for p in PARITY_REGEXES]
    cases += [(f"json {n}", "json", s) for n, s in PARITY_SCHEMAS.items()]
    cases += [("choice", "choice", ["Paris", "London", "Rome", "New York"])]
    if quick:
        cases = [cases[0], cases[len(PARITY_REGEXES) + 2], cases[-1]]  # a regex, anyOf, the choice
    rng = random.Random(seed)
    cases += [(f"random schema {i}", "json", random_schema(rng)) for i in range(num_random)]
    return cases


def is_valid(kind: str, spec, text: str) -> bool:
    """The oracle: jsonschema for JSON, re.fullmatch for a regex, membership for a choice."""
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    import jsonschema  # the dev extra; the bench says so when it is missing

    try:
        jsonschema.validate(json.loads(text), spec, format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def prompt_for(kind: str, spec) -> str:
    if kind == "json":
        return f"Reply with one JSON value that matches this JSON Schema, and nothing else:\n{json.dumps(spec)}"
    if kind == "regex":
        return f"Reply with a string that fully matches the regular expression {spec}"
    return f"Pick one of: {', '.join(spec)}. Which is the capital of France?"


def chat_ids(tok, text: str) -> list[int]:
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    return tok.encode(text)


def validity_rows(engine, tok, cases, max_tokens: int, seed: int) -> dict:
    """Every case twice (greedy; seeded sampling at T = 0.8), all in one batch; each output checked."""
    rng, asked = random.Random(seed), {}
    for i, (name, kind, spec) in enumerate(cases):
        so = StructuredOutputsParams(**{kind: spec})
        for j, sp in enumerate([SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs=so),
                                SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=rng.randrange(1 << 30),
                                               structured_outputs=so)]):
            engine.add_request(f"v{i}-{j}", {"prompt_token_ids": chat_ids(tok, prompt_for(kind, spec))}, sp)
            asked[f"v{i}-{j}"] = (name, kind, spec, so)
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o for o in engine.step(unfinished_outputs=False)}
    finished = valid = steps = skippable = 0
    invalid = []
    for rid, (name, kind, spec, so) in asked.items():
        c = outs[rid].outputs[0]
        done = c.finish_reason == "stop"
        finished += done
        ok = done and is_valid(kind, spec, c.text)
        valid += ok
        if done and not ok:
            invalid.append({"case": name, "text": c.text})
        m = Matcher(engine.structured.compile(so, rid))  # replay: where did the grammar force the bytes?
        for t in c.token_ids:
            forced, tb = m.forced_bytes(), m.compiled.vocab.token_bytes[t] if t < len(m.compiled.vocab.token_bytes) else b""
            steps += 1
            skippable += bool(tb) and forced.startswith(tb)
            m.accept_token(t)
    n = len(asked)
    return {"outputs": n, "cases": len(cases), "finished_pct": 100 * finished / n,
            "valid_pct_of_finished": 100 * valid / max(1, finished), "invalid": invalid[:5],
            "jump_forward_steps_pct": 100 * skippable / max(1, steps), "output_tokens": steps}
