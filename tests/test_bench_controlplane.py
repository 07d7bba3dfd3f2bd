"""bench/controlplane.py keeps running: a real controller under simulated agents, a gateway following it, at
one small size, with this checkout as its own baseline, so the side-by-side report is exercised too."""

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_the_control_plane_benchmark_runs_quick(tmp_path):
    out, svg = tmp_path / "cp.json", tmp_path / "cp.svg"
    run = subprocess.run([sys.executable, f"{ROOT}/bench/controlplane.py", "--quick", "--baseline", ROOT,
                          "--out", str(out), "--chart", str(svg)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "this checkout: a model added to the gateway listing it (s)" in run.stdout
    assert "baseline: an agent silent to its node unreachable (s)" in run.stdout
    assert "this checkout: every model routed to: a model added to the gateway listing it (s)" in run.stdout
    (result,) = json.loads(out.read_text())["results"]
    assert result["size"] == 20
    for which in ("this", "baseline"):
        figures = result[which]
        assert "gave_up" not in figures and "routed_gave_up" not in figures, figures
        # Counts and sizes, not timings: every replica placed, a snapshot listing each of them.
        assert figures["replicas"] == 80 and figures["snapshot"]["bytes"] > 80 * 100
        assert figures["silent_to_unreachable_s"] < 60 and figures["change_to_gateway_s"] < 120
        assert figures["change_to_gateway_s_routed"] < 120 and figures["models_p50_ms_routed"] > 0
    assert "worker_stop_ms" in result["this"]["snapshot"] and "worker_stop_ms" not in result["baseline"]["snapshot"]
    assert svg.read_text().startswith("<svg") and "placing every replica" in svg.read_text()
