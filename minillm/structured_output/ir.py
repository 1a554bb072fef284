"""The one intermediate form every front-end lowers to: a regular expression over BYTES, plus rule
references (so a grammar is a set of such expressions that may call each other).

Why bytes: the vocabulary of a byte-level BPE model is a list of byte strings, and a token may end in
the middle of a UTF-8 character. An automaton over bytes meets tokens exactly; an automaton over
characters would have to guess how a half character continues. So a character class over Unicode
code points is lowered here to the UTF-8 byte sequences that spell its members.

A byte set is a Python int used as a 256-bit mask (bit b set = byte b allowed): hashable, and union
is `|`.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CP = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not scalar values: UTF-8 cannot spell them
ALL_BYTES = (1 << 256) - 1


@dataclass(frozen=True)
class Bytes:
    """One byte from a set (mask: bit b set = byte b allowed)."""

    mask: int


@dataclass(frozen=True)
class Seq:
    items: tuple


@dataclass(frozen=True)
class Alt:
    items: tuple


@dataclass(frozen=True)
class Rep:
    """item repeated lo..hi times (hi None = unbounded)."""

    item: object
    lo: int
    hi: int | None


@dataclass(frozen=True)
class Ref:
    """A call of another rule of the grammar, by name."""

    name: str


EMPTY = Seq(())


def byte_mask(values) -> int:
    m = 0
    for b in values:
        m |= 1 << b
    return m


def byte_range(lo: int, hi: int) -> int:
    """The mask of bytes lo..hi inclusive."""
    return ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1)


def lit(data: bytes | str) -> Seq | Bytes:
    """A literal string, as its UTF-8 bytes."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if len(data) == 1:
        return Bytes(1 << data[0])
    return Seq(tuple(Bytes(1 << b) for b in data))


def seq(*items):
    flat = []
    for it in items:
        flat.extend(it.items if isinstance(it, Seq) else [it])
    return flat[0] if len(flat) == 1 else Seq(tuple(flat))


def alt(*items):
    return items[0] if len(items) == 1 else Alt(tuple(items))


def opt(item):
    return Rep(item, 0, 1)


# ---- code point ranges -> UTF-8 byte sequences ------------------------------------------------------


def normalize(ranges, keep_surrogates: bool = False) -> list[tuple[int, int]]:
    """Sorted, merged, surrogate-free code point ranges (keep_surrogates: xgrammar's way, see
    json_schema.py; their "UTF-8" bytes ED A0..BF xx are not valid UTF-8)."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    if keep_surrogates:
        return [tuple(r) for r in out]
    cut = []
    for lo, hi in out:  # surrogates are not characters: drop them from every class
        if lo < SURROGATES[0] <= hi or lo <= SURROGATES[1] < hi or SURROGATES[0] <= lo <= hi <= SURROGATES[1]:
            if lo < SURROGATES[0]:
                cut.append((lo, SURROGATES[0] - 1))
            if hi > SURROGATES[1]:
                cut.append((SURROGATES[1] + 1, hi))
        else:
            cut.append((lo, hi))
    return cut


def negate(ranges, keep_surrogates: bool = False) -> list[tuple[int, int]]:
    """All scalar values not in `ranges`."""
    out, nxt = [], 0
    for lo, hi in normalize(ranges, keep_surrogates):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return normalize(out, keep_surrogates)


def _split_utf8(lo: int, hi: int):
    """[lo, hi] (same encoded length) -> lists of per-byte ranges, each list one byte pattern.

    A range like U+0080..U+07FF is not one pattern per byte position in general: the lead byte and the
    continuation bytes depend on each other. Split until, within a piece, every continuation byte runs
    over a full or aligned span (the classic utf8-ranges construction).
    """
    n = len(chr(lo).encode("utf-8"))
    for i in range(1, n):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                yield from _split_utf8(lo, lo | m)
                yield from _split_utf8((lo | m) + 1, hi)
                return
            if hi & m != m:
                yield from _split_utf8(lo, (hi & ~m) - 1)
                yield from _split_utf8(hi & ~m, hi)
                return
    a, b = chr(lo).encode("utf-8", "surrogatepass"), chr(hi).encode("utf-8", "surrogatepass")
    yield [(a[k], b[k]) for k in range(n)]


def codepoints(ranges, keep_surrogates: bool = False):
    """A character class (code point ranges) -> the byte-level expression of its UTF-8 encodings."""
    pieces = []
    for lo, hi in normalize(ranges, keep_surrogates):
        for a, b in ((lo, min(hi, 0x7F)), (max(lo, 0x80), min(hi, 0x7FF)),
                     (max(lo, 0x800), min(hi, 0xFFFF)), (max(lo, 0x10000), hi)):
            if a <= b:
                pieces.extend(_split_utf8(a, b))
    if not pieces:
        raise ValueError("empty character class: it matches nothing")
    one = 0  # all single-byte pieces merge into one byte set
    multi = []
    for p in pieces:
        if len(p) == 1:
            one |= byte_range(*p[0])
        else:
            multi.append(Seq(tuple(Bytes(byte_range(a, b)) for a, b in p)))
    items = ([Bytes(one)] if one else []) + multi
    return alt(*items)
