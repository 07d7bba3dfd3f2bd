"""Plain-text tables for the command line (columns as wide as their widest cell, no trailing spaces), sizes in
words, and text from elsewhere made safe to print."""

from __future__ import annotations

import click

# C0, DEL and C1: what a terminal acts on rather than shows (ESC starts a sequence that can retitle the
# window, rewrite what was printed before, or on some terminals answer back as if typed).
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS_BUT_TAB = {c: shown for c, shown in _CONTROLS.items() if c != 0x09}


def printable(value, tabs: bool = False) -> str:
    """VALUE as text a terminal shows and does not act on: each control character written out, as \\x1b.
    Everything the CLI prints that came from a server (names, facts, reasons, log lines) goes through it,
    since a node or model can be named, or an engine can log, anything. TABS keeps tabs (in log lines)."""
    return str(value).translate(_CONTROLS_BUT_TAB if tabs else _CONTROLS)


def print_table(rows: list[tuple]) -> None:
    """Print ROWS (the first is the header) to standard output, each cell printable."""
    cells = [[printable(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
