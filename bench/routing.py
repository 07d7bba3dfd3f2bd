"""Routing policies, measured: round-robin, least-load and prefix on four simulated replicas, or on two real vLLMs.

    python bench/routing.py [--quick] [--seconds 25] [--clients 16] [--out bench/results/routing.json]
    python bench/routing.py --vllm [--seconds 90] [--clients 6] [--out bench/results/routing-vllm.json]

For each workload and each `routing.policy`, four `llmgw sim` processes start
afresh (empty caches) behind a real gateway (two gevent workers, the policy
set in its configuration, everything else at its defaults), and
`bench/loadgen.py` streams chats through it from CLIENTS clients at once, each
sending its next request when the last is answered. Two workloads:

- multi-turn: conversations of 8 turns, one after another on each client:
  a system prompt of 200 words every conversation shares, then each turn a
  user message of 40 new words, and the answer (60 to 180 tokens) sent back
  the next turn, so the history grows to about 1,300 tokens;
- no-overlap: single requests of 400 words that share nothing, not even a
  first word, answered in 60 to 180 tokens.

Each replica times its answers as a GPU shapes them: 20 ms to the first token,
plus 0.5 ms for each prompt token not in its prefix cache, prefills one at a
time; then 50 tokens a second. Its cache holds 8,192 tokens: the live
conversations' histories fit in the four caches together, not in each one,
which is what routing by conversation exploits (a GPU holds more tokens, and
serves more conversations). `llmgw sim --help` says what it models.

Reported, over what follows a warm-up: the mean and p95 time to first token
(the first byte of each stream), each beside round-robin's from the same run
as a ratio; the balance, the largest of the replicas' mean requests in flight
(waiting and running, read from their /metrics four times a second) over the
smallest; the share of prompt tokens found in a cache; failures; and what the
policy's check and choice cost a worker, in this process. The aims (issue 13):
prefix at least 40% below round-robin's mean on multi-turn, no worse than
least-load on no-overlap, balance within 1.5.

With `--vllm`, the replicas are two real vLLMs (the CPU build, from the
environment tests/realvllm.py makes once, serving the starter model converted
to a Hugging Face folder), each on a core of its own, started afresh for each
policy, with prefix caching on and a cache of 2,560 tokens (20 blocks of 128:
`--num-gpu-blocks-override`), round-robin against prefix, on a shorter
multi-turn workload (VLLM_WORKLOAD: 4 turns, a 290-token system prompt, turns
of about 95 tokens, 32-token answers, 6 clients), so that, as with the
simulated replicas, the live conversations fit in the two caches together and
not in each one. vLLM's CPU build caches whole blocks of 128 tokens; the shared
system prompt and the histories are longer than that. What vLLM reports is
read: its requests in flight, its prefix cache's queries and hits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import timeit
import urllib.request
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmgw.engines import vllm  # noqa: E402
from llmgw.gateway import apirequest  # noqa: E402
from llmgw.gateway.balancer import ReplicaState, choose  # noqa: E402
from llmgw.gateway.breaker import Breaker  # noqa: E402
from llmgw.gateway.snapshot import ReplicaSpec  # noqa: E402
from llmgw.procs import free_port, http_status, wait_for  # noqa: E402
from tests import realvllm  # noqa: E402
from tests.conftest import Gateway, Sim, make_key, stop_process  # noqa: E402

POLICIES = ("round-robin", "least-load", "prefix")
REPLICAS = 4
SIM = {"ttft_ms": 20, "tokens_per_s": 50, "prefill_ms_per_token": 0.5, "prefix_cache_tokens": 8192}
ANSWER_TOKENS = 120
WORKLOADS = {
    "multi-turn": {"conversations": 8, "system_words": 200, "user_words": 40, "spread": 0.5},
    "no-overlap": {"conversations": 1, "system_words": 0, "user_words": 400, "spread": 0.5},
}
SAMPLE_EVERY = 0.25  # seconds between reads of the replicas' requests in flight


VLLM_ANSWER_TOKENS = 32  # vLLM's CPU build answers about 30 tokens a second on one core
VLLM_ARGS = ["--enforce-eager", "--max-num-seqs", "4", "--num-gpu-blocks-override", "20"]
# Its own tokenizer makes about 3 tokens of each of loadgen's words ("c3n12t2w7"): a 290-token system prompt,
# turns of about 95, histories to about 850 tokens, which six clients' conversations hold 5,000 of.
VLLM_WORKLOAD = {"conversations": 4, "system_words": 100, "user_words": 10, "spread": 0.5}


def in_flight(replica) -> float:
    m = replica.metrics()
    return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]


class SimEngine:
    name, model, count, replicas, answer_tokens = "sim", "sim", "llmgw_sim_requests_total", REPLICAS, ANSWER_TOKENS

    @staticmethod
    def start(i: int) -> Sim:
        return Sim(replica=f"r{i}", **SIM)


class Vllm:
    """A real vLLM, its CPU build, pinned to core I, answering as MODEL; `metrics()` as Sim's."""

    def __init__(self, python: str, folder: str, i: int):
        self.replica, self.port = f"v{i}", free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = vllm.command(folder, VllmEngine.model, "127.0.0.1", self.port, [], 2048, VLLM_ARGS, python=python)
        env = {**os.environ, **vllm.environment("127.0.0.1"), **realvllm.ENV, "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, limit: float = 600) -> None:
        try:
            wait_for(f"vLLM {self.replica}", limit, lambda: http_status(self.url + "/health") == 200,
                     alive=lambda: self.proc.poll() is None)
        except (RuntimeError, TimeoutError) as e:
            self.log.seek(0)
            said = self.log.read().decode(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{e}; it said: {' / '.join(said)}") from None

    def metrics(self) -> dict[str, float]:
        """Each series summed over its labels (vLLM counts finished requests by their reason)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
        return values

    def stop(self):
        stop_process(self.proc, timeout=30)
        self.log.close()


class VllmEngine:
    name, model, count, replicas, answer_tokens = "vllm", "smol", "vllm:request_success_total", 2, VLLM_ANSWER_TOKENS
    python = folder = ""

    @classmethod
    def start(cls, i: int) -> Vllm:
        replica = Vllm(cls.python, cls.folder, i)
        try:
            replica.wait_ready()
        except BaseException:
            replica.stop()
            raise
        return replica


def measure(folder: Path, policy: str, workload: str, seconds: float, warmup: float, clients: int,
            engine=SimEngine) -> dict:
    """One policy under one workload, on replicas and a gateway of its own."""
    sims = []
    try:
        with concurrent.futures.ThreadPoolExecutor(engine.replicas) as pool:
            starting = [pool.submit(engine.start, i) for i in range(engine.replicas)]
            for future in starting:  # every one, so none is left running when another failed to start
                try:
                    sims.append(future.result())
                except RuntimeError as e:
                    failed = e
        if len(sims) < engine.replicas:
            raise failed
        url = f"sqlite:///{folder}/{workload}-{policy}.db"
        key = make_key(url, "bench")
        gateway = Gateway(folder, url, endpoints=[{"id": s.replica, "url": s.url, "models": [engine.model]}
                                                  for s in sims], workers=2, routing__policy=policy)
        try:
            argv = [sys.executable, os.path.join(ROOT, "bench", "loadgen.py"), "--url", gateway.url, "--key", key,
                    "--stream", "--concurrency", str(clients), "--duration", str(seconds), "--warmup", str(warmup),
                    "--max-tokens", str(engine.answer_tokens), "--model", engine.model]
            for name, value in (VLLM_WORKLOAD if engine is VllmEngine else WORKLOADS[workload]).items():
                argv += ["--" + name.replace("_", "-"), str(value)]
            load = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            started = time.monotonic()
            # A window of time, not a state: the load generator counts from the same moment (give or take its start).
            time.sleep(warmup)
            before = [s.metrics() for s in sims]
            samples = []
            while time.monotonic() < started + warmup + seconds and load.poll() is None:
                samples.append([in_flight(s) for s in sims])
                time.sleep(SAMPLE_EVERY)
            after = [s.metrics() for s in sims]
            out, err = load.communicate(timeout=300)
            if not out:
                raise RuntimeError(f"the load generator failed: {err}")
            result = json.loads(out)
        finally:
            gateway.stop()
    finally:
        for s in sims:
            s.stop()

    def delta(name: str) -> list[float]:
        return [a[name] - b[name] for a, b in zip(after, before)]

    means = [sum(column) / len(column) for column in zip(*samples)] if samples else []
    queried, hits = sum(delta("vllm:prefix_cache_queries_total")), sum(delta("vllm:prefix_cache_hits_total"))
    return {"policy": policy, "workload": workload, "ok": result["ok"], "failed": result["failed"],
            "errors": result["errors"], "rps": result["rps"],
            "ttft_mean_ms": result["ttfb_mean_ms"], "ttft_p95_ms": result["ttfb_p95_ms"],
            "ttft_p50_ms": result["ttfb_p50_ms"], "in_flight_means": [round(m, 2) for m in means],
            "balance": round(max(means) / min(means), 2) if means and min(means) > 0 else None,
            "requests_per_replica": [int(d) for d in delta(engine.count)],
            "cache_hit_share": round(hits / queried, 3) if queried else None}


def decision_cost() -> dict:
    """Microseconds a worker spends on the part of a chat that the policy changes, in this process: checking
    the parsed body (where the prefix policy makes its key; the others make none) and choosing a replica.

    The chat is a conversation's twenty-first turn: a 2 KB system prompt, then twenty
    200-word questions and their answers. Parsing the JSON, the same under every policy, is left out.
    """
    system = {"role": "system", "content": "You answer questions about the accounts. " * 50}
    turns = [{"role": role, "content": f"turn {i} " + "word " * 200} for i in range(20) for role in ("user", "assistant")]
    raw = json.dumps({"model": "sim", "stream": True, "max_tokens": 100,
                      "messages": [system, *turns, {"role": "user", "content": "and now?"}]}).encode()
    body = json.loads(raw)
    replicas = [ReplicaState(ReplicaSpec(f"r{i}", f"http://h{i}", ("sim",)), Breaker(5, 10)) for i in range(REPLICAS)]
    rng = random.Random(1)
    costs = {}
    for policy in POLICIES:
        def once(policy=policy, prefix_bytes=2048 if policy == "prefix" else 0):
            req = apirequest.checked("chat", body, raw, prefix_bytes)
            choose(policy, replicas, 0.0, 5.0, req.affinity, req.follows, 1.25, rng)

        rounds = 5000
        best = min(timeit.timeit(once, number=rounds) for _ in range(5))
        costs[policy] = round(best / rounds * 1e6, 1)
    return {"body_bytes": len(raw), "microseconds": costs}


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def ttft_cells(x: dict, rr: dict) -> str:
    """A run's mean and p95 time to first token, each beside round-robin's (RR) as a ratio: table cells."""
    return (f"{x['ttft_mean_ms']} | {ratio(x['ttft_mean_ms'], rr['ttft_mean_ms'])} "
            f"| {x['ttft_p95_ms']} | {ratio(x['ttft_p95_ms'], rr['ttft_p95_ms'])}")


def cached(x: dict) -> str:
    return f"{x['cache_hit_share']:.0%}" if x["cache_hit_share"] is not None else "-"


def report(r: dict) -> str:
    lines = [f"{REPLICAS} replicas, {r['clients']} clients, {r['seconds']:g} s after a {r['warmup']:g} s warm-up, "
             f"on {r['machine']['node']} ({r['machine']['cpus']} CPUs), {r['when']}", "",
             "| workload | policy | mean TTFT (ms) | / round-robin | p95 TTFT (ms) | / round-robin | balance "
             "| cached prompt tokens | requests a second | failed |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for workload in WORKLOADS:
        runs = {x["policy"]: x for x in r["runs"] if x["workload"] == workload}
        rr = runs["round-robin"]
        for policy in POLICIES:
            x = runs[policy]
            lines.append(f"| {workload} | {policy} | {ttft_cells(x, rr)} | {x['balance']} | {cached(x)} | {x['rps']} "
                         f"| {x['failed']} |")
    multi = {x["policy"]: x for x in r["runs"] if x["workload"] == "multi-turn"}
    none = {x["policy"]: x for x in r["runs"] if x["workload"] == "no-overlap"}
    worst = max((x["balance"] or float("inf")) for x in r["runs"] if x["policy"] == "prefix")
    cost = r["cost"]["microseconds"]
    lines += ["", f"checking and routing a parsed {r['cost']['body_bytes']:,}-byte chat (µs): "
              + ", ".join(f"{p} {cost[p]}" for p in POLICIES)
              + f"; prefix / least-load {cost['prefix'] / cost['least-load']:.2f}"]
    lines += ["", "aims for prefix (issue 13):",
              f"- multi-turn mean TTFT / round-robin's: {ratio(multi['prefix']['ttft_mean_ms'], multi['round-robin']['ttft_mean_ms'])}"
              " (at most 0.60)",
              f"- no-overlap mean TTFT / least-load's: {ratio(none['prefix']['ttft_mean_ms'], none['least-load']['ttft_mean_ms'])}"
              " (no worse: about 1.00)",
              f"- balance, the worse of the two workloads: {worst} (at most 1.5)"]
    return "\n".join(lines)


def report_vllm(r: dict) -> str:
    runs = {x["policy"]: x for x in r["runs"]}
    rr = runs["round-robin"]
    lines = [f"2 vLLM {realvllm.VERSION} replicas (CPU build, one core each, prefix caching, 2,560 tokens of "
             f"cache), {r['clients']} clients, multi-turn (4 turns), {r['seconds']:g} s after a {r['warmup']:g} s warm-up, on "
             f"{r['machine']['node']} ({r['machine']['cpus']} CPUs), {r['when']}", "",
             "| policy | mean TTFT (ms) | / round-robin | p95 TTFT (ms) | / round-robin | cached prompt tokens "
             "| requests a second | requests per replica | failed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for policy in VLLM_POLICIES:
        x = runs[policy]
        lines.append(f"| {policy} | {ttft_cells(x, rr)} | {cached(x)} | {x['rps']} "
                     f"| {', '.join(map(str, x['requests_per_replica']))} | {x['failed']} |")
    return "\n".join(lines)


VLLM_POLICIES = ("round-robin", "prefix")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds a run, for a smoke test")
    parser.add_argument("--seconds", type=float, default=25.0, help="measured seconds a run")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--clients", type=int, help="clients at once (16; 4 with --vllm)")
    parser.add_argument("--vllm", action="store_true", help="two real vLLMs (the CPU build), multi-turn only")
    parser.add_argument("--out", help="where the figures go (bench/results/routing.json, or routing-vllm.json)")
    args = parser.parse_args()
    if args.vllm:
        return main_vllm(args)
    args.clients = args.clients or 16
    args.out = args.out or os.path.join(ROOT, "bench", "results", "routing.json")
    seconds, warmup = (3.0, 1.0) if args.quick else (args.seconds, args.warmup)
    results = {"clients": args.clients, "seconds": seconds, "warmup": warmup, "sim": SIM, "workloads": WORKLOADS,
               "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cost": decision_cost(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="llmgw-routing-") as tmp:
        for workload in WORKLOADS:
            for policy in POLICIES:
                results["runs"].append(measure(Path(tmp), policy, workload, seconds, warmup, args.clients))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(report(results))
    return 1 if any(x["failed"] for x in results["runs"]) else 0


def main_vllm(args) -> int:
    VllmEngine.python = os.path.join(realvllm.environment(), "bin", "python")
    VllmEngine.folder = realvllm.starter_folder()
    clients = args.clients or 6
    seconds, warmup = (10.0, 5.0) if args.quick else (args.seconds if args.seconds != 25.0 else 90.0, 15.0)
    results = {"clients": clients, "seconds": seconds, "warmup": warmup, "vllm": realvllm.VERSION,
               "args": VLLM_ARGS, "workload": VLLM_WORKLOAD,
               "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    with tempfile.TemporaryDirectory(prefix="llmgw-routing-") as tmp:
        for policy in VLLM_POLICIES:
            results["runs"].append(measure(Path(tmp), policy, "multi-turn", seconds, warmup, clients, VllmEngine))
    out = args.out or os.path.join(ROOT, "bench", "results", "routing-vllm.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(report_vllm(results))
    return 1 if any(x["failed"] for x in results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
