"""Structured output over HTTP (chapter 14): OpenAI's response_format (json_object, json_schema) and
vLLM's structured_outputs (json, regex, choice, grammar) on /v1/chat/completions and /v1/completions.

Oracles: `jsonschema` on every JSON output, `re.fullmatch` on every regex output, the list of choices;
a streamed answer's pieces join to the non-streamed answer's text (greedy, same request); a bad
schema, regex or grammar is a 400 whose `param` is the request's own field and whose message carries
the compiler's reason and position, and the server answers the next request; a grammar cut short by
max_tokens ends with finish_reason "length".

The tiny model's EOS is its special token here (serve_utils.make_tiny_eos_model).
"""

from __future__ import annotations

import json
import re

import pytest
from serve_utils import app_client, make_tiny_eos_model

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {
        "type": "array", "items": {"enum": ["a", "bc", "d"]}, "minItems": 1, "maxItems": 3}}, "required": ["ok", "tags"]},
    {"anyOf": [{"type": "integer", "minimum": -50, "maximum": 50}, {"type": "string", "pattern": "[a-z]{2,4}"}]},
    {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": ["x"]}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"type": "null"}}, "required": ["a", "b"]},
]
REGEXES = [r"\d{3}-\d{4}", r"(cat|dog)s?", r"[A-Z][a-z]{1,5}@[a-z]{2,4}\.(com|org)"]
GRAMMAR = 'root ::= item ("," item){0,2}\nitem ::= [a-z]{1,3} | "(" [0-9]{1,2} ")"'
GRAMMAR_RE = r"([a-z]{1,3}|\([0-9]{1,2}\))(,([a-z]{1,3}|\([0-9]{1,2}\))){0,2}"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with app_client(make_tiny_eos_model(tmp_path_factory.mktemp("tiny-so"))) as http:
        yield http


def _post(http, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http, path: str, body: dict) -> tuple[dict[int, str], dict[int, str]]:
    """-> (each choice's text joined from its deltas, each choice's finish_reason)."""
    texts, reasons = {}, {}
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        for c in json.loads(e)["choices"]:
            piece = c["delta"].get("content") if "delta" in c else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c["finish_reason"] is not None:
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons


def _chat(extra: dict) -> dict:
    return {"messages": [{"role": "user", "content": "Describe it."}], "max_tokens": 120, **extra}


@pytest.mark.parametrize(("i", "sampled"), [(0, False)] + [pytest.param(i, True, marks=pytest.mark.slow)
                                                      for i in range(len(SCHEMAS))])
def test_json_schema_outputs_validate_and_stream_the_same(client, i, sampled, seed):
    """Chat with response_format json_schema: greedy (and seeded n = 2) outputs validate; the stream
    joins to the same text; completions takes the same field."""
    schema = SCHEMAS[i]
    rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}}
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": seed, "n": 2})[: 1 + sampled]:
        body = _chat(rf | extra)
        out = _post(client, "/v1/chat/completions", body)
        for c in out["choices"]:
            assert c["finish_reason"] == "stop", c
            jsonschema.validate(json.loads(c["message"]["content"]), schema)
        texts, reasons = _stream(client, "/v1/chat/completions", body)
        assert texts == {c["index"]: c["message"]["content"] for c in out["choices"]}
        assert set(reasons.values()) == {"stop"}
    out = _post(client, "/v1/completions", {"prompt": "JSON:", "max_tokens": 120, "temperature": 0, **rf})
    jsonschema.validate(json.loads(out["choices"][0]["text"]), schema)


