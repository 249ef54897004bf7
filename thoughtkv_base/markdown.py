"""Markdown tables as every document here writes them: a header, its rule, one line per row."""

from __future__ import annotations

from collections.abc import Iterable


def markdown_table(header: Iterable, rows: Iterable[Iterable]) -> list[str]:
    """The table's lines; each cell is str()-ed, a `|` inside one escaped so that it stays one cell."""
    header = list(header)
    return [table_line(header), "|" + "---|" * len(header), *(table_line(row) for row in rows)]


def table_line(cells: Iterable) -> str:
    return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"
