"""JSON Schema -> grammar (byte-level IR rules), in the subset OpenAI's strict structured outputs use.

The language is the one xgrammar 0.2.9 generates for the same schema, so the two backends' token masks
can be compared set for set:
  * compact whitespace (default): separators ", " and ": ", nothing else; or, with max_whitespace=N,
    up to N of [ \\n\\r\\t] at every place JSON allows whitespace (never unbounded: a small model
    would loop on spaces);
  * properties in the order the schema lists them, the required ones present, the others optional;
    no other properties (additionalProperties is false unless the schema has no properties at all);
  * strings: JSON's escapes, no control characters; with minLength/maxLength or pattern, only plain
    characters (no escapes), as xgrammar does; enum/const: the values as compact JSON text;
  * integers without leading zeros, bounds as a digit-by-digit range; numbers in JSON's form.
Keywords outside the subset are refused by name: silently ignoring one would let the model produce
output the schema forbids.
"""

from __future__ import annotations

import json

from . import ir
from .grammar import Grammar
from .int_range import int_range
from .regex import parse_regex

_IGNORED = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
            "readOnly", "writeOnly"}
_KEYWORDS = {
    None: {"type", "enum", "const", "anyOf", "$ref", "$defs", "definitions"},
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": set(),
    "boolean": set(),
    "null": set(),
}
_FORMATS = ("date", "date-time")

