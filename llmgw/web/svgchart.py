"""Charts drawn by the server as SVG: no script, no library, readable on a phone.

Two kinds, one frame: stacked bars (one bar per time bucket, one colour per group: usage, requests by
model) for figures that add up, and lines (one per series: a latency, a utilisation) for figures that
do not. Colours are fixed and never cycled: the largest groups get them, the rest are summed as
"others" in bars and left out, said in the legend, in lines. One y-axis per chart, from 0 to a round
number at or above the largest value. A time with no value is not drawn (a line breaks there), never
drawn as zero; a series of one point is a dot. Every label is escaped: group names are whatever people
called their projects, models and nodes.
"""

from __future__ import annotations

import math
import sys
import time

from markupsafe import Markup, escape

COLOURS = ("#1f5fa8", "#2e8540", "#d98c00", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d")
WIDTH, HEIGHT, LEFT, BOTTOM = 600, 220, 48, 24
PLOT = HEIGHT - BOTTOM
HEADROOM = 16  # above the tallest value, for the axis label


def short(value: float) -> str:
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.1f}".rstrip("0").rstrip(".") + unit
    return f"{value:.3g}"


def round_up(value: float, binary: bool = False) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten at or above VALUE: an axis a person reads at once.
    BINARY: of bytes, counted in KiB, MiB, GiB, so that 5 GiB is a round number and 5e9 bytes is not.
    ValueError when no float is such a number: VALUE is NaN, infinite, or past 1e308 (two of 1e308 stacked)."""
    if not math.isfinite(value):
        raise ValueError(f"no axis reaches {value}")
    if value <= 0:
        return 1.0
    # A subnormal's power of ten is 0 as a float (10.0 ** -324), and no step of 0 reached it: StopIteration.
    value = max(value, sys.float_info.min)
    unit = 1024 ** math.floor(math.log(value, 1024)) if binary and value >= 1024 else 1
    value /= unit
    # A float: 10 ** 308 as an int made an axis of 2 * 10 ** 308, which no float holds (OverflowError when drawn).
    power = 10.0 ** math.floor(math.log10(value))
    top = unit * next(step * power for step in (1, 2, 2.5, 5, 10) if step * power >= value * (1 - 1e-9))
    if not math.isfinite(top):
        raise ValueError(f"no axis reaches {value}")
    return top


def _frame(title: str, top: float, fmt) -> list[str]:
    return [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
            f"<title>{escape(title)}</title>",
            f'<line x1="{LEFT}" y1="{PLOT}" x2="{WIDTH}" y2="{PLOT}" class="axis"/>',
            f'<text x="{LEFT - 4}" y="12" text-anchor="end" class="tick">{escape(fmt(top))}</text>',
            f'<text x="{LEFT - 4}" y="{PLOT}" text-anchor="end" class="tick">0</text>']


def _when(t: float, span: float) -> str:
    return time.strftime("%H:%M" if span < 2 * 86400 else "%m-%d", time.gmtime(t))


def _legend(labels, note: str = "") -> str:
    items = "".join(f'<li><span class="swatch" style="background:{c}"></span>{escape(label)}</li>'
                    for c, label in zip(COLOURS, labels))
    if note:
        items += f'<li class="muted">{escape(note)}</li>'
    return f'<ul class="legend">{items}</ul>' if items else ""


def stacked_bars(buckets: list[float], groups: list[tuple[str, dict[float, float]]], step: int, title: str,
                 fmt=short) -> Markup:
    """BUCKETS (start times) along the bottom; GROUPS as (label, {bucket: value}), largest first."""
    shown = groups[:len(COLOURS) - 1]
    rest = groups[len(COLOURS) - 1:]
    if rest:
        others: dict[float, float] = {}
        for _, series in rest:
            for b, v in series.items():
                others[b] = others.get(b, 0) + v
        shown = shown + [(f"{len(rest)} others", others)]
    totals = [sum(series.get(b, 0) for _, series in shown) for b in buckets]
    top = round_up(max(totals, default=0))
    n = max(len(buckets), 1)
    slot = (WIDTH - LEFT) / n
    bar = max(1.0, slot * 0.8)
    parts = _frame(title, top, fmt)
    label_every = max(1, n // 6)
    for i, b in enumerate(buckets):
        x = LEFT + i * slot + (slot - bar) / 2
        y = PLOT
        for colour, (label, series) in zip(COLOURS, shown):
            value = series.get(b, 0)
            if not value:
                continue
            h = value / top * (PLOT - HEADROOM)
            y -= h
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{h:.1f}" fill="{colour}">'
                         f"<title>{escape(label)}: {escape(fmt(value))}</title></rect>")
        if i % label_every == 0:
            when = time.strftime("%H:%M" if step < 86400 else "%m-%d", time.gmtime(b))
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle" class="tick">{when}</text>')
    parts.append("</svg>")
    return Markup("".join(parts) + _legend(label for label, _ in shown))


def lines(start: float, end: float, groups: list[tuple[str, dict[float, float]]], step: float, title: str,
          fmt=short, top: float | None = None, binary: bool = False) -> Markup:
    """GROUPS as (label, {time: value}), largest first, as lines from START to END (unix seconds) on an axis
    from 0 to TOP (else a round number above the largest value, in KiB, MiB... when BINARY). Points more than
    STEP and a half apart are not joined: what was not known in between is not drawn."""
    shown = groups[:len(COLOURS)]
    left_out = len(groups) - len(shown)
    peak = max((v for _, series in shown for v in series.values()), default=0)
    top = top if top is not None and top >= peak else round_up(peak, binary)
    span = max(end - start, 1)

    def x(t: float) -> float:
        return LEFT + (t - start) / span * (WIDTH - LEFT)

    def y(v: float) -> float:
        return PLOT - v / top * (PLOT - HEADROOM)

    parts = _frame(title, top, fmt)
    for i in range(6):
        t = start + span * (i + 0.5) / 6
        parts.append(f'<text x="{x(t):.1f}" y="{HEIGHT - 6}" text-anchor="middle" class="tick">{_when(t, span)}</text>')
    for colour, (label, series) in zip(COLOURS, shown):
        runs: list[list[tuple[float, float]]] = []
        for t in sorted(series):
            if runs and t - runs[-1][-1][0] <= step * 1.5:
                runs[-1].append((t, series[t]))
            else:
                runs.append([(t, series[t])])
        tip = f"<title>{escape(label)}: {escape(fmt(series[max(series)]))} at the last point</title>"
        for run in runs:
            if len(run) == 1:
                (t, v), = run
                parts.append(f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colour}">{tip}</circle>')
                continue
            points = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in run)
            parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2">{tip}'
                         "</polyline>")
    parts.append("</svg>")
    note = f"{left_out} more not drawn (the largest are)" if left_out else ""
    return Markup("".join(parts) + _legend((label for label, _ in shown), note))
