"""The controller's reconcile pass alone, in one process: how a steady pass grows with the fleet.

    python bench/reconcile.py [--sizes 1000,5000] [--baseline CHECKOUT] [--out FILE]

bench/controlplane.py measures the pass inside a whole controller under simulated agents, where one pass is
one figure on a machine the agents and a gateway also use. This one calls the controller's own code (the
fleet's node views, `reconciler.plan`, `whole` of the replicas' snapshot, as the control loop calls them)
with N nodes of 8 GPUs and N/10 models of 40 replicas (one GPU each, 4 a node), places every replica, marks
them ready as their agents would report, then times, five times each, what every pass does with nothing to
change: the plan, the replicas as scaling and the gateways' snapshot read them (`whole(snapshot())`), and
the plan again with Python's garbage collector off (what its walks of the heap add).
Medians, in milliseconds; `--baseline CHECKOUT` runs the same in another checkout's code, in a process of
its own, one after the other. `--quick` (200 nodes) runs in the test suite.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1024 ** 3
REPLICAS_A_MODEL, TIMES = 40, 5


def measure(nodes_n: int) -> dict:
    """In this process, with whichever llmgw is first on the path."""
    from llmgw.control import catalog
    from llmgw.control.fleet import NodeView, node_facts
    from llmgw.control.reconciler import Replicas, plan, whole

    registration = {"engines": {"sim": "1"}, "engines_probed": True, "labels": {},
                    "memory": {"total_bytes": 1024 * GiB},
                    "gpus": [{"index": i, "class": "h100-80g", "health": "ok"} for i in range(8)]}
    nodes = [NodeView(f"node-{i:05d}", "ready", 0.0, 0.0, node_facts(registration, {})) for i in range(nodes_n)]
    models = {f"model-{j:04d}": catalog.parse_model({
        "name": f"model-{j:04d}", "source": "/m.gguf", "scaling": {"min": REPLICAS_A_MODEL, "max": REPLICAS_A_MODEL},
        "profiles": [{"engine": "sim", "gpus": 1, "gpu_class": "h100-80g"}]}) for j in range(nodes_n // 10)}
    replicas = Replicas()
    started = time.perf_counter()
    actions, unplaced = plan(models, nodes, replicas, now=0.0)
    placing = time.perf_counter() - started
    if unplaced or len(actions) != len(models) * REPLICAS_A_MODEL:
        raise RuntimeError(f"placed {len(actions)} replicas, left {len(unplaced)} models unplaced")
    for a in actions:
        replicas.report(a.decision.node_id, {"shard_id": a.shard_id, "state": "ready", "model": a.model,
                                             "url": "http://127.0.0.1:1", "address": "127.0.0.1"}, now=1.0)
    out = {"replicas": len(actions), "models": len(models), "placing_s": round(placing, 2)}
    for name, step, collect in (("pass_ms", lambda i: plan(models, nodes, replicas, now=100.0 + i), True),
                                ("whole_ms", lambda i: whole(replicas.snapshot()), True),
                                ("pass_uncollected_ms", lambda i: plan(models, nodes, replicas, now=200.0 + i), False)):
        times = []
        for i in range(TIMES):
            if not collect:
                gc.disable()  # what the garbage collector's walks of the heap add to the pass
            t = time.perf_counter()
            result = step(i)
            times.append((time.perf_counter() - t) * 1000)
            gc.enable()
            if name != "whole_ms" and result[0]:
                raise RuntimeError(f"a steady pass planned {len(result[0])} actions")
        out[name] = round(statistics.median(times), 1)
    return out


def in_checkout(checkout: str, nodes_n: int) -> dict:
    run = subprocess.run([sys.executable, os.path.abspath(__file__), "--run", str(nodes_n), "--checkout", checkout],
                         capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise RuntimeError(f"the pass with {checkout} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 nodes: a smoke run")
    parser.add_argument("--sizes", help="comma-separated numbers of nodes [1000,5000]")
    parser.add_argument("--baseline", metavar="CHECKOUT", help="another checkout, measured beside this one")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--checkout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        sys.path.insert(0, args.checkout)
        print(json.dumps(measure(args.run)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [200] if args.quick else [1000, 5000]
    checkouts = {"this checkout": ROOT, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    results = []
    for n in sizes:
        load = os.getloadavg()[0]
        results.append({"nodes": n, "load": load, **{label: in_checkout(c, n) for label, c in checkouts.items()}})
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}; medians of {TIMES}"
          + (f"; baseline: {args.baseline}" if args.baseline else ""))
    print("| | " + " | ".join(f"{r['nodes']:,} nodes, {r['this checkout']['replicas']:,} replicas" for r in results)
          + " |\n|---|" + "---:|" * len(results))
    for label in checkouts:
        for field, what in (("placing_s", "the pass that placed them (s)"), ("pass_ms", "a steady pass (ms)"),
                            ("whole_ms", "the replicas as scaling reads them (ms)")):
            print(f"| {label}: {what} | " + " | ".join(f"{r[label][field]:,}" for r in results) + " |")
        print(f"| {label}: a steady pass, the garbage collector off (ms) | "
              + " | ".join(f"{r[label].get('pass_uncollected_ms', '-'):,}" for r in results) + " |")
    print("| load average at the start | " + " | ".join(
        f"{r['load']:.1f}" + (" (noisy)" if r["load"] > 1.0 else "") for r in results) + " |")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"sizes": sizes, "baseline": args.baseline, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
