"""Routing policies, measured: round-robin, least-load and prefix on four simulated replicas.

    python bench/routing.py [--quick] [--seconds 25] [--clients 16] [--out bench/results/routing.json]

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
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmgw.gateway import apirequest  # noqa: E402
from llmgw.gateway.balancer import ReplicaState, choose  # noqa: E402
from llmgw.gateway.breaker import Breaker  # noqa: E402
from llmgw.gateway.snapshot import ReplicaSpec  # noqa: E402
from tests.conftest import Gateway, Sim, make_key  # noqa: E402

POLICIES = ("round-robin", "least-load", "prefix")
REPLICAS = 4
SIM = {"ttft_ms": 20, "tokens_per_s": 50, "prefill_ms_per_token": 0.5, "prefix_cache_tokens": 8192}
ANSWER_TOKENS = 120
WORKLOADS = {
    "multi-turn": {"conversations": 8, "system_words": 200, "user_words": 40, "spread": 0.5},
    "no-overlap": {"conversations": 1, "system_words": 0, "user_words": 400, "spread": 0.5},
}
SAMPLE_EVERY = 0.25  # seconds between reads of the replicas' requests in flight


def in_flight(sim: Sim) -> float:
    m = sim.metrics()
    return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]


def measure(folder: Path, policy: str, workload: str, seconds: float, warmup: float, clients: int) -> dict:
    """One policy under one workload, on replicas and a gateway of its own."""
    sims = []
    try:
        with concurrent.futures.ThreadPoolExecutor(REPLICAS) as pool:
            starting = [pool.submit(Sim, replica=f"r{i}", **SIM) for i in range(REPLICAS)]
            for future in starting:  # every one, so none is left running when another failed to start
                try:
                    sims.append(future.result())
                except RuntimeError as e:
                    failed = e
        if len(sims) < REPLICAS:
            raise failed
        url = f"sqlite:///{folder}/{workload}-{policy}.db"
        key = make_key(url, "bench")
        gateway = Gateway(folder, url, endpoints=[{"id": s.replica, "url": s.url, "models": ["sim"]} for s in sims],
                          workers=2, routing__policy=policy)
        try:
            argv = [sys.executable, os.path.join(ROOT, "bench", "loadgen.py"), "--url", gateway.url, "--key", key,
                    "--stream", "--concurrency", str(clients), "--duration", str(seconds), "--warmup", str(warmup),
                    "--max-tokens", str(ANSWER_TOKENS)]
            for name, value in WORKLOADS[workload].items():
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
            "requests_per_replica": [int(d) for d in delta("llmgw_sim_requests_total")],
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
            share = f"{x['cache_hit_share']:.0%}" if x["cache_hit_share"] is not None else "-"
            lines.append(f"| {workload} | {policy} | {x['ttft_mean_ms']} | {ratio(x['ttft_mean_ms'], rr['ttft_mean_ms'])} "
                         f"| {x['ttft_p95_ms']} | {ratio(x['ttft_p95_ms'], rr['ttft_p95_ms'])} | {x['balance']} "
                         f"| {share} | {x['rps']} | {x['failed']} |")
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds a run, for a smoke test")
    parser.add_argument("--seconds", type=float, default=25.0, help="measured seconds a run")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "routing.json"))
    args = parser.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
