"""Argument checks for the package: one place for the "must be a positive int" family of errors.

Every public entry point (configs, caches, the engine, the bench) checks what it is given before it
allocates anything, and says which field was wrong and what is allowed. The texts are part of the
interface: tests and users match on them. The kernels' tensor checks live beside the kernels
(`minillm.kernels.checks`); this module imports nothing of minillm, so anything may use it.
"""

from __future__ import annotations

import math


def is_int(value) -> bool:
    """An int that is not a bool (True is an int in Python, never a size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, low: int = 1, *, optional: bool = False, prefix: str = "") -> None:
    """`value` is an int >= low (or None when optional). low=1 reads "a positive int"."""
    if optional and value is None:
        return
    if is_int(value) and value >= low:
        return
    what = "a positive int" if low == 1 else f"an int >= {low}"
    if optional:
        what = f"None or {what}"
    raise ValueError(f"{prefix}{name} must be {what}, not {value!r}")


def check_float(name: str, value, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False, optional: bool = False) -> None:
    """`value` is a finite real number (int or float, not bool) in the given range."""
    if optional and value is None:
        return
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (low is None or (value > low if low_open else value >= low))
          and (high is None or (value < high if high_open else value <= high)))
    if ok:
        return
    if low is not None and high is not None:
        rng = f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        rng = f" {'>' if low_open else '>='} {low}"
    elif high is not None:
        rng = f" {'<' if high_open else '<='} {high}"
    else:
        rng = ""
    raise ValueError(f"{name} must be {'None or ' if optional else ''}a finite number{rng}, not {value!r}")


def check_choice(name: str, value, choices) -> None:
    """`value` is one of `choices` (compared with ==)."""
    if value not in tuple(choices):
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, not {value!r}")
