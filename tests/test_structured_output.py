"""Chapter 14's compiler: StructuredOutputsParams validation; regex -> DFA agrees with Python's `re`;
the token index (vectorized walk + context-independent/-dependent split) agrees with a brute-force
walk of every token at every step; every finished JSON output validates with `jsonschema`; EOS only in
accepting states; rollback; the compile cache; clear errors naming the field, position or keyword."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from structured_output_utils import EOS, allowed, brute_force_allowed, pick, tiny_vocab

from minillm.structured_output import (
    Grammar,
    GrammarCompiler,
    Matcher,
    StructuredOutputsParams,
    allocate_token_bitmask,
    apply_token_bitmask,
    compile_grammar,
    fill_bitmasks,
    ir,
    parse_regex,
)
from minillm.structured_output.automaton import compile_dfa

REGEXES = [
    r"\d{3}-\d{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]+ [A-Z][a-z]*", r"\w+@\w+\.(com|org)", r"a.{0,3}b",
    r"[^a-c]{2,4}", r"(ab|a)*c{,3}", r"x?y+z*", r"[\d\s.]+", r"é[α-ω]{1,2}|😀+", r"\(\d+\)|\[\w\]", r"^(-?\d+(\.\d+)?)$",
    r"[\x41-\x43\u00e9]+", r"a{2}b{1,}c{0,1}",
]

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 4},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}}},
    {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
    {"anyOf": [{"type": "string", "enum": ["x", "yz"]}, {"type": "integer", "exclusiveMinimum": -3, "maximum": 12}]},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                      "p": {"type": "string", "pattern": "[a-z]{2}[0-9]?"}, "n": {"type": "null"}},
     "required": ["d", "p"]},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                                  "maxItems": 2}},
                        "required": ["v", "kids"]}}, "$ref": "#/$defs/node"},
    {"type": "object"},
    {"type": ["string", "null"], "const": "a\"b"},
    {},
]


# ---- params ---------------------------------------------------------------------------------------


def test_params_exactly_one():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="exactly one .* got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="json and regex"):
        StructuredOutputsParams(json={"type": "string"}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice must be a list of strings"):
        StructuredOutputsParams(choice="abc")
    with pytest.raises(ValueError, match="choice must name at least one"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="regex must be a str"):
        StructuredOutputsParams(regex=3)


# ---- regex -> DFA ---------------------------------------------------------------------------------


def _sample(dfa, rng) -> bytes:
    """A random string of the DFA's language (a walk that stops at final states now and then)."""
    out, s = bytearray(), dfa.start
    for _ in range(40):
        if dfa.final[s] and rng.random() < 0.3:
            return bytes(out)
        nxt = np.nonzero(dfa.trans[s] >= 0)[0]
        if not len(nxt):
            break
        b = int(rng.choice(nxt))
        out.append(b)
        s = int(dfa.trans[s, b])
    return bytes(out) if dfa.final[s] else b""


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_dfa_equals_re_fullmatch(pattern, seed):
    rng = np.random.default_rng(seed)
    dfa = compile_dfa(parse_regex(pattern))
    chars = sorted(set(re.sub(r"\\.", "", pattern)) | set("ab1 -.xé"))
    strings = ["".join(rng.choice(chars, size=rng.integers(0, 7))) for _ in range(1500)]
    for _ in range(300):  # members of the language too, or the test only sees rejections
        try:
            strings.append(_sample(dfa, rng).decode("utf-8"))
        except UnicodeDecodeError:
            pytest.fail(f"{pattern!r}: the DFA accepts invalid UTF-8")
    for s in strings:
        want = re.fullmatch(pattern, s, re.ASCII) is not None
        assert dfa.fullmatch(s.encode()) == want, (pattern, s, want, seed)


def test_dfa_is_minimal_and_pruned():
    assert compile_dfa(parse_regex("(a|b)*abb")).num_states == 4  # the textbook example
    with pytest.raises(ValueError, match="matches no string"):
        compile_dfa(ir.seq(ir.lit("a"), ir.Alt(())))


