"""Tables and plots shared by `gppo sweep`, `gppo probe` and `gppo geometry`."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table


def write_csv(rows: list[dict], path: Path) -> None:
    """Rows of one shape as CSV (full float precision; None as an empty cell)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def fmt(value, spec: str = ".3f", missing: str = "") -> str:
    """`value` formatted with `spec`; `missing` for None or NaN (no runs, an empty bucket)."""
    return missing if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body]) + "\n"


def print_table(console: Console, title: str, header: list[str], body: list[list[str]]) -> None:
    """A rich table on a terminal; the markdown table elsewhere (a log keeps every column)."""
    if not console.is_terminal:
        console.print(f"{title}\n{markdown_table(header, body)}", markup=False, highlight=False, soft_wrap=True)
        return
    table = Table(title=title)
    for name in header:
        table.add_column(name)
    for cells in body:
        table.add_row(*cells)
    console.print(table)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay `fig` out, write it to `path` as a PNG (creating the folder) and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def text_color(image, value: float) -> str:
    """Black or white, whichever reads better on the colour `image` gives `value` (Rec. 601 luma)."""
    r, g, b, _ = image.cmap(image.norm(value))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"
