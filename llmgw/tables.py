"""Plain-text tables for the command line: columns as wide as their widest cell, no trailing spaces."""

from __future__ import annotations

import click


def print_table(rows: list[tuple]) -> None:
    """Print ROWS (the first is the header) to standard output."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