@pytest.mark.parametrize(("pattern", "msg"), [
    (r"(a", "missing '\\)' at position 0"), (r"a)", "unbalanced"), (r"*a", "nothing to repeat at position 0"),
    (r"(?=a)b", "lookaround"), (r"(a)\1", "backreferences not supported at position 3"), (r"\bx", r"\\b"),
    (r"[b-a]", "bad character range"), (r"a{3,2}", "max < min"), (r"[abc", "unterminated"), ("a$b", "'\\$'"),
    (r"a{5000}", "larger than"),
])
def test_regex_errors_name_the_position(pattern, msg):
    with pytest.raises(ValueError, match=msg):
        parse_regex(pattern)


# ---- the token index ------------------------------------------------------------------------------


def _walk_and_check(compiled, rng, steps, on_done=None):
    m = Matcher(compiled)
    text, vocab = b"", compiled.vocab
    for _ in range(steps):
        got, want = allowed(m), brute_force_allowed(m)
        assert np.array_equal(got, want), (compiled.source, text, set(got) ^ set(want))
        if not len(got):
            raise AssertionError(f"dead end after {text!r}: a co-reachable automaton never has one")
        t = pick(rng, got, vocab, vocab.stop_ids)
        assert m.accept_token(t)
        if m.is_terminated():
            if on_done:
                on_done(text)
            m.reset()
            text = b""
        else:
            text += vocab.token_bytes[t]


@pytest.fixture(scope="module")
def vocab():
    return tiny_vocab()


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_index_equals_brute_force(vocab, pattern, seed):
    done = []
    compiled = GrammarCompiler(vocab).compile_regex(pattern)
    _walk_and_check(compiled, random.Random(seed), 60, done.append)
    for text in done:
        assert re.fullmatch(pattern, text.decode("utf-8"), re.ASCII), (pattern, text)


@pytest.mark.parametrize("ws", [None, 2])
@pytest.mark.parametrize("k", range(len(SCHEMAS)))
def test_json_index_equals_brute_force_and_outputs_validate(vocab, k, ws, seed):
    import jsonschema

    schema = SCHEMAS[k]
    compiled = GrammarCompiler(vocab, max_whitespace=ws).compile_json_schema(schema)
    done = []
    _walk_and_check(compiled, random.Random(seed + k), 150, done.append)
    for text in done:
        value = json.loads(text.decode("utf-8"))
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())  # format date too
        if ws is None:  # compact: exactly the separators ", " and ": ", nothing else
            bare = re.sub(r'"(\\.|[^"\\])*"', '""', text.decode())  # string contents removed
            assert not re.search(r"[\n\r\t]|(?<![,:]) | {2}", bare), text


def test_choice_and_json_object(vocab, seed):
    c = GrammarCompiler(vocab)
    done = []
    _walk_and_check(c.compile(StructuredOutputsParams(choice=["yes", "no", "maybe so"])), random.Random(seed), 40,
                    done.append)
    assert done and all(d in (b"yes", b"no", b"maybe so") for d in done)
    done = []
    _walk_and_check(c.compile(StructuredOutputsParams(json_object=True)), random.Random(seed), 200, done.append)
    assert all(isinstance(json.loads(d), dict) for d in done)


def test_eos_only_in_accepting_states_and_rollback(vocab):
    c = GrammarCompiler(vocab).compile_regex("ab|abc")
    m = Matcher(c)
    assert EOS not in allowed(m) and not m.accept_token(EOS)
    a, b, cc = (vocab.token_bytes.index(x) for x in (b"a", b"b", b"c"))
    assert m.accept_token(a) and m.accept_token(b)
    assert EOS in allowed(m) and cc in allowed(m)
    assert m.accept_token(cc) and list(allowed(m)) == [EOS]
    m.rollback(2)
    assert not m.accept_token(cc) and m.accept_token(b)
    assert m.accept_token(EOS) and m.is_terminated() and list(allowed(m)) == [EOS]
    m.rollback(1)
    assert not m.is_terminated()
    with pytest.raises(ValueError, match="cannot roll back 5"):
        m.rollback(5)


def test_compile_cache_by_hash(vocab):
    c = GrammarCompiler(vocab)
    a = c.compile_json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = c.compile(StructuredOutputsParams(json='{"type": "object", "properties": {"x": {"type": "integer"}}}'))
    assert a is b and c.hits == 1 and c.misses == 1
    assert c.compile_json_schema({"type": "object", "properties": {"y": {"type": "integer"}}}) is not a


