"""Why the engine core's rows are plain tuples and not NamedTuples (chapter 12, engine_core.py).

    python scripts/row_pickle.py            # 384 one-token rows, as a decode step of 384 requests sends

A NamedTuple would name a row's fields. It pickles nearly as small (the class is written once per
message), but pickle writes an exact tuple in C and a tuple subclass through __reduce_ex__ in Python,
so the core, which pickles every step's rows in the process that drives the GPU, would pay more per
step. This prints the three costs per step for plain tuples, NamedTuples, and NamedTuples built and
rebuilt with tuple.__new__ (the cheapest way to keep names), and the ratio to plain tuples.
"""

from __future__ import annotations

import argparse
import pickle
import timeit
from typing import NamedTuple


class Completion(NamedTuple):
    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None
    stop_reason: str | int | None


class Row(NamedTuple):
    request_id: str
    finished: bool
    error: str | None
    metrics: object
    outputs: list[Completion]


class FastCompletion(Completion):
    __slots__ = ()

    def __reduce__(self):  # rebuilt by tuple.__new__ (C), not the class's generated __new__ (Python)
        return tuple.__new__, (FastCompletion, tuple(self))


class FastRow(Row):
    __slots__ = ()

    def __reduce__(self):
        return tuple.__new__, (FastRow, tuple(self))


def plain(n):
    return [(f"r{i}", False, None, None, [(0, None, [1234], None, None, None, None)]) for i in range(n)]


def named(n):
    return [Row(f"r{i}", False, None, None, [Completion(0, None, [1234], None, None, None, None)]) for i in range(n)]


def named_fast(n):
    new = tuple.__new__
    return [new(FastRow, (f"r{i}", False, None, None, [new(FastCompletion, (0, None, [1234], None, None, None, None))]))
            for i in range(n)]


def per_step_us(fn, number: int = 200) -> float:
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=384, help="rows in one step's message (default 384)")
    n = ap.parse_args().rows
    base = None
    print(f"{n} rows a step; microseconds per step (ratio to plain tuples)")
    print(f"{'rows as':<22}{'bytes':>8}{'build':>16}{'pickle.dumps':>16}{'pickle.loads':>16}")
    for make in (plain, named, named_fast):
        rows = make(n)
        blob = pickle.dumps(rows, pickle.HIGHEST_PROTOCOL)
        costs = (per_step_us(lambda make=make: make(n)),
                 per_step_us(lambda rows=rows: pickle.dumps(rows, pickle.HIGHEST_PROTOCOL)),
                 per_step_us(lambda blob=blob: pickle.loads(blob)))
        base = base or costs
        cells = "".join(f"{c:>8.0f} ({c / b:.1f}x)" for c, b in zip(costs, base))
        print(f"{make.__name__:<22}{len(blob):>8}{cells}")


if __name__ == "__main__":
    main()
