"""What speaking another client API costs: each dialect's requests beside chat completions, in the same run.

    python bench/dialects.py [--quick] [--out bench/results/dialects.json]

It runs bench/rig.py's rig (one gateway worker pinned to CPU 0; the
simulated engine, answering at once, and the load on CPU 1) and sends the
same 16-token answer one request at a time through every API the load
generator speaks (bench/loadgen.py's APIS: a new dialect is measured once it
is added there), whole and streamed. Each API's p50 latency and gateway CPU
per request are reported beside chat completions' from the same run, with the
difference: what reading the request into a chat request and the answer back
out costs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.loadgen import APIS  # noqa: E402
from bench.rig import Rig  # noqa: E402
from llmgw.procs import raise_fd_limit  # noqa: E402

BASELINE = "chat"


def measure(rig: Rig, api: str, n: int, stream: bool) -> dict:
    kw = dict(api=api, requests=n, concurrency=1, max_tokens=16, stream=stream)
    rig.load(rig.url, rig.key, **{**kw, "requests": 50})  # warm the path
    before = rig.gateway_cpu()
    result = rig.load(rig.url, rig.key, **kw)
    cpu = rig.gateway_cpu() - before
    return {"p50_ms": result["p50_ms"], "p99_ms": result["p99_ms"], "ttfb_p50_ms": result["ttfb_p50_ms"],
            "ok": result["ok"], "failed": result["failed"],
            "gateway_cpu_ms_per_request": round(cpu * 1000 / max(1, result["ok"]), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "dialects.json"))
    args = parser.parse_args()
    raise_fd_limit()
    n = 300 if args.quick else 2000
    rig = Rig(tempfile.mkdtemp(prefix="llmgw-bench-"))
    results = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "requests": n, "apis": {}}
    try:
        # Interleaved rather than one API after another, so that a machine getting busier mid-run
        # weighs on every API alike.
        for stream in (False, True):
            for api in APIS:
                results["apis"].setdefault(api, {})["stream" if stream else "plain"] = measure(rig, api, n, stream)
    finally:
        rig.stop()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(report(results))
    return 0


def report(r: dict) -> str:
    base = r["apis"][BASELINE]
    lines = ["| API | request | p50 latency (ms) | added to chat's | gateway CPU a request (ms) | added to chat's |",
             "| --- | --- | --- | --- | --- | --- |"]
    for api, shapes in r["apis"].items():
        for shape, m in shapes.items():
            b = base[shape]
            lines.append(f"| {api} | {shape} | {m['p50_ms']} | {m['p50_ms'] - b['p50_ms']:+.3f} | "
                         f"{m['gateway_cpu_ms_per_request']} | "
                         f"{m['gateway_cpu_ms_per_request'] - b['gateway_cpu_ms_per_request']:+.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
