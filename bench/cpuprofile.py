"""Where the gateway's CPU goes, by part, for a plain request, a 16-token stream and a limited request.

    python bench/cpuprofile.py [--rounds 4] [--seconds 6] [--concurrency 1] [--only plain|stream|limited]
                               [--stand-in] [--out bench/results/profile.json]

It runs bench/rig.py's rig (one worker on CPU 0, the engine and the load on CPU 1), with the gateway started
through bench/probe.py, which samples the worker's main thread by the CPU it spends. The scenarios take
turns, ROUNDS windows of SECONDS each with a load running through each, so that a machine getting busier
weighs on all alike. Every sample is put down to the innermost part of the request path its stack is in
(PARTS: JSON decoded while reading the request counts to reading the request, a socket write of gunicorn's
response to gunicorn's response writing), and to every kind of work it holds (KINDS: JSON, socket calls,
timeouts, across the parts). The CPU each thread of the worker and of the master (whose accountant answers
the limited key) spent in the windows is read from /proc and divided by the requests the engine answered
meanwhile, so each part is given in milliseconds of CPU a request, and the threads the sampler does not
see (ZeroMQ's I/O threads, the accountant's) whole. The functions with the most CPU of their own, and where
they are mostly called from, are listed too. `--stand-in`: the engine is bench/onecore.py's nginx stand-in,
which costs next to nothing, instead of `llmgw sim`, so that at 32 clients the gateway's core is the limit.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import onecore  # noqa: E402
from bench.procstat import thread_cpu  # noqa: E402
from bench.rig import Procs, Rig  # noqa: E402
from llmgw.procs import raise_fd_limit, wait_for  # noqa: E402

SCENARIOS = {  # name: (what, loadgen options, which key)
    "plain": ("plain request, no limits", dict(), "key"),
    "stream": ("16-token stream, no limits", dict(stream=True), "key"),
    "limited": ("plain request, 4 levels", dict(), "limited_key"),
}

# (part, test on a frame's file and function): a sample is put down to the innermost frame that passes one,
# read from the leaf outwards, so that work is counted to the part of the request that asked for it: JSON
# decoding while reading the request counts as reading the request, a socket write of gunicorn's response
# as gunicorn's. Files are matched on their path below site-packages, the standard library or the checkout.
# What the work was (JSON, socket calls, timeouts...) is KINDS' view, across the parts.
PARTS = [
    ("metrics (prometheus_client)", lambda f, fn: f.startswith("prometheus_client/") or f.endswith("gateway/metrics.py")),
    # SQLAlchemy and sqlite3 are not parts: they count as whoever called them (usage rows, a key refresh).
    ("usage rows (buffer, batched writes to the store)", lambda f, fn: f.endswith("gateway/usage.py")),
    ("accountant round trip (limiter, ZeroMQ, its messages)",
     lambda f, fn: f.endswith("gateway/limiter.py") or f.startswith(("zmq/", "llmgw/wire/"))),
    ("authentication (key table)",
     lambda f, fn: f.endswith("gateway/keytable.py") or (f.endswith("gateway/admit.py") and fn == "authenticate")),
    ("engine client (upstream.py, its sockets)", lambda f, fn: f.endswith("gateway/upstream.py")),
    ("stream relay (sse.py, metering)", lambda f, fn: f.endswith(("gateway/sse.py", "gateway/metering.py"))),
    ("request reading and checks (apirequest, bodycheck, dialect)",
     lambda f, fn: f.endswith(("gateway/apirequest.py", "gateway/bodycheck.py", "gateway/dialect.py",
                               "gateway/jsonbound.py", "gateway/chatout.py", "gateway/promptcount.py"))),
    ("routing (balancer, snapshot, admission)",
     lambda f, fn: f.endswith(("gateway/balancer.py", "gateway/snapshot.py", "gateway/admission.py",
                               "gateway/breaker.py", "gateway/routes.py"))),
    ("proxy pipeline (proxy.py and its steps, caller, guard)",
     lambda f, fn: f.endswith(("gateway/proxy.py", "gateway/exchange.py", "gateway/admit.py", "gateway/attempts.py",
                               "gateway/forward.py", "gateway/billing.py", "gateway/caller.py", "gateway/guard.py",
                               "gateway/errors.py"))),
    ("request ids and log filter", lambda f, fn: f.endswith("gateway/requestid.py")),
    ("WSGI app dispatch (web/app.py, Flask)",
     lambda f, fn: f.endswith("web/app.py") or f.startswith(("flask/", "werkzeug/"))),
    ("connection guard (connguard.py)", lambda f, fn: f.endswith("gateway/connguard.py")),
    ("llmgw's HTTP layer (fastpath.py, httpout.py)", lambda f, fn: f.endswith(("gateway/fastpath.py",
                                                                                "gateway/httpout.py"))),
    ("background: replica checks, key refresh (worker.py, follower.py)",
     lambda f, fn: f.endswith(("gateway/worker.py", "gateway/follower.py"))),
    ("gunicorn: HTTP parsing", lambda f, fn: f.startswith("gunicorn/http/") and not f.endswith("wsgi.py")),
    ("gunicorn: WSGI environ and response writing", lambda f, fn: f.startswith(("gunicorn/http/wsgi.py",
                                                                                "gunicorn/util.py"))),
    ("gunicorn: worker loop (accept, keep-alive, handle)", lambda f, fn: f.startswith("gunicorn/")),
]
# Wrappers whose callees count as their caller's: the guard's bounded read is gunicorn reading the request
# (or whatever reads), and only the wrapper's own time is the guard's.
THIN = {("llmgw/gateway/connguard.py", "recv"), ("llmgw/gateway/connguard.py", "__getattr__"),
        ("llmgw/gateway/sockio.py", "send_all"), ("llmgw/gateway/sockio.py", "recv"),
        ("llmgw/gateway/sockio.py", "_wait_readable"), ("llmgw/gateway/sockio.py", "_expire")}
# A stack with none of the parts above: gevent's hub between greenlets (waking them, its timers, callbacks).
HUB = "gevent's hub and greenlet switches, outside any request part"
# (kind, test): a sample counts to every kind one of its frames passes; the kinds overlap the parts.
KINDS = [
    ("JSON (json module)", lambda f, fn: f.startswith("json/")),
    ("socket calls (gevent's socket: send, recv, and their waits)",
     lambda f, fn: f.startswith("gevent/_socket") or f.endswith("gateway/sockio.py")),
    ("gevent timeouts (made and cancelled around socket calls)",
     lambda f, fn: f.startswith("gevent/timeout.py") or (f.endswith("gateway/sockio.py") and fn == "_wait_readable")),
    ("logging (getLogger, filters)", lambda f, fn: f.startswith("logging/")),
    ("prometheus_client", lambda f, fn: f.startswith("prometheus_client/")),
    ("ZeroMQ (pyzmq)", lambda f, fn: f.startswith("zmq/")),
    ("the store (SQLAlchemy, sqlite3)", lambda f, fn: f.startswith(("sqlalchemy/", "sqlite3/"))),
    ("gunicorn's configuration read per request (config.py)", lambda f, fn: f.startswith("gunicorn/config.py")),
]


def short(path: str) -> str:
    """PATH from its package down: what PARTS match on."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    if re.search(r"/lib/python3\.\d+/", path):
        return re.split(r"/lib/python3\.\d+/", path, maxsplit=1)[1]
    return os.path.relpath(path, ROOT) if path.startswith("/") else path


