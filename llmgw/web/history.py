"""The history charts of the cluster and node pages: which series, over which window, drawn by `svgchart`.

The figures are Prometheus' (`monitoring.prometheus`): the gateways' and the controller's own series
(llmgw/gateway/metrics.py, llmgw/control/fleetmetrics.py), which a test holds these queries to. No job
or instance label is named: every query sums or takes the largest value over whatever scrapes the
series, so it reads the same whatever the operator called the jobs, and two gateways' requests add up.
The page keeps no history of its own. One query failing fails the section with one sentence: a page
of charts that each say "Prometheus did not answer" tells nothing more, and each would wait its turn.
So does a chart that cannot be drawn, whatever the cause: the page is still served, and the
traceback goes to the log (odd but valid answers made the whole page a 500 before their values were
bounded where they are read).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time

from llmgw.apiclient import address_url
from llmgw.units import human_bytes, human_duration, known
from llmgw.web import prometheus, svgchart

log = logging.getLogger("llmgw.history")

WINDOWS = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400}
POINTS = 60  # per series: a point every minute over the last hour
SCRAPE = 15  # seconds between scrapes: Prometheus' default, and deploy/monitoring's

SETUP = ("History charts need Prometheus: have it scrape the gateways' metrics (gateway.metrics_listen) and the "
         "controller's (controller.metrics_listen), then set monitoring.prometheus to its address, such as "
         "http://prometheus:9090, in this gateway's configuration and restart it. docs/operations.md, "
         "\"History charts\", has a scrape configuration to start from.")


def percent(value: float) -> str:
    return f"{value:.0f}%"


def size(value) -> str:
    """A chart's figure in bytes; "unknown" where a node sent something that is not a number."""
    return human_bytes(value, "unknown")


def rounded(value, digits: int = 0) -> str:
    """VALUE to DIGITS decimals, or "unknown" where it is not a finite number (what a node said about itself
    is shown as the agent sent it, and one of another version, or a bug, may send anything)."""
    return f"{value:.{digits}f}" if known(value) else "unknown"


@dataclasses.dataclass(frozen=True)
class Chart:
    """One chart: QUERY ({range} is the rate's look-back, {node} a node's label matcher), the label LABEL
    names each series by, and what an empty answer means (EMPTY)."""
    title: str
    query: str
    label: str
    empty: str
    bars: bool = False  # figures that add up (requests of each model) are stacked bars; others lines
    fmt: object = svgchart.short
    top: float | None = None  # a fixed axis (100 for a percentage)
    optional: bool = False  # absent from the page, not "no data", when nothing has this series (GPUs)


CLUSTER = (
    Chart("Requests a minute, by model", "sum by (model) (rate(llmgw_requests_total[{range}])) * 60", "model",
          "No request was answered in this window, or Prometheus does not scrape the gateways.", bars=True),
    Chart("Time to first token, 95th percentile, by model",
          "histogram_quantile(0.95, sum by (model, le) (rate(llmgw_ttft_seconds_bucket[{range}])))", "model",
          "No token was sent in this window, or Prometheus does not scrape the gateways.", fmt=human_duration),
    # A node's GPUs where it reports their use, its CPU otherwise: a CPU-only node is not left off.
    Chart("GPU or CPU use, by node",
          'label_replace(avg by (node) (llmgw_gpu_utilization_percent), "use", "GPU", "", "") or on (node) '
          'label_replace(max by (node) (llmgw_node_cpu_utilization_percent), "use", "CPU", "", "")',
          "node use", "No node reported its use in this window, or Prometheus does not scrape the controller.",
          fmt=percent, top=100),
    Chart("KV cache in use, by replica", "max by (replica) (llmgw_endpoint_kv_cache_usage) * 100", "replica",
          "No replica reported its KV cache in this window (not every engine publishes it), or Prometheus does "
          "not scrape the gateways.", fmt=percent, top=100),
)

