"""Writing the student notebooks: the solution labs with every solution cut out.

In a solution lab, the code a student must write sits between markers:

    def merge_pair(ids, pair, new_id):
        ### BEGIN SOLUTION
        ...the answer...
        ### END SOLUTION

The student version replaces each marked block with `raise NotImplementedError(...)` at the
marker's indentation, and drops all outputs, so the check cells fail until the student fills in
the function. CI runs both versions to prove that every check bites.
"""

from __future__ import annotations

import re
from pathlib import Path

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("your code here")'
CHECK_TAG = "check"  # cells that run a lab check carry this tag


def strip_solutions(source: str) -> str:
    """Replace every BEGIN/END SOLUTION block in a cell's source with a NotImplementedError stub."""
    out, inside = [], False
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r} marker")
            inside = True
            indent = re.match(r"\s*", line).group()
            out.append(f"{indent}{STUB}\n")
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    return "".join(out)


def student_notebook(nb):
    """A copy of the solution notebook `nb` (nbformat) with solutions stubbed and outputs cleared."""
    import copy

    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.source = strip_solutions(cell.source)
        cell.outputs = []
        cell.execution_count = None
    nb.metadata.pop("widgets", None)
    return nb


def build_student_labs(src: str | Path = "notebooks/labs", out: str | Path | None = None) -> list[Path]:
    """Write the student version of every solution lab in `src` to `out` (default src/student)."""
    import nbformat

    src = Path(src)
    out = Path(out) if out else src / "student"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(src.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if not any(BEGIN in c.source for c in nb.cells if c.cell_type == "code"):
            continue
        target = out / path.name
        nbformat.write(student_notebook(nb), target)
        written.append(target)
    return written


def check_cells(nb) -> list[int]:
    """Indices of the cells that run a lab check (tagged `check`)."""
    return [i for i, c in enumerate(nb.cells) if CHECK_TAG in c.get("metadata", {}).get("tags", [])]


def solution_namespace(lab: str | Path) -> dict:
    """Run a solution lab's code cells (`lab`: its py:percent twin), its check cells left out, in one
    namespace and return it: the lab's own functions, for tests that hold the checks to the solutions
    and to the slips a student makes."""
    import jupytext

    lab = Path(lab)
    cells = [c.source for c in jupytext.read(lab).cells
             if c.cell_type == "code" and CHECK_TAG not in c.metadata.get("tags", [])]
    out: dict = {}
    exec(compile("\n\n".join(cells), lab.name, "exec"), out)
    return out
