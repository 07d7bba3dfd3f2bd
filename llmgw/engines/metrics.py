"""Reading an engine's load from its Prometheus text, keeping only what routing uses.

The whole exposition of a busy vLLM is tens of kilobytes of histograms; a full
parser costs more than the three numbers are worth, so lines are matched by
name and everything else is skipped unread. A figure the engine does not
report stays absent (None), never zero: "no queue" and "not known" route
differently.
"""

from __future__ import annotations

import math

from llmgw.engines import LOAD_METRICS

_PREFIXES = tuple(LOAD_METRICS)


def parse_load(text: str) -> dict[str, float]:
    """`{"waiting": n, "running": n, "kv_cache": f}` with only the figures present.

    Counts are summed over label sets (an engine serving two names reports
    each); the KV cache fraction takes the largest.
    """
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(_PREFIXES):
            continue
        name_end = len(line)
        for sep in ("{", " "):
            pos = line.find(sep)
            if 0 < pos < name_end:
                name_end = pos
        figure = LOAD_METRICS.get(line[:name_end])
        if figure is None:
            continue
        rest = line[name_end:]
        if rest.startswith("{"):
            rest = rest.rsplit("}", 1)[-1]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if not math.isfinite(value) or value < 0:  # NaN: the engine does not know either; the controller
            continue  # refuses a heartbeat with a figure that is not a finite, non-negative number
        if figure == "kv_cache":
            found[figure] = max(found.get(figure, 0.0), value)
        else:
            found[figure] = found.get(figure, 0.0) + value
    return found
