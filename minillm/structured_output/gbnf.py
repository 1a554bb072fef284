"""GBNF (llama.cpp's grammar dialect) -> Grammar, the subset grammars in the wild use:

    root   ::= object            # comments run to the end of the line
    object ::= "{" ws ( pair ( "," ws pair )* )? "}"
    pair   ::= [a-z]+ ":" ws value
    value  ::= object | [0-9]+ | "\\"" [^"\\n]* "\\""
    ws     ::= [ \\t\\n]{0,4}

Terms: "literals" (escapes \\n \\t \\r \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH), [classes] with ranges and ^,
. (any character), rule names, ( groups ), and the postfix * + ? {m} {m,} {m,n}; alternatives with |.
A rule's body runs until the next `name ::=`. The start rule is `root`. Errors name line and column.
"""

from __future__ import annotations

import re

from . import ir
from .grammar import Grammar
from .regex import _Parser

_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_-]*")
_RULE_START = re.compile(r"([a-zA-Z_][a-zA-Z0-9_-]*)\s*::=")
_ESC = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "/": "/"}


def parse_gbnf(text: str, source: str = "grammar", root: str = "root") -> Grammar:
    if not isinstance(text, str):
        raise ValueError(f"{source} must be a str, not {type(text).__name__}")
    p = _GBNF(text, source)
    rules = p.parse()
    if root not in rules:
        raise ValueError(f"{source}: no rule {root!r} (the start rule)")
    return Grammar(rules, root, source)


class _GBNF:
    def __init__(self, text: str, source: str):
        self.t, self.i, self.source = text, 0, source

    def error(self, msg: str, at: int | None = None) -> ValueError:
        at = self.i if at is None else at
        line = self.t.count("\n", 0, at) + 1
        col = at - (self.t.rfind("\n", 0, at) + 1) + 1
        return ValueError(f"{self.source}: {msg} at line {line}, column {col}")

    def skip(self, newlines: bool = True) -> None:
        while self.i < len(self.t):
            c = self.t[self.i]
            if c == "#":
                j = self.t.find("\n", self.i)
                self.i = len(self.t) if j < 0 else j
            elif c in " \t\r" or (c == "\n" and newlines):
                self.i += 1
            else:
                return

    def parse(self) -> dict:
        rules: dict[str, object] = {}
        self.skip()
        while self.i < len(self.t):
            m = _RULE_START.match(self.t, self.i)
            if not m:
                raise self.error("expected a rule `name ::= ...`")
            name = m.group(1)
            if name in rules:
                raise self.error(f"rule {name!r} is defined twice")
            self.i = m.end()
            rules[name] = self.alternation()
            self.skip()
        if not rules:
            raise self.error("the grammar defines no rules")
        return rules

    def at_rule_start(self) -> bool:
        return bool(_RULE_START.match(self.t, self.i))

    def alternation(self):
        branches = [self.sequence()]
        while self.i < len(self.t) and self.t[self.i] == "|":
            self.i += 1
            branches.append(self.sequence())
        return ir.alt(*branches)

    def sequence(self):
        items = []
        while True:
            self.skip()
            if self.i >= len(self.t) or self.t[self.i] in "|)" or self.at_rule_start():
                return ir.seq(*items) if items else ir.EMPTY
            items.append(self.postfix(self.term()))

    def term(self):
        at, c = self.i, self.t[self.i]
        if c == '"':
            return self.literal()
        if c == "[":
            sub = _Parser(self.t, self.source)
            sub.i = self.i
            try:
                ranges = sub.char_class()
            except ValueError as e:
                raise self.error(str(e).split(" at position")[0].removeprefix(f"{self.source}: "), sub.i) from None
            self.i = sub.i
            return ir.codepoints(ranges)
        if c == ".":
            self.i += 1
            return ir.codepoints([(0, ir.MAX_CP)])
        if c == "(":
            self.i += 1
            node = self.alternation()
            self.skip()
            if self.i >= len(self.t) or self.t[self.i] != ")":
                raise self.error("missing ')'", at)
            self.i += 1
            return node
        m = _NAME.match(self.t, self.i)
        if m:
            self.i = m.end()
            return ir.Ref(m.group())
        raise self.error(f"unexpected {c!r}")

    def literal(self):
        at = self.i
        self.i += 1
        out = []
        while True:
            if self.i >= len(self.t) or self.t[self.i] == "\n":
                raise self.error("unterminated string", at)
            c = self.t[self.i]
            if c == '"':
                self.i += 1
                break
            if c == "\\":
                out.append(self.escape())
                continue
            out.append(c)
            self.i += 1
        return ir.lit("".join(out)) if out else ir.EMPTY

    def escape(self) -> str:
        at = self.i
        c = self.t[self.i + 1 : self.i + 2]
        if c in _ESC:
            self.i += 2
            return _ESC[c]
        n = {"x": 2, "u": 4, "U": 8}.get(c)
        digits = self.t[self.i + 2 : self.i + 2 + n] if n else ""
        if not n or len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise self.error(f"bad escape \\{c}", at)
        self.i += 2 + n
        return chr(int(digits, 16))

    def postfix(self, node):
        while True:
            self.skip(newlines=False)  # as llama.cpp: `x *` is `x*`
            if self.i >= len(self.t):
                return node
            c = self.t[self.i]
            if c in "*+?":
                self.i += 1
                node = ir.Rep(node, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[c])
            elif c == "{":
                at = self.i
                m = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}").match(self.t, self.i)
                if not m:
                    raise self.error("bad repetition", at)
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if hi is not None and hi < lo:
                    raise self.error("repetition has max < min", at)
                self.i = m.end()
                node = ir.Rep(node, lo, hi)
            else:
                return node
