"""Executing notebooks in place, the way their stored outputs are made on a GPU machine.

    python -m minillm.nbrun notebooks/*.ipynb notebooks/labs/*.ipynb

Each notebook runs top to bottom in a fresh kernel, in its own folder; the first error stops that
notebook and makes the command fail. Outputs are written back into the .ipynb file.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def execute(path: str | Path, timeout: int = 1800, kernel_name: str = "python3") -> float:
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    last = [start]

    def on_cell_executed(cell, cell_index, **_):  # progress, and what ran so far kept on disk
        now = time.perf_counter()
        print(f"  {path.name} cell {cell_index}: {now - last[0]:.1f} s", flush=True)
        last[0] = now
        nbformat.write(nb, path)

    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name, on_cell_executed=on_cell_executed,
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    try:
        client.execute()
    finally:
        nbformat.write(nb, path)  # keep what ran, also when a cell failed, to read the error
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    paths = argv if argv is not None else sys.argv[1:]
    if not paths:
        print("usage: python -m minillm.nbrun NOTEBOOK.ipynb [...]", file=sys.stderr)
        return 2
    failed = []
    for p in paths:
        try:
            print(f"{p}: ran in {execute(p):.1f} s", flush=True)
        except Exception as e:  # a failing cell: report it, go on with the others
            print(f"{p}: FAILED: {type(e).__name__}: {str(e)[-2000:]}", flush=True)
            failed.append(p)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