@pytest.mark.slow
def test_vllm_structured_outputs_regex_choice_grammar(client, seed):
    cases = [({"regex": r}, lambda t, r=r: re.fullmatch(r, t)) for r in REGEXES]
    cases += [({"choice": ["Paris", "London", "Rome"]}, lambda t: t in ("Paris", "London", "Rome")),
              ({"grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t)),
              ({"json": SCHEMAS[0]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[0]) is None)]
    for so, ok in cases:
        body = {"prompt": "Answer:", "max_tokens": 60, "temperature": 1.0, "seed": seed, "n": 3, "structured_outputs": so}
        out = _post(client, "/v1/completions", body)
        for c in out["choices"]:
            assert c["finish_reason"] == "stop" and ok(c["text"]), (so, c)
        texts, _ = _stream(client, "/v1/completions", body)
        assert texts == {c["index"]: c["text"] for c in out["choices"]}
        chat = _post(client, "/v1/chat/completions", _chat({"structured_outputs": so, "temperature": 0}))
        assert ok(chat["choices"][0]["message"]["content"]), (so, chat)


@pytest.mark.slow
def test_json_object_is_a_json_object_and_text_is_free(client, seed):
    """json_object: any JSON object (the tiny model may wander in it: what finishes parses as a dict,
    what max_tokens cuts still starts as one); type text: no constraint at all."""
    body = _chat({"response_format": {"type": "json_object"}, "temperature": 1.0, "seed": seed, "n": 2,
                  "max_tokens": 60})
    out = _post(client, "/v1/chat/completions", body)
    for c in out["choices"]:
        text = c["message"]["content"]
        assert text.startswith("{")
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
    free = {"temperature": 0, "max_tokens": 8}
    a = _post(client, "/v1/chat/completions", _chat(free | {"response_format": {"type": "text"}}))
    b = _post(client, "/v1/chat/completions", _chat(free))
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def test_a_grammar_cut_by_max_tokens_ends_with_length(client):
    body = {"prompt": "x", "max_tokens": 3, "temperature": 0, "structured_outputs": {"regex": "[a-z]{30,40}"}}
    c = _post(client, "/v1/completions", body)["choices"][0]
    assert c["finish_reason"] == "length" and re.fullmatch("[a-z]+", c["text"])
    _, reasons = _stream(client, "/v1/completions", body)
    assert reasons == {0: "length"}


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format.json_schema.schema", ["unknown type 'strin'", "/properties/a"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                       "patternProperties": {}}}}},
     "response_format.json_schema.schema", ["patternProperties"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", ["missing"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}}},
     "response_format.json_schema.name", ["1 to 64"]),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", ["json_schema"]),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ["json_object", "json_schema"]),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", ["missing ')'", "position 1"]),
    ({"structured_outputs": {"grammar": 'root ::= "a'}}, "structured_outputs.grammar", ["unterminated", "column 10"]),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar", ["undefined rule 'foo'"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["at least one"]),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", ["unknown field", "jsn"]),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", ["exactly one"]),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", ["not both"]),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "structured_outputs.regex", ["ignore_eos"]),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD, ids=[b[1] + "-" + b[2][0][:12] for b in BAD])
def test_bad_specs_are_400s_naming_the_field(client, extra, param, words):
    for path, body in (("/v1/chat/completions", _chat(extra)), ("/v1/completions", {"prompt": "x", **extra})):
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param, error
        for w in words:
            assert w in error["message"], (w, error)
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})  # and it keeps serving
    assert ok.status_code == 200


@pytest.mark.slow
def test_an_engine_core_process_with_the_xgrammar_backend(tmp_path):
    """`minillm serve`'s default: the engine in a child process, the request checked in the API process
    (EngineView's own manager), here with structured_outputs_backend="xgrammar"."""
    folder = make_tiny_eos_model(tmp_path / "m")
    with app_client(folder, engine_core="process", structured_outputs_backend="xgrammar") as http:
        r = http.post("/v1/chat/completions", json=_chat({"structured_outputs": {"regex": "a(b"}}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text
        assert "parenthesis is not closed" in r.json()["error"]["message"]  # xgrammar's own words
        # SCHEMAS[1]: xgrammar 0.2.9 lets raw control characters into maxLength strings (SCHEMAS[0]),
        # which is not JSON text (xgrammar_backend.py)
        rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[1]}}
        out = _post(http, "/v1/chat/completions", _chat({"response_format": rf, "temperature": 0}))
        jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), SCHEMAS[1])


def test_tool_choice_auto_needs_a_template_that_renders_tools(client):
    """This client's template shows no tools to the model: "auto" (also OpenAI's default with tools)
    is a 400 naming tool_choice and the choices that work (vLLM: a 400 without a tool-call parser)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for extra in ({"tool_choice": "auto"}, {}):
        r = client.post("/v1/chat/completions", json=_chat({"tools": tools, **extra}))
        assert r.status_code == 400, r.text
        e = r.json()["error"]
        assert e["param"] == "tool_choice" and "does not render tools" in e["message"] and "required" in e["message"]
    r = client.post("/v1/chat/completions", json=_chat({"tools": tools, "tool_choice": "required", "temperature": 0}))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"], r.text
