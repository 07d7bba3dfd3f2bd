"""Figures as people read them, the same in every table and page: binary sizes, durations, times ago,
counts. One place, so that the CLI, the pages and the charts never say one number two ways."""

from __future__ import annotations

import math


def known(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def human_bytes(value, unknown: str = "-") -> str:
    """VALUE bytes in the largest binary unit it fills (1.5 GiB, 512 MiB, 800 B); UNKNOWN where it is none."""
    if not known(value):
        return unknown
    for size, unit in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(value) >= size:
            return f"{value / size:.1f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{value:.0f} B"


def human_duration(seconds, unknown: str = "-") -> str:
    """SECONDS as a latency or a span reads: 850 ms, 2.3 s, 4 min 12 s, 3 h 5 min, 2 d 4 h."""
    if not known(seconds):
        return unknown
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f}".rstrip("0").rstrip(".") + " s"
    whole = int(seconds)
    for big, big_unit, small, small_unit in ((86400, "d", 3600, "h"), (3600, "h", 60, "min"), (60, "min", 1, "s")):
        if whole >= big:
            rest = (whole % big) // small
            return f"{whole // big} {big_unit}" + (f" {rest} {small_unit}" if rest else "")
    return f"{whole} s"


def ago(seconds, unknown: str = "never") -> str:
    """How long ago something was, SECONDS before now, in its largest unit: "just now", "45 s ago", "4 min
    ago", "3 h ago", "2 d ago"."""
    if not known(seconds):
        return unknown
    if seconds < 5:
        return "just now"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min"), (1, "s")):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return "just now"


def count(value, unknown: str = "-") -> str:
    """A whole number with thousands marked: 1,234,567."""
    return f"{value:,.0f}" if known(value) else unknown
