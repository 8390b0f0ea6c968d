"""The console's sample table: one line per row, cut to the terminal width.

Short columns (numbers, and texts no longer than SHORT) keep their full width, with the
header broken after each '/' or '_' onto lines of that width (`reward/exact_match` reads
reward/ exact_ match); the long texts (prompt, completion) share what is left equally and
end with an ellipsis where cut. A line break inside a text shows as a literal \\n.
A `step` column equal to the step in the title is left out.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from .base import cell_text

SHORT = 12  # a column this wide or narrower is never cut
HEADER_PARTS = re.compile(r"[^/_]+[/_]?|[/_]")


def _one_line(value: Any) -> str:
    return cell_text(value).replace("\r\n", "\n").replace("\n", "\\n")


def header_lines(key: str, width: int) -> str:
    """`key` broken after '/' and '_' into lines of at most `width` (a longer part is kept
    whole: the column's ellipsis cuts it)."""
    lines: list[str] = []
    for part in HEADER_PARTS.findall(key):
        if lines and len(lines[-1]) + len(part) <= width:
            lines[-1] += part
        else:
            lines.append(part)
    return "\n".join(lines)


def sample_table(rows: Sequence[Mapping[str, Any]], step: int, table: str, width: int) -> Table:
    """The rows as a rich Table `width` characters wide at most, columns in the rows' order.
    Cells are Text, so brackets in a completion are never read as rich markup."""
    columns = [str(k) for k in rows[0]]
    if "step" in columns and all(row.get("step") == step for row in rows):
        columns.remove("step")
    cells = {key: [_one_line(row.get(key)) for row in rows] for key in columns}
    widths = {key: max(max(len(c) for c in cells[key]),
                       min(max(len(p) for p in HEADER_PARTS.findall(key) or [key]), SHORT), 1)
              for key in columns}
    long = [key for key in columns if widths[key] > SHORT]
    left = width - (len(columns) - 1) - sum(widths[k] for k in columns if k not in long)
    for key in long:  # the long texts share what the short columns leave (at least 4 each)
        widths[key] = min(widths[key], max(left // len(long), 4))
    view = Table(title=f"samples: {table}, step {step}", title_justify="left",
                 box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0))
    for key in columns:
        numeric = all(isinstance(row.get(key), (int, float)) for row in rows)
        head = key if key in long else header_lines(key, widths[key])
        view.add_column(Text(head, overflow="ellipsis"), width=widths[key], no_wrap=True,
                        overflow="ellipsis", justify="right" if numeric else "left")
    for i in range(len(rows)):
        view.add_row(*(Text(cells[key][i], no_wrap=True, overflow="ellipsis") for key in columns))
    return view
