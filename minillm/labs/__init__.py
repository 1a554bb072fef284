"""Lab checks: a student's function against minillm's own, on fresh random inputs.

Each chapter's lab notebook calls checks from `minillm.labs.chNN`. A check prints one line:

    ✅ merge_pair: 200 random cases agree with minillm
    ⏭  flash_tile: needs a CUDA GPU; not run on this CPU machine (not counted as passed)

and raises CheckFailed (an AssertionError) with the first failing case otherwise, so a wrong answer
fails the notebook under nbval. `minillm labs build` writes the student notebooks from the solutions.
"""

from .checker import CheckFailed, Verdict, check, requires_gpu

__all__ = ["CheckFailed", "Verdict", "check", "requires_gpu"]
