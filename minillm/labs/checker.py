"""The machinery behind every lab check: random cases, comparison, a one-line verdict."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

PASSED, SKIPPED_HARDWARE = "passed", "skipped-hardware"


class CheckFailed(AssertionError):
    """The student's function disagrees with minillm's on some input."""


@dataclass
class Verdict:
    name: str
    status: str
    cases: int = 0

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def _ipython_display_(self):
        """The check already printed its one-line verdict; show nothing more in a notebook."""


def _short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _equal(got, want) -> bool:
    import torch

    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)
    if isinstance(want, float):
        return isinstance(got, (int, float)) and abs(got - want) <= 1e-9 * max(1.0, abs(want))
    return got == want


def has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def requires_gpu(name: str) -> Verdict | None:
    """On a machine without a CUDA GPU: say so and return the skip verdict; else None."""
    if has_gpu():
        return None
    print(f"⏭  {name}: needs a CUDA GPU; not run on this CPU machine (not counted as passed)")
    return Verdict(name, SKIPPED_HARDWARE)


def check(
    name: str,
    student: Callable,
    reference: Callable,
    make_case: Callable[[random.Random], tuple],
    *,
    cases: int = 100,
    equal: Callable = _equal,
    seed: int | None = None,
) -> Verdict:
    """Run student(*case) and reference(*case) on `cases` fresh random cases; raise at the first
    disagreement, naming the input, the expected and the actual output."""
    if not callable(student):
        raise TypeError(f"{name}: pass your function itself, not {type(student).__name__}")
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    rng = random.Random(seed)
    for i in range(cases):
        case = make_case(rng)
        want = reference(*case)
        got = student(*case)
        if not equal(got, want):
            raise CheckFailed(
                f"❌ {name}: case {i + 1} of {cases} (seed {seed}) disagrees with minillm\n"
                f"   input:    {_short(case)}\n   expected: {_short(want)}\n   got:      {_short(got)}"
            )
    print(f"✅ {name}: {cases} random cases agree with minillm")
    return Verdict(name, PASSED, cases)
