"""Integers in [lo, hi] as decimal text (no leading zeros, "-" for negatives, no "-0"): a byte-level
expression, built digit by digit the way range regexes are (e.g. 0..150 = 0 | [1-9] | [1-9][0-9] |
1[0-4][0-9] | 150). Either bound may be None (unbounded)."""

from __future__ import annotations

from . import ir

_D = ir.Bytes(ir.byte_range(0x30, 0x39))


def _digit(lo: int, hi: int):
    return ir.Bytes(ir.byte_range(0x30 + lo, 0x30 + hi))


def _same_length(a: str, b: str):
    """All digit strings of len(a) == len(b) between a and b (leading zeros allowed)."""
    if not a:
        return ir.EMPTY
    if a[0] == b[0]:
        return ir.seq(ir.lit(a[0]), _same_length(a[1:], b[1:]))
    n = len(a) - 1
    parts = [ir.seq(ir.lit(a[0]), _same_length(a[1:], "9" * n))]
    if int(b[0]) - int(a[0]) > 1:
        parts.append(ir.seq(_digit(int(a[0]) + 1, int(b[0]) - 1), ir.Rep(_D, n, n)))
    parts.append(ir.seq(ir.lit(b[0]), _same_length("0" * n, b[1:])))
    return ir.alt(*parts)


def _nonneg(lo: int, hi: int | None):
    """Canonical decimals of lo..hi, 0 <= lo, hi None = unbounded."""
    parts = []
    k = len(str(lo))
    top = hi if hi is not None else 10**k - 1
    for d in range(k, len(str(top)) + 1):
        a, b = max(lo, 0 if d == 1 else 10 ** (d - 1)), min(top, 10**d - 1)
        if a <= b:
            parts.append(_same_length(str(a), str(b)))
    if hi is None:  # every longer number
        parts.append(ir.seq(ir.Bytes(ir.byte_range(0x31, 0x39)), ir.Rep(_D, k, None)))
    return ir.alt(*parts)


def int_range(lo: int | None, hi: int | None):
    parts = []
    if lo is None or lo < 0:  # the negative part: "-" then |x| in [max(1, -hi), -lo]
        nlo = 1 if hi is None or hi >= 0 else -hi
        parts.append(ir.seq(ir.lit("-"), _nonneg(nlo, None if lo is None else -lo)))
    if hi is None or hi >= 0:
        parts.append(_nonneg(max(lo or 0, 0), hi))
    return ir.alt(*parts)
