"""One gateway core saturated: requests a second per core beside vllm-router's, with an engine that is not the limit.

    python bench/onecore.py [--quick] [--rounds N] [--seconds S] [--baseline CHECKOUT] [--calm LOAD]
                            [--out bench/results/onecore.json]

bench/gateway.py measures what a request costs the gateway; its simulated engine (`llmgw sim`, Python)
answers at most about 6,000 plain requests a second here, below what one gateway core passes, so its
figures at 32 clients are the engine's ceiling, never the gateway's. Here the engine is a stand-in that
costs next to nothing: nginx, one worker, answering every chat request with the bytes `llmgw sim` sent
for the same request (captured at the start: a whole answer of 16 tokens on one port, a stream of 16
tokens with its usage event on another). The load generator is wrk (C, one thread, 32 keep-alive
connections, closed loop: each connection sends its next request when its last answer has ended). Both
run on CPU 1; each subject runs alone on CPU 0 with one process or worker:

- the stand-in called directly (what CPU 1 can answer: the bench's ceiling, which must be well above
  every subject's, or their figures are its);
- llmgw's gateway, one gevent worker, with a key nothing limits, authentication, usage rows and metrics
  on, as in service (`--baseline CHECKOUT`: another checkout's gateway beside it);
- vllm-router 0.1.17 (Rust, tokio), round robin over the one stand-in, as bench/gateway.py runs it
  (bench/rivals.py installs it).

For each subject and load, over S seconds: requests answered a second, p50 and p99 latency (wrk's own
measure, to the answer's last byte), the subject's CPU a request (from /proc, all its threads), and how
busy each CPU was (from /proc/stat): CPU 0 near 100% says the subject is the limit, CPU 1 near 100% that
the stand-in and wrk are; and how much of CPU 0's time was the kernel's (system calls, loopback TCP), which
no gateway written in any language avoids. Each load runs on every subject in turn, ROUNDS times; figures are medians.
Aim (issue 32): the gateway's plain requests a second at 32 clients at least two thirds of vllm-router's,
and its p99 at most 1.5 times the router's; printed with verdicts, and `--quick` (a smoke run, a test
runs it) prints them too but they judge nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import rivals  # noqa: E402
from bench.curves import NOISY_LOAD  # noqa: E402
from bench.gateway import baseline_gateway, shared_arguments, wait_calm  # noqa: E402
from bench.rig import LOAD_CPU, SUBJECT_CPU, Procs, Rig  # noqa: E402
from llmgw.procs import free_port, http_status, wait_for  # noqa: E402

NGINX, WRK = "/usr/sbin/nginx", "/usr/bin/wrk"
CLIENTS, MAX_TOKENS = 32, 16
PLAIN, STREAM = "plain", "stream"
LOADS = {PLAIN: "plain requests, 32 clients", STREAM: "16-token streams, 32 clients"}
MODELS = {PLAIN: "sim", STREAM: "sim-stream"}  # the gateway's model for each load, each its own stand-in
ENGINE, GATEWAY, BASELINE, ROUTER = "stand-in directly", "gateway", "baseline", "vllm-router"
RPS_AIM, P99_AIM = 2 / 3, 1.5


def body(model: str, stream: bool) -> bytes:
    """The request bench/loadgen.py sends (bench/gateway.py's loads), to MODEL."""
    return json.dumps({"model": model, "max_tokens": MAX_TOKENS, "stream": stream,
                       "messages": [{"role": "user", "content": "benchmark"}]}).encode()


def captured(tmp: str) -> dict[str, bytes]:
    """What `llmgw sim` answers the gateway's requests, a whole answer and a stream (asked for its usage, as the
    gateway asks every stream), as bytes to replay."""
    procs = Procs(tmp)
    try:
        url = procs.sim("capture", "sim", ["--ttft-ms", "0", "--tokens-per-s", "0"])
        answers = {}
        for load, stream in ((PLAIN, False), (STREAM, True)):
            request = json.loads(body("sim", stream))
            if stream:
                request["stream_options"] = {"include_usage": True}
            with urllib.request.urlopen(urllib.request.Request(
                    url + "/v1/chat/completions", json.dumps(request).encode(),
                    {"Content-Type": "application/json"}), timeout=30) as resp:
                answers[load] = resp.read()
        return answers
    finally:
        procs.stop()


def nginx_string(data: bytes) -> str:
    """DATA as one of nginx's quoted strings (it reads \\n, \\r, \\\\ and \\' in them; $ would name a variable)."""
    text = data.decode()
    if "$" in text:
        raise ValueError("a captured answer holds '$', which nginx would read as a variable")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\r", "\\r").replace("\n", "\\n") + "'"


class StandIn:
    """nginx on CPU 1, one worker, a port a load: every path answers the captured bytes, but /health and /status
    (nginx's counts, of which `requests()` reads the requests it has answered)."""

    def __init__(self, procs: Procs, answers: dict[str, bytes]):
        self.ports = {load: free_port() for load in answers}
        prefix = os.path.join(procs.tmp, "nginx")
        os.makedirs(prefix, exist_ok=True)
        types = {PLAIN: "application/json", STREAM: "text/event-stream"}
        servers = "".join(f"""
  server {{
    listen 127.0.0.1:{self.ports[load]};
    location = /health {{ return 200 ''; }}
    location = /status {{ stub_status; }}
    location / {{ default_type {types[load]}; return 200 {nginx_string(data)}; }}
  }}""" for load, data in answers.items())
        # Keep-alive for as many requests as a run sends: a connection the stand-in closed would be a cost of
        # whoever reconnects, not of its requests.
        config = f"""worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 600s;
  client_body_temp_path {prefix}/body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;{servers}
}}
"""
        path = os.path.join(prefix, "nginx.conf")
        with open(path, "w") as f:
            f.write(config)
        self.proc = procs.start(["taskset", "-c", LOAD_CPU, NGINX, "-p", prefix, "-c", path], "nginx.log")
        for port in self.ports.values():
            wait_for("the stand-in engine (nginx)", 30, lambda p=port: http_status(f"http://127.0.0.1:{p}/health") == 200,
                     alive=lambda: self.proc.poll() is None)

    def url(self, load: str) -> str:
        return f"http://127.0.0.1:{self.ports[load]}"

    def requests(self) -> int:
        """Requests nginx has answered on every port since it started (its status requests among them)."""
        with urllib.request.urlopen(self.url(PLAIN) + "/status", timeout=10) as resp:
            return int(resp.read().decode().splitlines()[2].split()[2])  # "server accepts handled requests"


WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local key = os.getenv("BENCH_KEY")
if key and key ~= "" then wrk.headers["Authorization"] = "Bearer " .. key end
wrk.body = os.getenv("BENCH_BODY")
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"requests": %d, "duration_us": %d, "status_errors": %d, "socket_errors": %d, ' ..
    '"p50_us": %d, "p99_us": %d}\\n', summary.requests, summary.duration, e.status,
    e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99)))
