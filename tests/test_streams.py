"""A thousand streams at once through one gateway worker: every one completes."""

import json
import subprocess
import sys

from tests.conftest import ROOT, make_key

STREAMS = 1000


def test_a_thousand_concurrent_streams_complete(tmp_path, make_gateway, make_sim):
    # Every stream's first token waits until all of them are open at once (the engine's peak proves it),
    # however long a busy machine takes to open a thousand connections; then ten tokens at ten a second.
    sim = make_sim(replica="s", ttft_ms=120_000, tokens_per_s=10, gather=STREAMS)
    url = f"sqlite:///{tmp_path}/streams.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1)
    run = subprocess.run([sys.executable, f"{ROOT}/bench/loadgen.py", "--url", gw.url, "--key", key, "--stream",
                          "--max-tokens", "10", "--requests", str(STREAMS), "--concurrency", str(STREAMS),
                          "--timeout", "180"], capture_output=True, text=True, timeout=300)
    result = json.loads(run.stdout)
    assert result["ok"] == STREAMS and result["failed"] == 0, result
    assert sim.metrics()["llmgw_sim_running_peak"] == STREAMS
    assert "Traceback" not in gw.log()
