"""Graded hints for the lab exercises: a nudge, then the key idea, then a near-solution.

Each lab's checks module (minillm/labs/chNN.py) holds its hints beside its checks:

    hint = Hints("09", {"ngram_propose": ("nudge", "key idea", "near-solution"), ...})

and the lab notebook has one cell that lists the exercises without revealing anything:

    ch09.hint()                       # which exercises have hints, and how to ask
    ch09.hint("ngram_propose", 1)     # 1: a nudge · 2: the key idea · 3: a near-solution

Hints live in the package, not the notebook, so they stay hidden until a student asks, and the student
notebooks (`minillm labs build`) keep them.
"""

from __future__ import annotations

LEVELS = ("a nudge", "the key idea", "a near-solution")


class Hints:
    def __init__(self, lab: str, hints: dict[str, tuple[str, str, str]]):
        for name, levels in hints.items():
            if len(levels) != len(LEVELS) or not all(isinstance(t, str) and t.strip() for t in levels):
                raise ValueError(f"lab {lab}: {name} needs {len(LEVELS)} non-empty hints ({', '.join(LEVELS)})")
        self.lab, self.hints = lab, hints

    @property
    def exercises(self) -> list[str]:
        return list(self.hints)

    def text(self, exercise: str, level: int = 1) -> str:
        if exercise not in self.hints:
            raise ValueError(f"lab {self.lab} has no exercise {exercise!r}; its exercises: {self.exercises}")
        if level not in range(1, len(LEVELS) + 1):
            raise ValueError(f"hint level must be 1 ({LEVELS[0]}), 2 ({LEVELS[1]}) or 3 ({LEVELS[2]}), got {level!r}")
        return self.hints[exercise][level - 1]

    def __call__(self, exercise: str | None = None, level: int = 1) -> None:
        """Print the hint of `level` for `exercise`, or, with no exercise, the list of exercises."""
        if exercise is None:
            print(f"Lab {self.lab} hints, for when you are stuck: hint(exercise, level) with level 1 ({LEVELS[0]}), "
                  f"2 ({LEVELS[1]}) or 3 ({LEVELS[2]}). Exercises: {', '.join(self.exercises)}")
            return
        text = self.text(exercise, level)  # (checks the name and the level first)
        print(f"💡 {exercise}, hint {level} of {len(LEVELS)} ({LEVELS[level - 1]}):\n{text}")
