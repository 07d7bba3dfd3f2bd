"""bench/onecore.py --quick runs: nginx answers as the engine, each subject relays a whole answer and stream
(the bench checks before it loads them), wrk loads each, and every figure it reports is there (its aims are
printed, not judged, in a smoke run)."""

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_the_one_core_bench_runs_quick(tmp_path):
    out = tmp_path / "onecore.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "onecore.py"), "--quick", "--baseline", ROOT,
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    figures = r["figures"]
    assert {"stand-in directly", "gateway", "baseline"} <= set(figures)
    for subject, loads in figures.items():
        for load in ("plain", "stream"):
            m = loads[load]
            assert m["failed"] == 0 and m["rps"] > 0 and 0 < m["p50_ms"] <= m["p99_ms"], (subject, load, m)
            if subject != "stand-in directly":
                assert m["cpu_us"] > 0 and m["cpu0_busy"] > 0.3, (subject, load, m)  # CPU 0 carried its load
    assert "Aims (issue 32):" in run.stdout
    if r["rivals"]["vllm-router"] == "measured":
        assert "gateway / vllm-router" in run.stdout
