"""Plain-text tables for the command line (columns as wide as their widest cell, no trailing spaces) and sizes in words."""

from __future__ import annotations

import click


def print_table(rows: list[tuple]) -> None:
    """Print ROWS (the first is the header) to standard output."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def human_bytes(n) -> str:
    """N bytes as a person reads them (1.5 GiB); "-" when not known."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"