def part_of(frames: list[tuple[str, str]]) -> str:
    for i, (file, fn) in enumerate(reversed(frames)):
        if i and (file, fn) in THIN:
            continue
        for part, test in PARTS:
            if test(file, fn):
                return part
    return HUB if all(file.startswith(("gevent/", "greenlet/")) for file, _ in frames) else "other"


def summarise(samples: list[dict], cpu_ms: float) -> dict:
    """The sampled thread's CPU (CPU_MS a request) by part, and the functions with the most of their own."""
    total = sum(s["ns"] for s in samples) or 1
    parts, kinds, own = collections.Counter(), collections.Counter(), collections.Counter()
    via: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for s in samples:
        frames = [(short(file), fn) for file, fn in s["stack"]]
        parts[part_of(frames)] += s["ns"]
        for kind, test in KINDS:
            if any(test(file, fn) for file, fn in frames):
                kinds[kind] += s["ns"]
        if frames:
            leaf = f"{frames[-1][1]} ({frames[-1][0]})"
            own[leaf] += s["ns"]
            via[leaf][" < ".join(f"{fn} ({os.path.basename(file)})" for file, fn in reversed(frames[-4:-1]))] += s["ns"]
    return {"sampled_s": round(total / 1e9, 3), "cpu_ms_per_request": round(cpu_ms, 4),
            "parts": [{"part": p, "share": round(n / total, 3), "ms": round(cpu_ms * n / total, 4)}
                      for p, n in parts.most_common()],
            "kinds": [{"kind": k, "share": round(n / total, 3), "ms": round(cpu_ms * n / total, 4)}
                      for k, n in kinds.most_common()],
            "own": [{"function": f, "share": round(n / total, 3), "ms": round(cpu_ms * n / total, 4),
                     "mostly_via": via[f].most_common(1)[0][0]} for f, n in own.most_common(15)]}


