"""A regular expression (a practical subset of Python's `re` syntax) -> the byte-level IR.

Supported: literals; escapes (\\n \\t \\r \\f \\v \\0 \\xHH \\uHHHH and escaped metacharacters); classes
[...] with ranges and negation; . (any character but a newline, as `re`); \\d \\w \\s and their negations
(ASCII meaning, as `re.ASCII`: a constrained model should not be steered into Arabic digits by \\d);
groups (...), (?:...), (?P<name>...); alternation; * + ? {m} {m,} {m,n} (the lazy forms mean the same
language); ^ at the start and $ at the end (the whole output must match anyway, so they are implied).

Everything else (backreferences, lookaround, \\b, flags, possessive quantifiers) is refused with a
ValueError that names the position, because a regex we silently misread would constrain the model to
the wrong language.
"""

from __future__ import annotations

import re

from . import ir

_COUNTED = re.compile(r"\{(\d*)(,(\d*))?\}")

MAX_REPEAT = 1000  # {m,n} is unrolled into copies; past this the automaton gets large for no use

_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a"}


def parse_regex(pattern: str, what: str = "regex", keep_surrogates: bool = False):
    """pattern -> IR expression. `what` names the field in error messages; keep_surrogates lets
    negated classes and '.' hold U+D800..U+DFFF as xgrammar's do (see json_schema.py)."""
    if not isinstance(pattern, str):
        raise ValueError(f"{what} must be a str, not {type(pattern).__name__}")
    return _Parser(pattern, what, keep_surrogates).parse()


class _Parser:
    def __init__(self, pattern: str, what: str, keep_surrogates: bool = False):
        self.p, self.i, self.what, self.keep = pattern, 0, what, keep_surrogates

    def error(self, msg: str, at: int | None = None):
        at = self.i if at is None else at
        return ValueError(f"{self.what}: {msg} at position {at} of {self.p!r}")

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        node = self.alternation()
        if self.i < len(self.p):
            raise self.error("unbalanced ')'" if self.peek() == ")" else f"unexpected {self.peek()!r}")
        return node

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return ir.alt(*branches)

    def sequence(self):
        items = []
        while self.peek() is not None and self.peek() not in "|)":
            if self.peek() == "$":
                if self.i + 1 == len(self.p) or self.p[self.i + 1] in "|)":
                    self.i += 1
                    continue
                raise self.error("'$' is only supported at the end")
            items.append(self.quantified())
        return ir.seq(*items) if items else ir.EMPTY

    def quantified(self):
        start = self.i
        atom = self.atom()
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and self._is_counted():
                lo, hi = self.counted()
            else:
                return atom
            if self.peek() == "?":  # lazy: the same set of strings
                self.i += 1
            elif self.peek() == "+":
                raise self.error("possessive quantifiers are not supported")
            if isinstance(atom, ir.Rep) and self.p[start] != "(":
                raise self.error("multiple repeat")
            atom = ir.Rep(atom, lo, hi)

    def _is_counted(self) -> bool:
        """Is the '{' here a repetition? As in `re`, otherwise it is a literal brace."""
        m = _COUNTED.match(self.p, self.i)
        return bool(m) and bool(m.group(1) or m.group(3))

    def counted(self):
        at = self.i
        j = self.p.index("}", self.i)
        body = self.p[self.i + 1 : j]
        self.i = j + 1
        lo_s, comma, hi_s = body.partition(",")
        if not lo_s.isdigit() and not (comma and lo_s == ""):
            raise self.error(f"bad repetition {{{body}}}", at)
        lo = int(lo_s) if lo_s else 0
        hi = (int(hi_s) if hi_s else None) if comma else lo
        if hi is not None and hi < lo:
            raise self.error(f"repetition {{{body}}} has max < min", at)
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.error(f"repetition {{{body}}} is larger than {MAX_REPEAT}", at)
        return lo, hi

    def atom(self):
        at, c = self.i, self.peek()
        if c == "(":
            self.i += 1
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i):
                j = self.p.find(">", self.i)
                if j < 0:
                    raise self.error("unterminated group name")
                self.i = j + 1
            elif self.peek() == "?":
                raise self.error(f"group syntax (?{self.p[self.i + 1:self.i + 2]}...) (lookaround, flags, "
                                 "backreferences) is not supported", at)
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("missing ')'", at)
            self.i += 1
            return node
        if c == "[":
            return ir.codepoints(self.char_class(), self.keep)
        if c == ".":
            self.i += 1
            return ir.codepoints(ir.negate([(0x0A, 0x0A)], self.keep), self.keep)
        if c in ("*", "+", "?") or (c == "{" and self._is_counted()):
            raise self.error("nothing to repeat")
        if c == ")":
            raise self.error("unbalanced ')'")
        if c == "\\":
            got = self.escape(in_class=False)
            return ir.codepoints(got, self.keep) if isinstance(got, list) else ir.lit(got)
        self.i += 1
        return ir.lit(c)

    def escape(self, in_class: bool):
        """After a backslash: a character (str) or a class (list of code point ranges)."""
        at = self.i
        self.i += 1
        c = self.peek()
        if c is None:
            raise self.error("trailing backslash", at)
        self.i += 1
        if c.lower() in _CLASS_ESCAPES:
            ranges = _CLASS_ESCAPES[c.lower()]
            return ir.negate(ranges, self.keep) if c.isupper() else list(ranges)
        if c in _SIMPLE_ESCAPES:
            if c == "0" and self.peek() is not None and self.peek().isdigit():
                raise self.error("octal escapes are not supported", at)
            return _SIMPLE_ESCAPES[c]
        if c in ("x", "u", "U"):
            n = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i : self.i + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"\\{c} needs {n} hex digits", at)
            self.i += n
            cp = int(digits, 16)
            # A surrogate may name a class range to leave out ([^a\ud800-\udfff]): classes never
            # hold surrogates anyway. As a character on its own it is not one.
            if cp > ir.MAX_CP or (not in_class and ir.SURROGATES[0] <= cp <= ir.SURROGATES[1]):
                raise self.error(f"\\{c}{digits} is not a Unicode scalar value", at)
            return chr(cp)
        if c.isalnum():
            what = "backreferences" if c.isdigit() else f"the escape \\{c}"
            raise self.error(f"{what} not supported", at)
        return c  # an escaped metacharacter or punctuation: itself

    def char_class(self) -> list[tuple[int, int]]:
        at = self.i
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated character class", at)
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_item()
            if isinstance(lo, list):
                ranges += lo
                continue
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                hi = self.class_item()
                if isinstance(hi, list):
                    raise self.error("a range cannot end in a class escape")
                if ord(hi) < ord(lo):
                    raise self.error(f"bad character range {lo}-{hi}")
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
        return ir.negate(ranges, self.keep) if negated else ranges

    def class_item(self):
        c = self.peek()
        if c == "\\":
            return self.escape(in_class=True)
        if c == "[" and self.p.startswith("[:", self.i):
            raise self.error("POSIX classes [:name:] are not supported")
        self.i += 1
        return c
