"""What guardrails add to a request: a guarded model beside an unguarded one, through one gateway, in one run.

    python bench/guard_latency.py [--requests 20] [--judge-ttft-ms 100] [--tokens 64]

Two simulated engines alike (time to first token 50 ms, 200 tokens a second)
serve `plain` (`guard.check = "none"`) and `guarded` (`both`: the prompt is
judged before the engine sees it, the answer after it ends); a simulated
judge answers `safe` after a fixed time to first token. Requests go one at a
time. Reported for each, streamed and not: time to first content byte and to
the last byte (median, p90), and the guarded figure as a ratio to the plain
one. A guarded stream is held until its answer is judged, so its first
content byte comes after the whole answer and two verdicts: the ratio says
what that costs a chat client watching the text appear.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmgw import settings, store  # noqa: E402
from llmgw.people import keys  # noqa: E402
from llmgw.procs import free_port, http_status, wait_for  # noqa: E402


def start(argv: list[str], log: str, procs: list) -> None:
    with open(log, "wb") as f:
        procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT))


def sim(model: str, ttft_ms: float, tokens_per_s: float, reply: str | None, tmp: str, procs: list) -> str:
    port = free_port()
    argv = [sys.executable, "-m", "llmgw", "sim", "--listen", f"127.0.0.1:{port}", "--model", model,
            "--ttft-ms", str(ttft_ms), "--tokens-per-s", str(tokens_per_s), "--no-prefix-cache"]
    start(argv + (["--reply", reply] if reply else []), os.path.join(tmp, f"{model}.log"), procs)
    url = f"http://127.0.0.1:{port}"
    wait_for(f"the sim {model}", 20, lambda: http_status(url + "/health") == 200)
    return url


def one(port: int, key: str, model: str, stream: bool, tokens: int) -> tuple[float, float]:
    """(seconds to the first content byte, seconds to the last byte) of one chat request."""
    body = json.dumps({"model": model, "stream": stream, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": "Tell me about bread."}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Authorization": f"Bearer {key}",
                                                         "Content-Type": "application/json"})
    resp = conn.getresponse()
    first = None
    while chunk := resp.read1(65536):
        # A comment (the held stream's keep-alive) is not content.
        if first is None and (not stream or b'"content"' in chunk):
            first = time.perf_counter() - t0
    last = time.perf_counter() - t0
    conn.close()
    assert resp.status == 200, resp.status
    return first, last


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50_ms": round(statistics.median(ordered) * 1000, 1),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--judge-ttft-ms", type=float, default=100.0)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            endpoints = [{"id": m, "url": sim(m, 50, 200, None, tmp, procs), "models": [m]} for m in ("plain", "guarded")]
            endpoints.append({"id": "judge", "url": sim("judge", args.judge_ttft_ms, 1000, "safe", tmp, procs),
                              "models": ["judge"]})
            models = [{"name": "plain", "guard": {"check": "none"}}, {"name": "guarded"},
                      {"name": "judge", "role": "guard"}]
            url = f"sqlite:///{tmp}/bench.db"
            engine = store.open_store(url)
            key = keys.create_key(engine, "bench")[1]
            engine.dispose()
            port = free_port()
            config = os.path.join(tmp, "gateway.toml")
            with open(config, "w") as f:
                f.write(settings.to_toml({"gateway.listen": f"127.0.0.1:{port}", "gateway.workers": 1,
                                          "gateway.metrics_listen": f"127.0.0.1:{free_port()}", "store.url": url,
                                          "guard.model": "judge"}, endpoints, models))
            start([sys.executable, os.path.join(ROOT, "gateway.py"), "--config", config],
                  os.path.join(tmp, "gateway.log"), procs)
            wait_for("the gateway", 30, lambda: http_status(f"http://127.0.0.1:{port}/ready") == 200)
            results = {"judge_ttft_ms": args.judge_ttft_ms, "tokens": args.tokens, "requests": args.requests}
            for stream in (False, True):
                figures = {}
                for model in ("plain", "guarded"):
                    one(port, key, model, stream, args.tokens)  # warm the connections
                    runs = [one(port, key, model, stream, args.tokens) for _ in range(args.requests)]
                    figures[model] = {"first_byte": summary([r[0] for r in runs]),
                                      "last_byte": summary([r[1] for r in runs])}
                figures["ratio_first_byte_p50"] = round(figures["guarded"]["first_byte"]["p50_ms"]
                                                        / figures["plain"]["first_byte"]["p50_ms"], 2)
                figures["ratio_last_byte_p50"] = round(figures["guarded"]["last_byte"]["p50_ms"]
                                                       / figures["plain"]["last_byte"]["p50_ms"], 2)
                results["stream" if stream else "whole"] = figures
            print(json.dumps(results, indent=2))
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