def threads_spent(before: dict, after: dict, main: int) -> collections.Counter:
    """CPU seconds of the main thread, ZeroMQ's I/O threads and the others (in the master, the accountant's
    and the metrics server's), between two readings."""
    spent = collections.Counter()
    for tid, (name, seconds) in after.items():
        label = "main thread" if tid == main else "ZeroMQ I/O" if name.startswith("ZMQbg") else "other threads"
        spent[label] += seconds - before.get(tid, (name, 0.0))[1]
    return spent


def sim_requests(rig: Rig) -> int:
    """Requests the simulated engine has answered."""
    with urllib.request.urlopen(rig.engine_url + "/metrics", timeout=10) as resp:
        return int(re.search(r"^llmgw_sim_requests_total (\d+)", resp.read().decode(), re.M).group(1))


class Scenario:
    """What SECONDS-long windows of one scenario have gathered: samples, threads' CPU, requests."""

    def __init__(self, name: str, concurrency: int):
        self.name, self.concurrency = name, concurrency
        self.samples: collections.Counter = collections.Counter()
        self.threads = {"worker": collections.Counter(), "master": collections.Counter()}
        self.requests = self.failed = 0

    def window(self, rig: Rig, seconds: float, prefix: str, engine_requests) -> None:
        """ENGINE_REQUESTS(): how many requests the engine has answered."""
        _, options, key = SCENARIOS[self.name]
        key = getattr(rig, key)
        started = engine_requests()
        running = rig.load(rig.url, key, background=True, duration=seconds + 4, concurrency=self.concurrency,
                           max_tokens=16, **options)
        wait_for("the load to start", 30, lambda: engine_requests() > started + 50, interval=0.1)
        pids = {"worker": rig.worker, "master": rig.gateway.pid}
        out = f"{prefix}.{rig.worker}.json"
        if os.path.exists(out):
            os.remove(out)
        before = {role: thread_cpu(pid) for role, pid in pids.items()}
        answered = engine_requests()
        os.kill(rig.worker, signal.SIGUSR2)
        time.sleep(seconds)  # the window sampled
        os.kill(rig.worker, signal.SIGUSR2)
        self.requests += engine_requests() - answered
        for role, pid in pids.items():
            self.threads[role] += threads_spent(before[role], thread_cpu(pid), pid)
        wait_for("the samples", 30, lambda: os.path.exists(out))
        load, _ = running.communicate(timeout=seconds + 120)
        self.failed += json.loads(load)["failed"]
        with open(out) as f:
            for s in json.load(f):
                self.samples[tuple(map(tuple, s["stack"]))] += s["ns"]

    def result(self) -> dict:
        per_request = {role: [{"thread": label, "ms": round(s * 1000 / self.requests, 4)}
                              for label, s in spent.most_common() if s > 0] for role, spent in self.threads.items()}
        main_ms = next(t["ms"] for t in per_request["worker"] if t["thread"] == "main thread")
        samples = [{"stack": stack, "ns": ns} for stack, ns in self.samples.items()]
        return {"what": SCENARIOS[self.name][0], "concurrency": self.concurrency, "requests": self.requests,
                "failed": self.failed, "threads": per_request, "worker": summarise(samples, main_ms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds a window [6]")
    parser.add_argument("--rounds", type=int, default=4, help="windows of each scenario, in turn [4]")
    parser.add_argument("--concurrency", type=int, default=1, help="clients at once [1]")
    parser.add_argument("--only", choices=sorted(SCENARIOS), help="one scenario")
    parser.add_argument("--stand-in", action="store_true", help="bench/onecore.py's nginx stand-in as the engine")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "profile.json"))
    args = parser.parse_args()
    raise_fd_limit()
    tmp = tempfile.mkdtemp(prefix="llmgw-profile-")
    prefix = os.path.join(tmp, "samples")
    stand_in, engines = None, None
    procs = Procs(tmp)
    if args.stand_in:
        stand_in = onecore.StandIn(procs, onecore.captured(tmp))
        # Its stream answers are on a port of their own, so the stream scenario asks for that model.
        engines = {onecore.MODELS[load]: stand_in.url(load) for load in onecore.LOADS}
        SCENARIOS["stream"][1]["model"] = onecore.MODELS[onecore.STREAM]
    try:
        rig = Rig(tmp, name="profile", engines=engines,
                  gateway_command=(sys.executable, os.path.join(ROOT, "bench", "probe.py"), "cpu", prefix))
    except BaseException:
        procs.stop()
        raise
    engine_requests = stand_in.requests if stand_in else lambda: sim_requests(rig)
    scenarios = [Scenario(name, args.concurrency) for name in ([args.only] if args.only else SCENARIOS)]
    loadavg = [os.getloadavg()[0]]
    try:
        for s in scenarios:  # warm every path
            _, options, key = SCENARIOS[s.name]
            rig.load(rig.url, getattr(rig, key), requests=300, concurrency=args.concurrency, max_tokens=16, **options)
        # In turn, so that a machine getting busier weighs on every scenario alike.
        for _ in range(args.rounds):
            for s in scenarios:
                s.window(rig, args.seconds, prefix, engine_requests)
            loadavg.append(os.getloadavg()[0])
    finally:
        rig.stop()
        procs.stop()
    results = {"load_average": [min(loadavg), max(loadavg)], "rounds": args.rounds, "seconds": args.seconds,
               **{s.name: s.result() for s in scenarios}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(report(results))
    return 0


def report(results: dict) -> str:
    low, high = results["load_average"]
    lines = [f"{results['rounds']} windows of {results['seconds']:g} s a scenario, in turn; load average (1 min) "
             f"{low:.1f} to {high:.1f}"]
    for name in SCENARIOS:
        r = results.get(name)
        if r is None:
            continue
        w = r["worker"]
        lines += ["", f"## {r['what']}, {r['concurrency']} at a time ({r['requests']} requests, "
                      f"{r['failed']} failed)", "",
                  "CPU a request by thread: " + "; ".join(
                      f"{role} {t['thread']} {t['ms']:.3f} ms" for role in ("worker", "master")
                      for t in r["threads"][role]), "",
                  f"The worker's main thread, {w['cpu_ms_per_request']:.3f} ms a request ({w['sampled_s']} s sampled):",
                  "", "| part | share | ms a request |", "| --- | ---: | ---: |"]
        lines += [f"| {p['part']} | {p['share'] * 100:.1f}% | {p['ms']:.3f} |" for p in w["parts"]]
        lines += ["", "| what the work was, across the parts | share | ms a request |", "| --- | ---: | ---: |"]
        lines += [f"| {k['kind']} | {k['share'] * 100:.1f}% | {k['ms']:.3f} |" for k in w["kinds"]]
        lines += ["", "| function, CPU of its own | share | ms a request | mostly called from |",
                  "| --- | ---: | ---: | --- |"]
        lines += [f"| `{t['function']}` | {t['share'] * 100:.1f}% | {t['ms']:.3f} | {t['mostly_via']} |"
                  for t in w["own"][:12]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
