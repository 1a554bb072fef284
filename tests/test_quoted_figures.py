"""A figure a chapter quotes from its notebook is marked `<span class="nbfig">2.30</span>`; this test fails
when the notebook's stored outputs do not contain it (a text that outlived a re-run, or a typo).

The rule: the marked text, with thousands separators removed, appears in the chapter notebook's text
outputs (also without separators) as a whole number, not inside a longer one (2.3 does not match 2.30,
12.30 or 2.305). The site underlines marked figures and says where they come from (chapters/_site/hooks.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minillm.course import CHAPTERS

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r'<span class="nbfig">([^<]+)</span>')


def quoted_figures(markdown: str) -> list[str]:
    return MARK.findall(markdown)


def notebook_text(path: Path) -> str:
    """Every text output of a notebook (streams and text/plain), thousands separators removed."""
    parts = []
    for cell in json.loads(path.read_text())["cells"]:
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            parts.append("".join(text) if isinstance(text, list) else text)
    return "\n".join(parts).replace(",", "")


def missing(figures: list[str], text: str) -> list[str]:
    """The figures that `text` does not contain as whole numbers."""
    def found(fig: str) -> bool:
        fig = fig.replace(",", "").strip()
        return re.search(rf"(?<![\d.]){re.escape(fig)}(?![\d]|\.\d)", text) is not None
    return [f for f in figures if not found(f)]


def test_the_rule_bites():
    text = "decode 2.30x | 16076 tok/s | 12.5 ms"
    assert missing(["2.30", "16,076", "12.5"], text) == []
    assert missing(["2.3", "2.31", "6076", "2.5", "12"], text) == ["2.3", "2.31", "6076", "2.5", "12"]


@pytest.mark.parametrize("c", [c for c in CHAPTERS if c.notebook], ids=lambda c: c.number)
def test_quoted_figures_are_in_the_notebook(c):
    figures = quoted_figures((ROOT / "chapters" / c.text).read_text())
    nb = ROOT / "notebooks" / f"{c.notebook}.ipynb"
    assert not (gone := missing(figures, notebook_text(nb))), (
        f"chapter {c.number} quotes {gone}, which notebook {nb.name}'s stored outputs do not contain: "
        "update the text to the notebook's numbers (or the notebook's run)")


def test_chapters_mark_their_figures():
    """Every chapter with a notebook marks the figures it quotes from it (at least 3)."""
    unmarked = [c.number for c in CHAPTERS if c.notebook
                and len(quoted_figures((ROOT / "chapters" / c.text).read_text())) < 3]
    assert not unmarked, f"chapters with fewer than 3 marked figures: {unmarked}"
