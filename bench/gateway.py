"""What the gateway adds to a request, measured beside the engine called directly in the same run.

    python bench/gateway.py [--quick] [--out bench/results/gateway.json]

The gateway runs with one worker pinned to CPU 0; the simulated engine (no
delay: it answers as fast as it can write) and the load generator share CPU 1,
so the figures measure the gateway rather than two programs fighting over a
core. Authentication and usage recording are on, as in service. Each figure
is reported with its baseline from the same run: the engine called directly.

Measured: added latency one request at a time (p50, p99); gateway CPU per
plain request and per 16-token stream (CPU time of the gateway's processes
over the run, divided by requests); the most requests a second at 32
concurrent clients; added time to first byte for streams; and how many
concurrent streams one worker holds, with its memory per stream.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.procstat import children, cpu_seconds, rss_kib, settled_rss_kib  # noqa: E402
from llmgw import store  # noqa: E402
from llmgw.people import keys  # noqa: E402
from llmgw.procs import free_port, http_status, raise_fd_limit, wait_for  # noqa: E402


class Rig:
    def __init__(self, tmp: str, tokens_per_s: float = 0.0, ttft_ms: float = 0.0, name: str = "sim"):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.sim_port = free_port()
        self.sim = self.start(["taskset", "-c", "1", sys.executable, "-m", "llmgw", "sim", "--listen",
                               f"127.0.0.1:{self.sim_port}", "--model", "sim", "--ttft-ms", str(ttft_ms),
                               "--tokens-per-s", str(tokens_per_s), "--no-prefix-cache"], f"{name}-sim.log")
        self.engine_url = f"http://127.0.0.1:{self.sim_port}"
        wait_for("the simulated engine", 20, lambda: http_status(self.engine_url + "/health") == 200)
        url = f"sqlite:///{tmp}/{name}.db"
        engine = store.open_store(url)
        self.key = keys.create_key(engine, "bench")[1]
        engine.dispose()
        self.port = free_port()
        self.gateway = self.start(["taskset", "-c", "0", sys.executable, os.path.join(ROOT, "gateway.py"),
                                   "--workers", "1", "--listen", f"127.0.0.1:{self.port}",
                                   "--metrics-listen", f"127.0.0.1:{free_port()}", "--store", url,
                                   "--endpoint", f"sim={self.engine_url}=sim"], f"{name}-gateway.log")
        self.url = f"http://127.0.0.1:{self.port}"
        wait_for("the gateway", 30, lambda: http_status(self.url + "/ready") == 200)
        wait_for("its worker", 10, lambda: children(self.gateway.pid))
        self.worker = children(self.gateway.pid)[0]

    def start(self, argv, log):
        with open(os.path.join(self.tmp, log), "wb") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def gateway_cpu(self) -> float:
        return cpu_seconds(self.gateway.pid) + sum(cpu_seconds(p) for p in children(self.gateway.pid))

    def load(self, url: str, key: str = "", background=False, **options) -> dict | subprocess.Popen:
        argv = ["taskset", "-c", "1", sys.executable, os.path.join(ROOT, "bench", "loadgen.py"), "--url", url]
        if key:
            argv += ["--key", key]
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            if value is not False:
                argv += [flag] if value is True else [flag, str(value)]
        if background:
            return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        return json.loads(run.stdout)

    def stop(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def measure_latency(rig: Rig, n: int, stream: bool) -> dict:
    kw = dict(requests=n, concurrency=1, max_tokens=16 if stream else 16, stream=stream)
    rig.load(rig.engine_url, **{**kw, "requests": 50})  # warm both paths
    rig.load(rig.url, rig.key, **{**kw, "requests": 50})
    direct = rig.load(rig.engine_url, **kw)
    before = rig.gateway_cpu()
    through = rig.load(rig.url, rig.key, **kw)
    cpu = rig.gateway_cpu() - before
    return {"direct": direct, "gateway": through, "gateway_cpu_ms_per_request": round(cpu * 1000 / through["ok"], 3)}


def measure_throughput(rig: Rig, seconds: float) -> dict:
    direct = rig.load(rig.engine_url, concurrency=32, duration=seconds)
    before = rig.gateway_cpu()
    through = rig.load(rig.url, rig.key, concurrency=32, duration=seconds)
    cpu = rig.gateway_cpu() - before
    return {"direct": direct, "gateway": through, "gateway_cpu_ms_per_request": round(cpu * 1000 / through["ok"], 3)}


def measure_held_streams(tmp: str, count: int) -> dict:
    """COUNT streams open at once through one worker; its memory before and while they are held."""
    rig = Rig(tmp, tokens_per_s=0.5, ttft_ms=0, name="held")
    try:
        rig.load(rig.url, rig.key, requests=20, concurrency=1, max_tokens=1)  # warm
        idle = rss_kib(rig.worker)
        load = rig.load(rig.url, rig.key, background=True, stream=True, requests=count, concurrency=count,
                        max_tokens=12, timeout=120)

        def running() -> float:
            with urllib.request.urlopen(rig.engine_url + "/metrics") as resp:
                text = resp.read().decode()
            return float(re.search(r"^vllm:num_requests_running\{.*\} (\S+)$", text, re.M).group(1))

        wait_for(f"{count} streams to be open", 60, lambda: running() >= count, interval=0.2)
        held = settled_rss_kib(rig.worker)
        out, _ = load.communicate(timeout=120)
        result = json.loads(out)
        return {"streams": count, "completed": result["ok"], "failed": result["failed"],
                "worker_rss_idle_kib": idle, "worker_rss_held_kib": held,
                "kib_per_stream": round((held - idle) / count, 1)}
    finally:
        rig.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gateway.json"))
    parser.add_argument("--held-streams", type=int, default=2000)
    args = parser.parse_args()
    raise_fd_limit()
    n = 300 if args.quick else 2000
    seconds = 3.0 if args.quick else 10.0
    tmp = tempfile.mkdtemp(prefix="llmgw-bench-")
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "processor": platform.processor() or platform.machine()},
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rig = Rig(tmp)
    try:
        results["plain"] = measure_latency(rig, n, stream=False)
        results["stream"] = measure_latency(rig, n // 2, stream=True)
        results["throughput"] = measure_throughput(rig, seconds)
    finally:
        rig.stop()
    results["held"] = measure_held_streams(tmp, args.held_streams if not args.quick else 500)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(report(results))
    return 0


def report(r: dict) -> str:
    p, s, t, h = r["plain"], r["stream"], r["throughput"], r["held"]
    added = lambda a, b: round(a - b, 3)  # noqa: E731
    rows = [
        ("plain request, one at a time: p50 latency (ms)", p["direct"]["p50_ms"], p["gateway"]["p50_ms"],
         added(p["gateway"]["p50_ms"], p["direct"]["p50_ms"])),
        ("plain request, one at a time: p99 latency (ms)", p["direct"]["p99_ms"], p["gateway"]["p99_ms"],
         added(p["gateway"]["p99_ms"], p["direct"]["p99_ms"])),
        ("16-token stream: p50 time to first byte (ms)", s["direct"]["ttfb_p50_ms"], s["gateway"]["ttfb_p50_ms"],
         added(s["gateway"]["ttfb_p50_ms"], s["direct"]["ttfb_p50_ms"])),
        ("16-token stream: p50 to the last byte (ms)", s["direct"]["p50_ms"], s["gateway"]["p50_ms"],
         added(s["gateway"]["p50_ms"], s["direct"]["p50_ms"])),
        ("32 clients: requests a second", t["direct"]["rps"], t["gateway"]["rps"],
         f"ratio {t['gateway']['rps'] / t['direct']['rps']:.2f}"),
    ]
    lines = ["| measure | engine directly | through the gateway | added |", "| --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines += ["", f"gateway CPU per plain request, one at a time: {p['gateway_cpu_ms_per_request']} ms",
              f"gateway CPU per plain request, 32 clients: {t['gateway_cpu_ms_per_request']} ms",
              f"gateway CPU per 16-token stream: {s['gateway_cpu_ms_per_request']} ms",
              f"streams held by one worker: {h['streams']} ({h['completed']} completed, {h['failed']} failed), "
              f"{h['kib_per_stream']} KiB each (worker RSS {h['worker_rss_idle_kib']} KiB idle, "
              f"{h['worker_rss_held_kib']} KiB holding them)"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