def _date_candidates(rng):
    """Every month 00..13 x day 00..32 for the years where the calendar turns (0000, leap years, the
    centuries) and a few random ones: the strings a walk through [0-9]{4}-[01][0-9]-[0-3][0-9] meets."""
    years = [0, 1, 4, 99, 100, 400, 1900, 2000, 2023, 2024, 9999] + rng.sample(range(10000), 6)
    return [f"{y:04d}-{m:02d}-{d:02d}" for y in years for m in range(14) for d in range(33)]


@pytest.mark.parametrize("fmt", ["date", "date-time"])
def test_format_date_accepts_exactly_what_jsonschema_accepts(vocab, fmt, seed):
    """The GPU run's validity assert found "0000-01-01" (Python's datetime has no year 0). Over every
    month/day of the years where the calendar turns, the matcher accepts a date exactly when
    jsonschema's format checker does: years 0001-9999, each month's last day, 02-29 in leap years."""
    import jsonschema

    checker = jsonschema.FormatChecker()
    compiled = GrammarCompiler(vocab).compile_json_schema({"type": "string", "format": fmt})
    rng = random.Random(seed)
    suffixes = ["T00:00:00Z", "T23:59:60Z", "T12:30:05.25+05:30"] if fmt == "date-time" else [""]
    wrong = []
    for date in _date_candidates(rng):
        s = date + rng.choice(suffixes)
        m = Matcher(compiled)
        ours = m.accept_string(json.dumps(s)) and m.can_end()
        if ours != checker.conforms(s, fmt):
            wrong.append((s, ours))
    assert not wrong, wrong[:5]
    for s in ("0001-01-01", "9999-12-31", "2024-02-29"):  # the edges, named
        s += "T00:00:00Z" if fmt == "date-time" else ""
        m = Matcher(compiled)
        assert m.accept_string(json.dumps(s)) and m.can_end() and checker.conforms(s, fmt), s
    assert not Matcher(compiled).accept_string('"0000-01-01'), "year 0000 must be refused"


@pytest.mark.parametrize(("schema", "msg"), [
    ({"type": "string", "format": "email"}, "format 'email' is not supported"),
    ({"type": "object", "properties": {"a": {"type": "string", "contentEncoding": "x"}}}, "contentEncoding .* /properties/a"),
    ({"allOf": [{"type": "string"}]}, "keyword.* allOf"),
    ({"type": "object", "properties": {}, "patternProperties": {}}, "patternProperties"),
    ({"type": "integer", "minimum": 1.5}, "minimum must be an integer"),
    ({"type": "number", "minimum": 0}, "minimum"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "unknown properties"),
    ({"type": "tuple"}, "unknown type 'tuple'"),
    ({"type": "string", "pattern": "(a"}, "pattern at /.*position 0"),
])
def test_unsupported_schema_refused_by_name(vocab, schema, msg):
    with pytest.raises(ValueError, match=msg):
        GrammarCompiler(vocab).compile_json_schema(schema)


def test_grammar_errors():
    with pytest.raises(ValueError, match="undefined rule 'b'"):
        compile_grammar(Grammar({"root": ir.Ref("b")}))
    with pytest.raises(ValueError, match="left-recursive"):
        compile_grammar(Grammar({"root": ir.alt(ir.seq(ir.Ref("root"), ir.lit("x")), ir.lit("y"))}))


def test_real_vocabulary_regex_and_json(tok, seed):
    """SmolLM2's 49,152 tokens: the index equals the brute force along a short walk."""
    from minillm.structured_output import TokenVocab

    vocab = TokenVocab.from_tokenizer(tok)
    assert vocab.vocab_size == 49152 and all(not vocab.token_bytes[i] for i in tok.special_ids)
    c = GrammarCompiler(vocab)
    for spec in (StructuredOutputsParams(regex=r"[A-Z][a-z]+, \d{2}"), StructuredOutputsParams(json=SCHEMAS[5])):
        _walk_and_check(c.compile(spec), random.Random(seed), 8)


# ---- the bitmask ----------------------------------------------------------------------------------


