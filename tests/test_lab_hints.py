"""Every lab has a hint path: each exercise a lab checks has three graded hints in its checks module
(minillm/labs/chNN.py), and the lab notebook has a cell that lists them."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from minillm.labs.hints import Hints

LABS = sorted((Path(__file__).resolve().parent.parent / "notebooks" / "labs").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.stem)
def test_every_checked_exercise_has_three_hints(lab):
    nn = lab.name[:2]
    module = importlib.import_module(f"minillm.labs.ch{nn}")
    source = lab.read_text()
    checked = re.findall(rf"ch{nn}\.check_\w+\((\w+)", source)
    assert checked, f"{lab.name} checks nothing"
    assert isinstance(module.hint, Hints)
    missing = [name for name in checked if name not in module.hint.exercises]
    assert not missing, f"lab {nn}: no hints for {missing}"
    for name in checked:
        assert len({module.hint.text(name, level) for level in (1, 2, 3)}) == 3, f"{name}: three different hints"
    assert re.search(rf"^ch{nn}\.hint\(\)$", source, flags=re.M), f"{lab.name} has no cell listing the hints"


def test_hints_refuse_unknown_exercises_and_levels(capsys):
    h = Hints("99", {"f": ("a", "b", "c")})
    h()
    assert "Exercises: f" in capsys.readouterr().out
    h("f", 2)
    assert "b" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no exercise 'g'"):
        h("g")
    with pytest.raises(ValueError, match="level"):
        h("f", 0)
    with pytest.raises(ValueError, match="three|3 non-empty"):
        Hints("99", {"f": ("a", "")})
