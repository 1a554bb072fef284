"""The notebooks as files: each is paired with its py:percent twin (jupytext), stored with the
outputs of a GPU run whose first line names the GPU, and every code cell has run."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
WALKTHROUGHS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LABS = sorted((ROOT / "notebooks" / "labs").glob("[0-9][0-9]_*.ipynb"))



def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_every_chapter_has_a_notebook_and_a_lab():
    assert [p.name[:2] for p in WALKTHROUGHS] == [p.name[:2] for p in LABS]
    assert len(WALKTHROUGHS) >= 2


@pytest.mark.parametrize("path", WALKTHROUGHS + LABS, ids=lambda p: p.stem)
def test_paired_with_py_percent(path):
    twin = path.with_suffix(".py")
    assert twin.is_file(), f"{path.name} has no paired {twin.name} (jupytext --set-formats ipynb,py:percent)"
    ipynb = nbformat.read(path, as_version=4)
    py = jupytext.read(twin)
    assert _cells(ipynb) == _cells(py), f"{path.name} and {twin.name} differ: run `jupytext --sync {path}`"


@pytest.mark.parametrize("path", WALKTHROUGHS + LABS, ids=lambda p: p.stem)
def test_stored_with_outputs(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    unrun = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unrun, f"{path.name}: cells {unrun} were never run"
    assert any(c.outputs for c in code)


# Notebooks whose stored outputs are still a CPU run: strict, so the mark must go when the GPU outputs land.
NOT_YET_ON_A_GPU = {"14_structured_output": "the session's device time ran out before notebook 14 ran on a GPU "
                                            "(scripts/gpu/s1204.sh C runs it)",
                    "15_kv_eviction": "notebook 15's stored outputs are a CPU run (the helper had no GPU): the "
                                      "integrator's GPU run replaces them",
                    "16_multi_lora": "notebook 16's stored outputs are a CPU run; the integrator's GPU run "
                                     "(python3 -m minillm.nbrun notebooks/16_multi_lora.ipynb) replaces them",
                    "18_decode_floor": "stored outputs are a CPU run; the integrator's GPU session runs it on an H200"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.xfail(reason=NOT_YET_ON_A_GPU[p.stem], strict=True))
                                  if p.stem in NOT_YET_ON_A_GPU else p for p in WALKTHROUGHS], ids=lambda p: p.stem)
def test_outputs_come_from_a_gpu_run(path):
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code" and c.outputs)
    text = "".join(o.get("text", "") for o in first.outputs)
    assert text.startswith("minillm ") and " | GPU " in text, (
        f"{path.name}: the first output should be the header of a GPU run, got {text[:120]!r}"
    )