NODE = (
    Chart("CPU use", "max(llmgw_node_cpu_utilization_percent{node})", "",
          "The node did not report its CPU use in this window.", fmt=percent, top=100),
    Chart("GPU use, by GPU", "max by (gpu) (llmgw_gpu_utilization_percent{node})", "gpu",
          "", fmt=percent, top=100, optional=True),
    Chart("Memory in use", "max(llmgw_node_memory_total_bytes{node}) - max(llmgw_node_memory_available_bytes{node})",
          "", "The node did not report its memory in this window.", fmt=size),
    Chart("Load (1-minute average)", "max(llmgw_node_load{node})", "",
          "The node did not report its load in this window."),
    Chart("CPU cores used, by replica", "max by (shard) (llmgw_shard_cpu_cores{node})", "shard",
          "No engine ran on this node in this window."),
    Chart("Memory of each replica's engine", "max by (shard) (llmgw_shard_memory_bytes{node})", "shard",
          "No engine ran on this node in this window.", fmt=size),
    Chart("Requests waiting, by replica", "max by (shard) (llmgw_shard_requests_waiting{node})", "shard",
          "No engine on this node reported its queue in this window."),
)


def window_of(text: str | None, default: str = "1h") -> str:
    return text if text in WINDOWS else default


def _name(labels: dict[str, str], label: str) -> str:
    if label == "node use":
        return f"{labels.get('node', '?')} ({labels.get('use', '?')})"
    if label == "gpu":
        return f"GPU {labels.get('gpu', '?')}"
    return labels.get(label, "?") if label else "this node"


def _slot(t: float, start: float, step: int) -> int:
    return min(POINTS - 1, max(0, round((t - start) / step) - 1))


def query_of(chart: Chart, step: int, matcher: str = "") -> str:
    """CHART's query for points STEP seconds apart, of the node MATCHER picks (all where it is empty)."""
    # A rate looks back over its step and one scrape more (four scrapes at least): rates over exactly a step
    # tile time, and a rise between the last scrape of one step and the first of the next was in none of them.
    rate_range = f"{max(step + SCRAPE, 4 * SCRAPE)}s"
    return chart.query.replace("{range}", rate_range).replace("{node}", matcher)


def charts(base: str, window: str, node: str | None = None) -> dict:
    """The history section: the cluster's charts (or NODE's) over WINDOW, from the Prometheus at BASE (a URL,
    or `HOST:PORT`).

    {"window", "windows", "charts": [{"title", "svg", "empty"}], "problem": a sentence or None,
    "setup": a sentence when there is no Prometheus to ask}."""
    view = {"window": window, "windows": list(WINDOWS), "charts": [], "problem": None,
            "setup": None if base else SETUP}
    if not base:
        return view
    base = address_url(base, "monitoring.prometheus")
    span = WINDOWS[window]
    step = span // POINTS
    # Up to now, not to the last whole step: a cluster started a minute ago has a chart already. Rounded up:
    # rounded down, the last point could fall before the scrape that Prometheus took in the same second.
    end = math.ceil(time.time())
    start = end - span
    matcher = "{node=" + json.dumps(node) + "}" if node is not None else ""  # a JSON string is a PromQL one
    for chart in NODE if node is not None else CLUSTER:
        query = query_of(chart, step, matcher)
        try:
            found = prometheus.query_range(base, query, start + step, end, step)
        except prometheus.Unavailable as e:
            view["problem"], view["charts"] = str(e), []
            return view
        if not found and chart.optional:
            continue
        try:
            svg = _draw(chart, found, start, end, step)
        except Exception:  # a fault of ours, or an answer no bound foresaw: the page is served all the same
            log.exception("The chart %r could not be drawn from what Prometheus at %s answered to %r",
                          chart.title, base, query)
            view["problem"], view["charts"] = (
                f"The chart \"{chart.title}\" could not be drawn from what Prometheus at {base} answered. "
                "This gateway's log has the error with its traceback: a fault of llmgw's, worth reporting."), []
            return view
        view["charts"].append({"title": chart.title, "svg": svg, "empty": chart.empty})
    return view


def _draw(chart: Chart, found: list[prometheus.Series], start: int, end: int, step: int):
    """CHART's SVG of the series FOUND, or None when there are none."""
    groups = [(_name(s.labels, chart.label), s.points) for s in found]
    if not groups:
        return None
    if chart.bars:
        # The point at T is the rate over the step before it: its bar is that step's.
        buckets = [start + step * i for i in range(POINTS)]
        return svgchart.stacked_bars(buckets, [(label, {buckets[_slot(t, start, step)]: v for t, v in points.items()})
                                               for label, points in groups], step, chart.title, chart.fmt)
    return svgchart.lines(start, end, groups, step, chart.title, chart.fmt, chart.top, binary=chart.fmt is size)