def test_apply_token_bitmask_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    B, V = 5, 100
    logits = torch.randn(B, V, generator=g)
    allowed_ = torch.rand(B, V, generator=g) < 0.3
    bitmask = torch.zeros(B, (V + 31) // 32, dtype=torch.int32)
    for b, v in allowed_.nonzero().tolist():
        bitmask[b, v // 32] |= torch.tensor(1 << (v % 32)).to(torch.int32) if v % 32 != 31 else torch.tensor(-(2**31), dtype=torch.int32)
    want = torch.where(allowed_, logits, torch.tensor(float("-inf")))
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask), want)
    rows = [1, 3]
    got = apply_token_bitmask(logits.clone(), bitmask[rows], indices=rows)
    assert torch.equal(got[rows], want[rows]) and torch.equal(got[[0, 2, 4]], logits[[0, 2, 4]])


def test_fill_bitmasks_batch(vocab):
    m = Matcher(GrammarCompiler(vocab).compile_regex("ab"))
    bm = allocate_token_bitmask(2, vocab.vocab_size)
    fill_bitmasks([m, None], bm)
    assert (bm[1] == -1).all()
    logits = torch.zeros(2, vocab.vocab_size)
    apply_token_bitmask(logits, bm)
    prefixes = [t for t, b in enumerate(vocab.token_bytes) if b and b"ab".startswith(b)]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == prefixes
    assert torch.isfinite(logits[1]).all()


# ---- GBNF -----------------------------------------------------------------------------------------

GBNF = {
    "arith": 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"',
    "lists": 'root ::= lst\nlst ::= "[" (item ("," " "? item)*)? "]"\nitem ::= [a-c]{1,3} | lst',
    "json-ish": r'''root ::= obj   # a comment
obj ::= "{" (pair ("," pair)*)? "}"
pair ::= "\"" [a-z]+ "\"" ":" val
val ::= obj | "\"" [^"\\\x00-\x1f]* "\"" | [0-9]+ | "true" | "\u00e9"''',
}


@pytest.mark.parametrize("name", GBNF)
def test_gbnf_index_equals_brute_force(vocab, name, seed):
    compiled = GrammarCompiler(vocab).compile_grammar(GBNF[name])
    _walk_and_check(compiled, random.Random(seed), 120)


def test_gbnf_regular_grammar_equals_its_regex(seed):
    """A GBNF grammar without recursion is one DFA: the same one as the equivalent regex."""
    from minillm.structured_output.gbnf import parse_gbnf

    g = parse_gbnf('root ::= word (" " word){0,2} "!"?\nword ::= [a-c]+ | "x" [0-9]')
    pda = compile_grammar(g)
    dfa = compile_dfa(parse_regex(r"([a-c]+|x[0-9])( ([a-c]+|x[0-9])){0,2}!?"))
    assert not pda.has_calls
    rng = random.Random(seed)
    for _ in range(2000):
        s = "".join(rng.choice("abcx01 !") for _ in range(rng.randint(0, 8))).encode()
        assert pda.fullmatch(s) == dfa.fullmatch(s), s


@pytest.mark.parametrize(("text", "msg"), [
    ('root ::= "a', "unterminated string at line 1, column 10"),
    ('root ::= "a"\nroot ::= "b"', "defined twice at line 2"),
    ('foo ::= "a"', "no rule 'root'"),
    ('root ::= ( "a"', "missing '\\)' at line 1, column 10"),
    ('root ::= "a" {3,1}', "max < min"),
    ('root ::= [b-a]', "bad character range b-a at line 1"),
    ("root ::= x\n", "undefined rule 'x'"),
    ('root ::= "\\q"', "bad escape"),
    ("just text", "expected a rule"),
])
def test_gbnf_errors_name_line_and_column(vocab, text, msg):
    with pytest.raises(ValueError, match=msg):
        GrammarCompiler(vocab).compile_grammar(text)


def test_forced_bytes_for_jump_forward(vocab):
    c = GrammarCompiler(vocab)
    m = Matcher(c.compile_json_schema({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "null"}},
                                       "required": ["name", "n"]}))
    assert m.forced_bytes() == b'{"name": "'
    assert m.accept_string('{"name": "x"') and m.forced_bytes() == b', "n": null}'
    assert Matcher(c.compile_regex("ab|ac")).forced_bytes() == b"a"
    assert Matcher(c.compile_regex("a|ab")).forced_bytes() == b"a"  # then it may end: stop there
