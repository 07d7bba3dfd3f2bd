"""`llmgw debug profile`: a sampling profile of a real gateway (its gunicorn master and workers) by py-spy,
and every thread's stack once with --dump."""

import subprocess
import sys
import threading

from llmgw.cli import debug
from tests.conftest import Gateway, make_key, post


def profile(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", "debug", "profile", *argv], capture_output=True, text=True,
                          timeout=300)


def test_a_running_gateway_is_profiled_from_outside(tmp_path, make_sim):
    sim = make_sim(ttft_ms=1, tokens_per_s=0)
    url = f"sqlite:///{tmp_path}/p.db"
    gw = Gateway(tmp_path, url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1)
    try:
        master = gw.proc.pid
        assert master in [pid for pid, _ in debug.candidates("gateway")]  # found by its role file
        key = make_key(url)
        busy = threading.Event()

        def load():  # py-spy samples what runs: an idle gateway shows nothing
            while not busy.is_set():
                post(gw.url + "/v1/chat/completions", {"model": "sim", "max_tokens": 2, "messages": [
                    {"role": "user", "content": "hi"}]}, key)

        loader = threading.Thread(target=load)
        loader.start()
        out = tmp_path / "gw.txt"
        try:
            made = profile("gateway", "--pid", str(master), "--seconds", "3", "--format", "raw", "--out", str(out))
        finally:
            busy.set()
            loader.join()
        assert made.returncode == 0, made.stderr
        assert "profiling gateway (pid" in made.stderr and made.stdout.strip() == str(out)
        stacks = out.read_text()
        assert "gevent" in stacks or "gunicorn" in stacks, stacks[:500]  # the workers' loop was sampled
        dumped = profile("gateway", "--pid", str(master), "--dump")
        assert dumped.returncode == 0 and f"Process {master}" in dumped.stdout, dumped.stderr
    finally:
        gw.stop()
    gone = profile("gateway", "--pid", "999999999", "--seconds", "1")
    assert gone.returncode == 1 and "py-spy" in gone.stderr
