"""bench/keys.py keeps running: the message path and a real controller and gateway at one small size, with this
checkout as its own baseline, so the side-by-side report is exercised too."""

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_the_keys_benchmark_runs_quick(tmp_path):
    out, svg = tmp_path / "keys.json", tmp_path / "keys.svg"
    run = subprocess.run([sys.executable, f"{ROOT}/bench/keys.py", "--quick", "--sizes", "2000", "--seconds", "2",
                          "--baseline", ROOT, "--out", str(out), "--chart", str(svg)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "worker stops for a change (ms)" in run.stdout and "this / baseline" in run.stdout
    results = json.loads(out.read_text())["results"]
    (result,) = results
    assert result["size"] == 2000
    # Sizes, not timings: a revocation sent as what changed is a few hundred bytes, the whole set 300 a key.
    assert result["in_process"]["change_bytes"] < 1000 and result["in_process"]["bytes"] > 2000 * 250
    assert result["this"]["requests"] > 0 and result["baseline"]["requests"] > 0
    assert result["this"]["pages"]["keys list"]["rc"] == 0 and result["this"]["pages"]["/admin/people"]["s"]
    # A limited key's requests and an unlimited one's through a gateway holding the keys, all answered.
    assert result["limited"]["failed"] == 0 and result["limited"]["limited_32_cpu_ms"] > 0
    assert "a limited request / an unlimited one" in run.stdout
    assert svg.read_text().startswith("<svg") and "a change applied" in svg.read_text()