_D = ir.Bytes(ir.byte_range(0x30, 0x39))  # [0-9]
_D19 = ir.Bytes(ir.byte_range(0x31, 0x39))  # [1-9]
_JSON_CHAR = ir.codepoints(ir.negate([(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]))  # not control, ", \
_XGR_CHAR = ir.codepoints(ir.negate([(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)], True), True)
_XGR_BOUNDED_CHAR = ir.codepoints(ir.negate([(0x0A, 0x0A), (0x0D, 0x0D), (0x22, 0x22), (0x5C, 0x5C)], True), True)
_HEX = ir.Bytes(ir.byte_range(0x30, 0x39) | ir.byte_range(0x41, 0x46) | ir.byte_range(0x61, 0x66))
_ESCAPE = ir.seq(ir.lit("\\"), ir.alt(ir.Bytes(ir.byte_mask(b'"\\/bfnrt')), ir.seq(ir.lit("u"), _HEX, _HEX, _HEX, _HEX)))
STRING = ir.seq(ir.lit('"'), ir.Rep(ir.alt(_JSON_CHAR, _ESCAPE), 0, None), ir.lit('"'))
_XGR_STRING = ir.seq(ir.lit('"'), ir.Rep(ir.alt(_XGR_CHAR, _ESCAPE), 0, None), ir.lit('"'))
INTEGER = ir.alt(ir.lit("0"), ir.seq(ir.opt(ir.lit("-")), _D19, ir.Rep(_D, 0, None)))
NUMBER = ir.seq(ir.opt(ir.lit("-")), ir.alt(ir.lit("0"), ir.seq(_D19, ir.Rep(_D, 0, None))),
                ir.opt(ir.seq(ir.lit("."), ir.Rep(_D, 1, None))),
                ir.opt(ir.seq(ir.Bytes(ir.byte_mask(b"eE")), ir.opt(ir.Bytes(ir.byte_mask(b"+-"))), ir.Rep(_D, 1, None))))
BOOLEAN = ir.alt(ir.lit("true"), ir.lit("false"))
NULL = ir.lit("null")

# What jsonschema's format checker accepts (RFC 3339 as Python's datetime reads it): years 0001-9999
# (datetime has no year 0), each month's own last day, 02-29 only in leap years, no leap second.
_YEAR = r"(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"  # /4, not /100 unless /400
DATE = (_YEAR + r"-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
        + "|" + _LEAP_YEAR + "-02-29")
_TIME = r"T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
DATE_TIME = "(" + DATE + ")" + _TIME
# xgrammar 0.2.9's, looser (year 0000, day 31 in every month, second 60): only to compare the backends.
XGR_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
XGR_DATE_TIME = XGR_DATE + r"T([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"


def schema_to_grammar(schema, max_whitespace: int | None = None, source: str = "json schema",
                      xgrammar_strings: bool = False) -> Grammar:
    """A JSON Schema (dict or True) -> Grammar whose root matches exactly the JSON texts described.

    xgrammar_strings: reproduce xgrammar 0.2.9's two departures from valid JSON text, only to compare
    the two backends: minLength/maxLength strings may hold raw control characters other than \\r and
    \\n, and string characters (and a pattern's negated classes) include the surrogates
    U+D800..U+DFFF as the bytes ED A0..BF xx, which no UTF-8 decoder accepts. It also takes
    xgrammar's looser format date/date-time (XGR_DATE: year 0000, 02-31, second 60).
    """
    conv = _Converter(schema, max_whitespace, source)
    conv.xgr = xgrammar_strings
    conv.bounded_char = _XGR_BOUNDED_CHAR if xgrammar_strings else _JSON_CHAR
    conv.string = _XGR_STRING if xgrammar_strings else STRING
    conv.rules["root"] = conv.value(schema, "")
    return Grammar(conv.rules, "root", source)


class _Converter:
    def __init__(self, schema, max_whitespace, source):
        if max_whitespace is not None and (not isinstance(max_whitespace, int) or max_whitespace < 0):
            raise ValueError(f"max_whitespace must be None or an int >= 0, not {max_whitespace!r}")
        self.root, self.source = schema, source
        self.ws = ir.EMPTY if max_whitespace is None else ir.Rep(ir.Bytes(ir.byte_mask(b" \n\r\t")), 0, max_whitespace)
        compact = max_whitespace is None
        self.comma = ir.lit(", ") if compact else ir.seq(self.ws, ir.lit(","), self.ws)
        self.colon = ir.lit(": ") if compact else ir.seq(self.ws, ir.lit(":"), self.ws)
        self.rules: dict[str, object] = {}

    def error(self, path: str, msg: str) -> ValueError:
        return ValueError(f"{self.source}: {msg} at {path or '/'}")

    # ---- any JSON value: the one recursive rule --------------------------------------------------

    def any_value(self):
        if "any" not in self.rules:
            self.rules["any"] = None  # reserve the name: the body refers to itself
            v = ir.Ref("any")
            self.rules["any"] = ir.alt(NUMBER, self.string, BOOLEAN, NULL, self.array_of(v, 0, None),
                                       self.object_of_any(v))
        return ir.Ref("any")

    def object_of_any(self, value):
        member = ir.seq(self.string, self.colon, value)
        return ir.alt(ir.seq(ir.lit("{"), self.ws, member, ir.Rep(ir.seq(self.comma, member), 0, None), self.ws, ir.lit("}")),
                      ir.seq(ir.lit("{"), self.ws, ir.lit("}")))

    def array_of(self, item, lo: int, hi: int | None):
        more = ir.Rep(ir.seq(self.comma, item), max(lo - 1, 0), None if hi is None else hi - 1)
        full = ir.seq(ir.lit("["), self.ws, item, more, self.ws, ir.lit("]"))
        return ir.alt(full, ir.seq(ir.lit("["), self.ws, ir.lit("]"))) if lo == 0 else full

    # ---- a schema --------------------------------------------------------------------------------

    def value(self, s, path: str):
        if s is True or s == {}:
            return self.any_value()
        if s is False or not isinstance(s, dict):
            raise self.error(path, f"a schema must be an object or true, not {json.dumps(s)}")
        if "$ref" in s:
            self.check_keys(s, {"$ref", "$defs", "definitions"}, path)
            return self.ref(s["$ref"], path)
        if "const" in s:
            self.check_keys(s, {"const", "type", "$defs", "definitions"}, path)
            return ir.lit(_dump(s["const"]))
        if "enum" in s:
            self.check_keys(s, {"enum", "type", "$defs", "definitions"}, path)
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise self.error(path, "enum must be a non-empty list")
            return ir.alt(*(ir.lit(_dump(v)) for v in s["enum"]))
        if "anyOf" in s:
            self.check_keys(s, {"anyOf", "$defs", "definitions"}, path)
            if not isinstance(s["anyOf"], list) or not s["anyOf"]:
                raise self.error(path, "anyOf must be a non-empty list")
            return ir.alt(*(self.value(b, f"{path}/anyOf/{i}") for i, b in enumerate(s["anyOf"])))
        t = s.get("type")
        if t is None:
            self.check_keys(s, set(), path)
            return self.any_value()
        types = t if isinstance(t, list) else [t]
        for ty in types:
            if ty not in _KEYWORDS or ty is None:
                raise self.error(path, f"unknown type {ty!r} (allowed: object, array, string, integer, number, boolean, null)")
        self.check_keys(s, set().union(*(_KEYWORDS[ty] for ty in types)), path)
        return ir.alt(*(getattr(self, "t_" + ty)(s, path) for ty in types))

    def check_keys(self, s: dict, allowed: set, path: str) -> None:
        bad = sorted(k for k in s if k not in allowed and k not in _KEYWORDS[None] | _IGNORED)
        extra = sorted(k for k in s if k in _KEYWORDS[None] and k not in allowed and k not in ("type", "$defs", "definitions"))
        bad += [k for k in extra if k not in bad]
        if bad:
            raise self.error(path, f"unsupported JSON Schema keyword(s) {', '.join(bad)} here")

    def ref(self, ref, path: str):
        if not isinstance(ref, str) or not ref.startswith(("#/$defs/", "#/definitions/")):
            raise self.error(path, f"$ref {ref!r} is not supported (only #/$defs/<name> and #/definitions/<name>)")
        section, name = ref[2:].split("/", 1)
        target = self.root.get(section, {}).get(name) if isinstance(self.root, dict) else None
        if target is None:
            raise self.error(path, f"$ref {ref!r} points to nothing")
        rule = f"def:{name}"
        if rule not in self.rules:
            self.rules[rule] = None  # reserve before converting: the definition may refer to itself
            self.rules[rule] = self.value(target, f"/{section}/{name}")
        return ir.Ref(rule)

    def t_null(self, s, path):
        return NULL

    def t_boolean(self, s, path):
        return BOOLEAN

    def t_number(self, s, path):
        return NUMBER

    def t_integer(self, s, path):
        lo, hi = s.get("minimum"), s.get("maximum")
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if k in s and (not isinstance(s[k], (int, float)) or isinstance(s[k], bool) or s[k] != int(s[k])):
                raise self.error(path, f"{k} must be an integer for an integer schema, not {s[k]!r}")
        lo = None if lo is None else int(lo)
        hi = None if hi is None else int(hi)
        if "exclusiveMinimum" in s:
            lo = max(int(s["exclusiveMinimum"]) + 1, lo if lo is not None else -(10**30))
        if "exclusiveMaximum" in s:
            hi = min(int(s["exclusiveMaximum"]) - 1, hi if hi is not None else 10**30)
        if lo is None and hi is None:
            return INTEGER
        if lo is not None and hi is not None and lo > hi:
            raise self.error(path, f"integer range [{lo}, {hi}] is empty")
        return int_range(lo, hi)

    def t_string(self, s, path):
        fmt, pattern = s.get("format"), s.get("pattern")
        if fmt is not None and fmt not in _FORMATS:
            raise self.error(path, f"string format {fmt!r} is not supported (supported: {', '.join(_FORMATS)})")
        if sum(x is not None for x in (fmt, pattern)) + ("minLength" in s or "maxLength" in s) > 1:
            raise self.error(path, "combine at most one of format, pattern and minLength/maxLength")
        q = ir.lit('"')
        if fmt is not None:
            date, date_time = (XGR_DATE, XGR_DATE_TIME) if self.xgr else (DATE, DATE_TIME)
            return ir.seq(q, parse_regex(date if fmt == "date" else date_time), q)
        if pattern is not None:
            body = _restrict(parse_regex(pattern, f"{self.source}: pattern at {path or '/'}", self.xgr))
            return ir.seq(q, body, q)
        if "minLength" in s or "maxLength" in s:
            lo, hi = s.get("minLength", 0), s.get("maxLength")
            if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
                raise self.error(path, f"bad minLength/maxLength {lo}/{hi}")
            if max(lo, hi or 0) > 10_000:
                raise self.error(path, "minLength/maxLength above 10000 are not supported")
            return ir.seq(q, ir.Rep(self.bounded_char, lo, hi), q)
        return self.string

    def t_array(self, s, path):
        items = s.get("items", True)
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int) or hi < lo)):
            raise self.error(path, f"bad minItems/maxItems {lo}/{hi}")
        if hi == 0:
            return ir.seq(ir.lit("["), self.ws, ir.lit("]"))
        return self.array_of(self.value(items, f"{path}/items"), lo, hi)

    def t_object(self, s, path):
        props = s.get("properties")
        addl = s.get("additionalProperties", None)
        if addl not in (None, False) and addl is not True:
            raise self.error(path, "additionalProperties must be false (or true without properties)")
        if props is None and addl is not False:
            if s.get("required"):
                raise self.error(path, "required names properties the schema does not list")
            return self.object_of_any(self.any_value())
        if addl is True:
            raise self.error(path, "additionalProperties: true together with properties is not supported")
        props = props or {}
        required = s.get("required", [])
        missing = [r for r in required if r not in props]
        if missing:
            raise self.error(path, f"required names unknown properties {missing}")
        members = [(ir.seq(ir.lit(_dump(k)), self.colon, self.value(v, f"{path}/properties/{k}")), k in required)
                   for k, v in props.items()]
        open_ = ir.seq(ir.lit("{"), self.ws)
        close = ir.seq(self.ws, ir.lit("}"))
        # The present properties are a subsequence containing every required one; the first present
        # one has no comma before it. Branch on which property comes first.
        branches = []
        for i, (m, req) in enumerate(members):
            rest = [ir.seq(self.comma, mj) if rj else ir.opt(ir.seq(self.comma, mj)) for mj, rj in members[i + 1 :]]
            branches.append(ir.seq(open_, m, *rest, close))
            if req:
                break
        if not any(r for _, r in members):
            branches.append(ir.seq(ir.lit("{"), self.ws, ir.lit("}")))
        return ir.alt(*branches)


def _dump(value) -> str:
    """A const/enum value as JSON text, compact, as xgrammar writes it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _restrict(node):
    """Inside a JSON string a pattern's characters are raw ones: no quote, backslash or control byte
    (xgrammar's json_string mode). Byte sets of single-byte characters lose those bytes."""
    bad = ir.byte_range(0, 0x1F) | ir.byte_mask(b'"\\')
    if isinstance(node, ir.Bytes):
        return ir.Bytes(node.mask & ~bad)
    if isinstance(node, (ir.Seq, ir.Alt)):
        # Only a character's first byte can be ASCII; continuation bytes are >= 0x80 and untouched.
        return type(node)(tuple(_restrict(i) for i in node.items))
    if isinstance(node, ir.Rep):
        return ir.Rep(_restrict(node.item), node.lo, node.hi)
    return node
