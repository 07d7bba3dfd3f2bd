"""Scaling curves as standalone SVG files for docs/scaling.md: sizes across, figures up, both on log scales.

A curve over 10,000 to 1,000,000 of something spans powers of ten both ways, so both axes are logarithmic,
with a gridline at each power of ten. Each series is a line with a dot at each measured point; a point not
measured is left out, never drawn as zero. No script and no fonts beyond the reader's sans-serif.
"""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

COLOURS = ("#1f5fa8", "#c0392b", "#2e8540", "#d98c00", "#8e44ad", "#16a085")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 640, 300, 64, 16, 28, 64


def _short(value: float) -> str:
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def log_lines(title: str, x_label: str, y_label: str, xs: list[float], series: dict[str, list[float | None]]) -> str:
    """An SVG chart of SERIES (name -> one figure per X, or None) over XS."""
    values = [v for ys in series.values() for v in ys if v is not None and v > 0]
    low_x, high_x = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)))
    low_y, high_y = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    high_x, high_y = max(high_x, low_x + 1), max(high_y, low_y + 1)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(x: float, y: float) -> tuple[float, float]:
        return (LEFT + (math.log10(x) - low_x) / (high_x - low_x) * plot_w,
                TOP + plot_h - (math.log10(y) - low_y) / (high_y - low_y) * plot_h)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
           f'height="{HEIGHT}" font-family="sans-serif" font-size="11">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#fff"/>',
           f'<text x="{LEFT}" y="16" font-size="13" font-weight="bold">{escape(title)}</text>']
    for power in range(low_x, high_x + 1):
        x, _ = at(10 ** power, 10 ** low_y)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + plot_h}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{TOP + plot_h + 14}" text-anchor="middle">{_short(10 ** power)}</text>')
    for power in range(low_y, high_y + 1):
        _, y = at(10 ** low_x, 10 ** power)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_short(10 ** power)}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{TOP + plot_h + 30}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text transform="translate(14 {TOP + plot_h / 2}) rotate(-90)" text-anchor="middle">'
               f'{escape(y_label)}</text>')
    for i, (name, ys) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        points = [at(x, y) for x, y in zip(xs, ys) if y is not None and y > 0]
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        out.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>' for x, y in points)
        legend_y = TOP + plot_h + 46 + (i // 2) * 14
        legend_x = LEFT + (i % 2) * plot_w / 2
        out.append(f'<rect x="{legend_x}" y="{legend_y - 9}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text x="{legend_x + 14}" y="{legend_y}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
