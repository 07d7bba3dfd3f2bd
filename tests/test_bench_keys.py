"""bench/keys.py keeps running: its quick sizes through the message path and a real controller and gateway,
with this checkout as its own baseline (so the side-by-side report is exercised too)."""

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_the_keys_benchmark_runs_quick(tmp_path):
    out, svg = tmp_path / "keys.json", tmp_path / "keys.svg"
    run = subprocess.run([sys.executable, f"{ROOT}/bench/keys.py", "--quick", "--sizes", "1000,3000",
                          "--baseline", ROOT, "--out", str(out), "--chart", str(svg)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "worker stops for a change (ms)" in run.stdout and "this / baseline" in run.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["size"] for r in results] == [1000, 3000]
    for r in results:
        # Sizes, not timings: a revocation sent as what changed is the same few hundred bytes at any size.
        assert r["in_process"]["change_bytes"] < 1000 < r["in_process"]["bytes"] / 100
        assert r["this"]["requests"] > 0 and r["baseline"]["requests"] > 0
    assert results[1]["in_process"]["bytes"] > 2.5 * results[0]["in_process"]["bytes"]
    assert svg.read_text().startswith("<svg") and "a change applied" in svg.read_text()