end
"""


def cpu_busy() -> dict[str, tuple[int, int, int]]:
    """Each CPU's (busy, in the kernel, total) clock ticks since boot, from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
                total = user + nice + system + idle + iowait + irq + softirq + steal
                out[name[3:]] = (total - idle - iowait, system + irq + softirq, total)
    return out


class Subject:
    def __init__(self, name: str, urls: dict[str, str], key: str = "", cpu=None, models: dict | None = None):
        """URLS: by load, where to send it; CPU: the CPU seconds the subject's processes have spent (None for the
        stand-in, whose CPU is the load's); MODELS: by load, the model to ask for."""
        self.name, self.urls, self.key, self.cpu = name, urls, key, cpu
        self.models = models or MODELS

    def check(self, load: str) -> None:
        """One request of LOAD answered whole (a stream to its [DONE]), or RuntimeError: wrk counts answers,
        it does not read them."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})}
        request = urllib.request.Request(self.urls[load] + "/v1/chat/completions",
                                         body(self.models[load], load == STREAM), headers)
        with urllib.request.urlopen(request, timeout=30) as resp:
            answer = resp.read()
        whole = answer.endswith(b"data: [DONE]\n\n") if load == STREAM else b'"choices"' in answer
        if not whole:
            raise RuntimeError(f"{self.name} answered a {load} request with {answer[-300:]!r}")

    def run(self, load: str, seconds: float, script: str) -> dict:
        env = {**os.environ, "BENCH_KEY": self.key, "BENCH_BODY": body(self.models[load], load == STREAM).decode()}
        before_cpu, before = (self.cpu() if self.cpu else None), cpu_busy()
        run = subprocess.run(["taskset", "-c", LOAD_CPU, WRK, "-t1", f"-c{CLIENTS}", f"-d{seconds:g}s", "--timeout",
                              "10s", "-s", script, self.urls[load] + "/v1/chat/completions"],
                             capture_output=True, text=True, env=env, timeout=seconds + 120)
        after = cpu_busy()
        line = next((s for s in run.stdout.splitlines() if s.startswith("{")), None)
        if run.returncode != 0 or line is None:
            raise RuntimeError(f"wrk failed against {self.name}: {(run.stderr or run.stdout).strip()[-1000:]}")
        r = json.loads(line)
        answered = r["requests"] - r["status_errors"]
        out = {"rps": round(answered / (r["duration_us"] / 1e6), 1), "p50_ms": r["p50_us"] / 1000,
               "p99_ms": r["p99_us"] / 1000, "failed": r["status_errors"] + r["socket_errors"]}
        if self.cpu:
            out["cpu_us"] = round((self.cpu() - before_cpu) * 1e6 / max(1, answered), 1)
        for cpu in (SUBJECT_CPU, LOAD_CPU):
            busy, _, total = (a - b for a, b in zip(after[cpu], before[cpu]))
            out[f"cpu{cpu}_busy"] = round(busy / max(1, total), 3)
        if self.cpu:  # what the subject's core spent in the kernel (system calls, loopback TCP), of all it spent
            out["cpu0_kernel"] = round((after[SUBJECT_CPU][1] - before[SUBJECT_CPU][1]) /
                                       max(1, after[SUBJECT_CPU][0] - before[SUBJECT_CPU][0]), 3)
        return out


def measure(subjects: list[Subject], rounds: int, seconds: float, script: str) -> tuple[dict, list]:
    for s in subjects:  # warm every path (connections opened, caches filled), each answering whole
        for load in LOADS:
            s.check(load)
            s.run(load, 1, script)
    raw: dict = {s.name: {load: [] for load in LOADS} for s in subjects}
    loadavg = []
    for r in range(rounds):
        loadavg.append(os.getloadavg()[0])
        print(f"round {r + 1} of {rounds} (load average {loadavg[-1]:.1f})", file=sys.stderr)
        for load in LOADS:
            for s in subjects:
                raw[s.name][load].append(s.run(load, seconds, script))
    loadavg.append(os.getloadavg()[0])
    return raw, loadavg


def medians(raw: dict) -> dict:
    out: dict = {}
    for subject, loads in raw.items():
        for load, runs in loads.items():
            m = {f: statistics.median(r[f] for r in runs) for f in runs[0] if f != "failed"}
            m["failed"] = sum(r["failed"] for r in runs)
            out.setdefault(subject, {})[load] = m
    return out


def verdicts(f: dict, began: float) -> list[str]:
    """The aims' verdicts on the figures F of a run begun at the load average BEGAN: above NOISY_LOAD the
    ratios are shown, not judged."""
    gw, router, engine = f.get(GATEWAY, {}).get(PLAIN), f.get(ROUTER, {}).get(PLAIN), f[ENGINE][PLAIN]
    if not gw or not router:
        return ["not judged: vllm-router was not measured"]
    busy = f"not judged, the run began at a load average of {began:.1f} (above {NOISY_LOAD:g})" \
        if began > NOISY_LOAD else None
    out = []
    # The stand-in must be out of the way: when it answers barely more than the fastest subject, the subjects'
    # figures are partly its.
    fastest = max(gw["rps"], router["rps"])
    if engine["rps"] < 1.5 * fastest:
        out.append(f"the stand-in answers {engine['rps']:,.0f} a second directly, less than 1.5 times the fastest "
                   f"subject's {fastest:,.0f}: the figures below may be partly its own ceiling")
    rps = gw["rps"] / router["rps"]
    out.append(f"plain requests a second at 32 clients, gateway / vllm-router: x{rps:.2f} (aim at least "
               f"x{RPS_AIM:.2f}): " + (busy or ("met" if rps >= RPS_AIM else
                                               f"NOT met, {RPS_AIM / rps:.2f} times more needed")))
    p99 = gw["p99_ms"] / router["p99_ms"]
    out.append(f"p99 at 32 clients, gateway / vllm-router: x{p99:.2f} (aim at most x{P99_AIM:g}): "
               + (busy or ("met" if p99 <= P99_AIM else f"NOT met, {(1 - P99_AIM / p99) * 100:.0f}% less needed")))
    return out


def report(r: dict) -> str:
    f = r["figures"]
    columns = [s for s in (ENGINE, GATEWAY, BASELINE, ROUTER) if s in f]
    shown = [("answered a second", "rps", "{:,.0f}"), ("p50 latency (ms)", "p50_ms", "{:.2f}"),
             ("p99 latency (ms)", "p99_ms", "{:.2f}"), ("subject's CPU a request (µs)", "cpu_us", "{:.0f}"),
             ("CPU 0 busy (the subject's)", "cpu0_busy", "{:.0%}"),
             ("of which in the kernel", "cpu0_kernel", "{:.0%}"),
             ("CPU 1 busy (stand-in and wrk)", "cpu1_busy", "{:.0%}")]
    lines = ["| measure | " + " | ".join(columns) + " | gateway / vllm-router |", "| --- |" + " ---: |" * (len(columns) + 1)]
    for load, what in LOADS.items():
        for label, field, form in shown:
            cells = [form.format(f[s][load][field]) if field in f[s][load] else "" for s in columns]
            mine, theirs = (f.get(s, {}).get(load, {}).get(field) for s in (GATEWAY, ROUTER))
            ratio = f"{mine / theirs:.2f}" if mine is not None and theirs else ""
            lines.append(f"| {what}: {label} | " + " | ".join(cells) + f" | {ratio} |")
    avg = r["load_average"]
    lines += ["", f"{r['rounds']} round(s) of {r['seconds']:g} s a load and subject; medians. Load average (1 min) "
                  f"{min(avg):.1f} to {max(avg):.1f} over the run, on {r['machine']['cpus']} CPUs."
                  + (f" Noisy: the run began above {NOISY_LOAD:g}." if avg[0] > NOISY_LOAD else "")]
    if r.get("baseline"):
        lines.append(f"baseline: the gateway of {r['baseline']}.")
    lines += [f"{name}: {said}" for name, said in r["rivals"].items() if said != "measured"]
    lines += [f"FAILED: {s} {load}: {m['failed']} requests" for s, loads in f.items() for load, m in loads.items()
              if m["failed"]]
    lines += ["", "Aims (issue 32):"] + [f"- {v}" for v in r["verdicts"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of 2 s: a smoke run")
    parser.add_argument("--seconds", type=float, help="seconds of each load on each subject [8; --quick 2]")
    shared_arguments(parser, "onecore")
    args = parser.parse_args()
    missing = [path for path in (NGINX, WRK) if not shutil.which(path)]
    if missing:
        parser.error(f"{' and '.join(missing)} missing: sudo apt-get install nginx wrk")
    baseline = baseline_gateway(parser, args)
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.seconds or (2.0 if args.quick else 8.0)
    if args.calm is not None:
        wait_calm(args.calm, 1800)
    tmp = tempfile.mkdtemp(prefix="llmgw-bench-onecore-")
    script = os.path.join(tmp, "wrk.lua")
    with open(script, "w") as f:
        f.write(WRK_SCRIPT)
    results: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                 "processor": platform.processor() or platform.machine()},
                     "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": rounds,
                     "seconds": seconds, "baseline": args.baseline, "rivals": {}}
    procs = Procs(tmp)
    rigs: list[Rig] = []
    try:
        stand_in = StandIn(procs, captured(tmp))
        engines = {MODELS[load]: stand_in.url(load) for load in LOADS}
        subjects = [Subject(ENGINE, {load: stand_in.url(load) for load in LOADS})]
        for name, command in ((GATEWAY, ()), (BASELINE, (sys.executable, baseline or ""))):
            if name == GATEWAY or baseline:
                rigs.append(Rig(tmp, name=name, engines=engines, gateway_command=command))
                subjects.append(Subject(name, {load: rigs[-1].url for load in LOADS}, rigs[-1].key,
                                        rigs[-1].gateway_cpu))
        try:  # a router a stand-in: vllm-router sends each request to its one worker as it came
            routers = {load: rivals.start(rivals.VllmRouter, procs, stand_in.url(load)) for load in LOADS}
            subjects.append(Subject(ROUTER, {load: routers[load].url for load in LOADS},
                                    cpu=lambda: sum(r.cpu() for r in routers.values())))
            results["rivals"][ROUTER] = "measured"
        except rivals.Unavailable as e:
            results["rivals"][ROUTER] = f"not measured: {e}"
            print(f"{ROUTER}: {results['rivals'][ROUTER]}", file=sys.stderr)
        raw, results["load_average"] = measure(subjects, rounds, seconds, script)
    finally:
        for rig in rigs:
            rig.stop()
        procs.stop()
    results["figures"], results["raw"] = medians(raw), raw
    results["verdicts"] = verdicts(results["figures"], results["load_average"][0])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(report(results))
    return 1 if any(m["failed"] for loads in results["figures"].values() for m in loads.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
