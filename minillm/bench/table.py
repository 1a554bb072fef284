"""Printing benchmark results as aligned text tables."""

from __future__ import annotations

from collections.abc import Sequence


def _fmt(value) -> str:
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1e5:
            return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value)


def format_table(rows: Sequence[dict], columns: Sequence[str] | None = None, title: str = "") -> str:
    columns = list(columns or (rows[0].keys() if rows else []))
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def print_table(rows, columns=None, title: str = "") -> None:
    print(format_table(rows, columns, title))
