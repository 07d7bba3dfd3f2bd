"""Charts drawn by the server as SVG: no script, no library, readable on a phone.

A chart is stacked bars, one bar per time bucket, one colour per group (the
largest groups; the rest are summed as "others"), with a legend and the
largest value on the axis. Every label is escaped: group names are whatever
people called their projects.
"""

from __future__ import annotations

import time

from markupsafe import Markup, escape

COLOURS = ("#1f5fa8", "#2e8540", "#d98c00", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d")
WIDTH, HEIGHT, LEFT, BOTTOM = 600, 220, 48, 24


def _short(value: float) -> str:
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.1f}".rstrip("0").rstrip(".") + unit
    return f"{value:g}"


def stacked_bars(buckets: list[float], groups: list[tuple[str, dict[float, float]]], step: int, title: str,
                 fmt=_short) -> Markup:
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
    peak = max(totals, default=0) or 1
    n = max(len(buckets), 1)
    slot = (WIDTH - LEFT) / n
    bar = max(1.0, slot * 0.8)
    plot = HEIGHT - BOTTOM
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}">',
             f"<title>{escape(title)}</title>",
             f'<line x1="{LEFT}" y1="{plot}" x2="{WIDTH}" y2="{plot}" class="axis"/>',
             f'<text x="{LEFT - 4}" y="12" text-anchor="end" class="tick">{escape(fmt(peak))}</text>',
             f'<text x="{LEFT - 4}" y="{plot}" text-anchor="end" class="tick">0</text>']
    label_every = max(1, n // 6)
    for i, b in enumerate(buckets):
        x = LEFT + i * slot + (slot - bar) / 2
        y = plot
        for colour, (label, series) in zip(COLOURS, shown):
            value = series.get(b, 0)
            if not value:
                continue
            h = value / peak * (plot - 16)
            y -= h
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{h:.1f}" fill="{colour}">'
                         f"<title>{escape(label)}: {escape(fmt(value))}</title></rect>")
        if i % label_every == 0:
            when = time.strftime("%H:%M" if step < 86400 else "%m-%d", time.gmtime(b))
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle" class="tick">{when}</text>')
    parts.append("</svg>")
    legend = "".join(f'<li><span class="swatch" style="background:{c}"></span>{escape(label)}</li>'
                     for c, (label, _) in zip(COLOURS, shown))
    return Markup("".join(parts) + (f'<ul class="legend">{legend}</ul>' if shown else ""))
