"""The node and cluster pages show a figure that is not a number as unknown, rather than fail.

The wire refuses such facts now (tests/test_protocol.py); these pages hold facts as the controller's
admin API gives them, so a fact that came another way (an agent of another version) must not make them 500.
"""

from __future__ import annotations

import os

from flask import Flask, render_template

from llmgw import units
from llmgw.web import adminpages, history, nodepages

ODD = {"node_id": "odd", "state": "ready", "last_heard_s": 1.0, "registered_s": 2.0,
       "facts": {"memory": {"total_bytes": "lots"}, "disk": {"free_bytes": "q", "total_bytes": float("nan")},
                 "weights": {"bytes": "q", "entries": 1}, "cpu": {"count": 4},
                 "gpus": [{"index": 0, "name": "g", "memory_used_bytes": "x", "memory_total_bytes": [1],
                           "utilization_percent": "z"}]},
       "status": {"memory": {"available_bytes": {"a": 1}},
                  "load": {"cpu_percent": "hot", "load1": "x",
                           "shards": [{"shard_id": "s1", "cpu_cores": "many", "memory_rss_bytes": None,
                                       "waiting": "w", "running": float("inf")}]}}}


def app() -> Flask:
    made = Flask(__name__, template_folder=os.path.join(os.path.dirname(__file__), "..", "templates"))
    made.add_template_filter(history.size, "bytes")  # as the pages register it (llmgw/web/pages.py)
    made.add_template_filter(history.rounded, "rounded")
    made.add_template_filter(units.ago, "ago")
    return made


def test_a_node_with_odd_facts_renders_them_unknown():
    here = [{"shard_id": "s1", "node": "odd", "model": "m", "state": "ready"}]
    with app().test_request_context():
        page = render_template("_node.html", node_id="odd", problem=None, **nodepages.node_view(ODD, here))
        cluster = render_template("_cluster.html", nodes=[ODD], models=[], replicas=[], gateway_replicas=[],
                                  controller="http://c", problem=None, problems=[], checked_at="now",
                                  legend=adminpages.LEGEND)
    assert page.count("unknown") >= 6 and "s1" in page
    assert "unknown of unknown" in cluster and "unknown, unknown free" in cluster


def test_the_tolerant_figures():
    assert units.human_bytes(3 << 30) == "3 GiB" and units.human_bytes(512) == "512 B"
    assert units.human_bytes(1536 << 20) == "1.5 GiB"
    assert history.rounded(57.6) == "58" and history.rounded(0.5, 2) == "0.50"
    assert [units.human_duration(s) for s in (0.85, 2.34, 252, 11100, 187200)] == [
        "850 ms", "2.3 s", "4 min 12 s", "3 h 5 min", "2 d 4 h"]
    assert [units.ago(s) for s in (2, 45, 252, 11100, 187200)] == ["just now", "45 s ago", "4 min ago", "3 h ago",
                                                                   "2 d ago"]
    assert units.count(1234567) == "1,234,567"
    for odd in ("q", None, True, float("nan"), float("-inf"), [1], {}):
        assert units.human_bytes(odd, "unknown") == "unknown" and history.rounded(odd) == "unknown"
        assert units.human_duration(odd) == "-" and units.ago(odd) == "never" and units.count(odd) == "-"
