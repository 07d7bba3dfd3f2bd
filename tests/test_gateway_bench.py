"""bench/gateway.py's quick run, whole: vllm-router installed (once, into the benchmarks' cache) and started
beside the gateway, every load on every subject answered, the ratios and the aims' verdicts printed.

The figures themselves are not held to anything here (the machine is shared; docs/performance.md has them):
what is checked is that one run measures every subject it says it measured, with no failed request, and
reports the held streams it was asked for.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

HELD = 200


def test_the_quick_bench_measures_the_gateway_beside_vllm_router(tmp_path):
    out = tmp_path / "gateway.json"
    run = subprocess.run([sys.executable, f"{ROOT}/bench/gateway.py", "--quick", "--seconds", "1",
                          "--held-streams", str(HELD), "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["rivals"] == {"vllm-router": "measured"}, r["rivals"]
    assert set(r["figures"]) == {"engine directly", "gateway", "gateway, 4 levels", "vllm-router"}
    for subject, loads in r["figures"].items():
        assert set(loads) == {"plain", "plain32", "stream", "stream32"}
        for name, m in loads.items():
            assert m["ok"] > 0 and m["failed"] == 0, (subject, name, m)
            if subject != "engine directly":
                assert m["cpu_ms"] > 0, (subject, name, m)
    # Every ratio aim has its figure; only the held streams' count is short of the aim in a quick run.
    says = [a["says"] for a in r["aims"]]
    assert all(a["ratio"] is not None for a in r["aims"] if "ratio" in a), says
    assert len(says) == 10 and all(": met" in s or "NOT met" in s for s in says), says
    held = r["held"]
    assert held["streams"] == held["completed"] == HELD and held["failed"] == 0, held
    assert held["worker_rss_held_kib"] > held["worker_rss_idle_kib"] > 0
    printed = run.stdout
    assert "| measure | engine directly | gateway | gateway, 4 levels | vllm-router |" in printed, printed
    assert "Load average (1 min)" in printed and "Aims (issue 14):" in printed
    assert f"held streams: {HELD} in one worker ({HELD} completed, 0 failed)" in printed, printed
