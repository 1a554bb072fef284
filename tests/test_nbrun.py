"""minillm.nbrun, the way stored outputs are made: every cell's time is printed as it finishes and the
notebook is written after each cell, so a run cut short (a timeout on the GPU machine) keeps what ran."""

from __future__ import annotations

import nbformat
import pytest

from minillm.nbrun import execute, main


def test_progress_per_cell_and_partial_outputs_kept(tmp_path, capsys):
    path = tmp_path / "t.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(6 * 7)"), nbformat.v4.new_markdown_cell("text"),
                nbformat.v4.new_code_cell("raise RuntimeError('stop here')"), nbformat.v4.new_code_cell("print('never')")]
    nbformat.write(nb, path)
    with pytest.raises(Exception, match="stop here"):
        execute(path)
    out = capsys.readouterr().out
    assert "t.ipynb cell 0:" in out and "cell 2:" in out and "cell 3:" not in out
    ran = nbformat.read(path, as_version=4)
    assert ran.cells[0].outputs[0]["text"] == "42\n"
    assert ran.cells[2].outputs[0]["ename"] == "RuntimeError" and ran.cells[3].execution_count is None
    assert main([str(path)]) == 1  # the command reports the failing notebook
    assert main([]) == 2
