"""bench/accountant.py keeps running: a real accountant over CURVE in its own process, simulated gateway
workers' real limiters against it, with this checkout as its own baseline so the side-by-side report is
exercised too; and the exactness it reports holds."""

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_the_accountant_benchmark_runs_quick_and_limits_stay_exact(tmp_path):
    out, svg = tmp_path / "accountant.json", tmp_path / "accountant.svg"
    run = subprocess.run([sys.executable, f"{ROOT}/bench/accountant.py", "--quick", "--seconds", "2",
                          "--baseline", ROOT, "--out", str(out), "--chart", str(svg)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "this checkout, spread: accountant CPU a message (µs)" in run.stdout
    assert "baseline, hot: requests a message" in run.stdout
    (result,) = json.loads(out.read_text())["results"]
    for which in ("this", "baseline"):
        figures = result[which]
        # Counts, not timings: allowances serve many requests a message when few keys are busy, and about
        # one grant and one settle a request when each key is seldom seen; a busy key is held exactly.
        assert figures["hot"]["requests_per_message"] > 4 and figures["hot"]["unavailable"] == 0
        assert figures["spread"]["requests_per_message"] < 1 and figures["spread"]["admitted"] > 0
        assert figures["exact"]["admitted"] == 2000 and figures["exact"]["refused"] > 0
    # Split in two parts: a request held by its organisation alone is one part's, and one held by its person
    # too costs a second admission and settle in most cases; every part takes some of the messages.
    split = result["parts"]
    assert split["spread"]["admitted"] > 0 and split["spread"]["unavailable"] == 0
    assert split["spread+person"]["requests_per_message"] < split["spread"]["requests_per_message"]
    assert all(share > 0 for share in split["spread+person"]["part_shares"])
    assert "parts on one core, spread+person: requests a message" in run.stdout
    assert svg.read_text().startswith("<svg") and "requests a message" in svg.read_text()
