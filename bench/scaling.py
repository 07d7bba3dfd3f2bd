"""Scaling with load, measured: time to first token under a ramp of clients, with load scaling on and off.

    python bench/scaling.py [--quick] [--out FILE]

Real processes: a controller, one agent running simulated engines (`llmgw sim`) that generate two answers
at once at 20 tokens a second after 50 ms (the rest wait in the engine, as in vLLM's queue, and say so on
`/metrics`), and a gateway with one worker. The same ramp of clients runs twice, each time on a fresh
cluster: first with the model held at one replica (`scaling.max = 1`: scaling off), then free to grow
to three (`scaling.max = 3`), with the controller's windows at 5 s up and 10 s down. Each client streams
a chat of 20 tokens, sending its next when the last has ended. The ramp:

    2 clients for 15 s, 8 for 45 s, 2 for 30 s (--quick: 8, 25, 15 s)

Reported for each phase and for the whole run: requests answered, failures, the mean and p95 time to
first token (first byte of the stream's first event), and the replicas ready at the phase's end; with
scaling on beside off from the same run, as a ratio. Each decision the scaler logged is listed with when
it came after the ramp started.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmgw.procs import wait_for  # noqa: E402
from tests.cluster import Agent, Controller  # noqa: E402
from tests.conftest import Gateway, make_key  # noqa: E402

ARGS = ["--max-concurrency", "2", "--ttft-ms", "50", "--tokens-per-s", "20"]
RAMP = [("light", 2, 15.0), ("heavy", 8, 45.0), ("light again", 2, 30.0)]
QUICK = [("light", 2, 8.0), ("heavy", 8, 25.0), ("light again", 2, 15.0)]
BODY = json.dumps({"model": "ramp", "max_tokens": 20, "stream": True,
                   "messages": [{"role": "user", "content": "go"}]}).encode()


def first_token(port: int, key: str) -> float | None:
    """Seconds to the first event of a streamed chat, read to its end; None when it failed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", BODY,
                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return None
        while True:
            line = resp.readline()
            if not line:
                return None
            if line.startswith(b"data: {"):
                ttft = time.perf_counter() - sent
                break
        rest = resp.read()
        return ttft if b"[DONE]" in rest else None
    except OSError:
        return None
    finally:
        conn.close()


class Client(threading.Thread):
    def __init__(self, port: int, key: str, results: list):
        super().__init__(daemon=True)
        self.port, self.key, self.results = port, key, results
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            self.results.append((time.monotonic(), first_token(self.port, self.key)))


def summary(values: list[float | None]) -> dict:
    good = sorted(v for v in values if v is not None)
    out = {"answered": len(good), "failed": len(values) - len(good)}
    if good:
        out.update(mean_s=round(statistics.fmean(good), 3), p95_s=round(good[int(0.95 * (len(good) - 1))], 3))
    return out


def run(tmp: Path, high: int, ramp: list) -> dict:
    """The ramp against a fresh cluster whose model may grow to HIGH replicas."""
    model = {"name": "ramp", "source": "/dev/null", "scaling": {"min": 1, "max": high},
             "profiles": [{"engine": "sim", "args": ARGS}]}
    store_url = f"sqlite:///{tmp}/cluster.db"
    made = []
    try:
        c = Controller(tmp, store_url=store_url, models=[model], controller__scale_up_after=5.0,
                       controller__scale_down_after=10.0)
        made.append(c)
        made.append(Agent(tmp, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1")))
        gw = Gateway(tmp, store_url, workers=1, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                     gateway__key_file=c.gateway_key_file())
        made.append(gw)
        key = make_key(store_url)
        wait_for("the replica", 60, lambda: len(c.ready("ramp")) == 1)
        wait_for("an answer", 60, lambda: first_token(gw.port, key) is not None)
        results: list = []
        clients: list[Client] = []
        phases = []
        started = time.monotonic()
        for name, count, seconds in ramp:
            while len(clients) < count:
                clients.append(Client(gw.port, key, results))
                clients[-1].start()
            while len(clients) > count:
                clients.pop().done.set()
            begun = time.monotonic()
            time.sleep(seconds)
            phases.append({"phase": name, "clients": count, "seconds": seconds, "began": begun,
                           "replicas_ready": len(c.ready("ramp"))})
        for client in clients:
            client.done.set()
        for client in clients:
            client.join(timeout=300)
        ends = [p["began"] for p in phases[1:]] + [float("inf")]
        for phase, end in zip(phases, ends):
            phase.update(summary([v for at, v in results if phase["began"] <= at < end]))
            del phase["began"]
        scaling = c.api("/api/v1/models/ramp/placement").get("scaling") or {"decisions": []}
        decisions = []
        wall_start = time.time() - (time.monotonic() - started)
        for d in scaling["decisions"]:
            decisions.append({"after_s": round(d["at"] - wall_start, 1), "reason": d["reason"]})
        return {"max_replicas": high, "phases": phases, "whole": summary([v for _, v in results]),
                "decisions": decisions}
    finally:
        for thing in reversed(made):
            thing.stop()


def ratio(a, b):
    return round(a / b, 2) if a is not None and b else None


def report(r: dict) -> str:
    off, on = r["off"], r["on"]
    lines = [f"load scaling under a ramp ({r['machine']}); time to first token, scaling on (max 3) beside off "
             "(max 1)", ""]
    lines.append(f"{'phase':<14}{'clients':>8}{'replicas':>10}{'mean on':>9}{'mean off':>9}{'ratio':>7}"
                 f"{'p95 on':>8}{'p95 off':>9}{'ratio':>7}{'failed':>8}")
    for a, b in zip(on["phases"] + [on["whole"]], off["phases"] + [off["whole"]]):
        name = a.get("phase", "whole run")
        lines.append(f"{name:<14}{a.get('clients', ''):>8}{str(a.get('replicas_ready', '')) + '/' + str(b.get('replicas_ready', '')):>10}"
                     f"{a.get('mean_s', '-'):>9}{b.get('mean_s', '-'):>9}{str(ratio(a.get('mean_s'), b.get('mean_s'))):>7}"
                     f"{a.get('p95_s', '-'):>8}{b.get('p95_s', '-'):>9}{str(ratio(a.get('p95_s'), b.get('p95_s'))):>7}"
                     f"{str(a['failed']) + '/' + str(b['failed']):>8}")
    lines += ["", "decisions (scaling on):"] + [f"  +{d['after_s']} s: {d['reason']}" for d in on["decisions"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="A shorter ramp (48 s instead of 90 s a run).")
    parser.add_argument("--out", help="Also write the figures to this JSON file.")
    args = parser.parse_args()
    ramp = QUICK if args.quick else RAMP
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "ramp": ramp}
    with tempfile.TemporaryDirectory() as off_dir, tempfile.TemporaryDirectory() as on_dir:
        result["off"] = run(Path(off_dir), 1, ramp)
        result["on"] = run(Path(on_dir), 3, ramp)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
