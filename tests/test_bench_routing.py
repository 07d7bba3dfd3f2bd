"""bench/routing.py keeps running: a quick pass of every policy over both workloads, through real gateways."""

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_the_routing_benchmark_runs_quick(tmp_path):
    out = tmp_path / "routing.json"
    run = subprocess.run([sys.executable, f"{ROOT}/bench/routing.py", "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "aims for prefix" in run.stdout
    result = json.loads(out.read_text())
    runs = {(r["workload"], r["policy"]): r for r in result["runs"]}
    assert set(runs) == {(w, p) for w in ("multi-turn", "no-overlap") for p in ("round-robin", "least-load", "prefix")}
    assert all(r["ok"] > 0 and r["failed"] == 0 and r["balance"] for r in runs.values()), runs
    # Timings of a few seconds on a busy machine prove little; where the prompts were found does not depend on
    # timing: sent to the replica that has their history, conversations find more of it cached.
    multi = {p: runs["multi-turn", p]["cache_hit_share"] for p in ("round-robin", "prefix")}
    assert multi["prefix"] > multi["round-robin"], multi
    assert runs["no-overlap", "prefix"]["cache_hit_share"] == 0
    assert all(cost > 0 for cost in result["cost"]["microseconds"].values())
