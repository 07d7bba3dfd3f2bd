"""bench/reconcile.py --quick runs, in this checkout and (as its own baseline) again in a process of its own:
every replica placed, a steady pass that plans nothing, and each figure reported."""

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_the_reconcile_bench_runs_quick(tmp_path):
    out = tmp_path / "reconcile.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "reconcile.py"), "--quick", "--baseline", ROOT,
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    [size] = json.loads(out.read_text())["results"]
    for label in ("this checkout", "baseline"):
        figures = size[label]
        assert figures["replicas"] == 800 and figures["models"] == 20
        assert figures["pass_ms"] > 0 and figures["whole_ms"] > 0
    assert "a steady pass (ms)" in run.stdout
