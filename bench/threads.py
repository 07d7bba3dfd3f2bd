"""What a kept conversation adds to a request, and what the sweep costs, on SQLite and PostgreSQL.

    python bench/threads.py [--threads 100000] [--requests 300] [--expired-messages 1000000] [--store sqlite|postgresql|both]

For each store: THREADS threads of four turns each are put in the store of a project that keeps
them; a gateway (one worker) in front of a simulated engine that answers at once then takes
REQUESTS chat requests one at a time, alternating a request naming one of those threads (the
history read, put before the turn, the turn and its answer written) with the same request
naming none. Reported: the latency of each (median, p90) and the ratio of the thread's to the
plain one's, from the same run. Then EXPIRED-MESSAGES messages in expired threads (two a turn,
four turns a thread) are added and the sweep that deletes them is timed.

PostgreSQL is the local server (`--pg-admin`, default postgres@127.0.0.1:5432), in a database
made afresh for the run, `llmgw_bench_threads`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmgw import conversations, settings, store  # noqa: E402
from llmgw.people import keeping, keys  # noqa: E402
from llmgw.procs import free_port, http_status, wait_for  # noqa: E402

TURN = [{"role": "user", "content": "Please summarise the ticket about the failing nightly build. " * 2},
        {"role": "assistant", "content": "The nightly build fails in the linker step since Tuesday. " * 2}]
BATCH = 5000


def fresh_pg(admin: str) -> str:
    import psycopg2

    conn = psycopg2.connect(admin.replace("postgresql://", "postgres://", 1))
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute('DROP DATABASE IF EXISTS "llmgw_bench_threads" WITH (FORCE)')
        cur.execute('CREATE DATABASE "llmgw_bench_threads"')
    conn.close()
    return admin.rsplit("/", 1)[0] + "/llmgw_bench_threads"


def fill(engine, scope: str, prefix: str, threads: int, at: float) -> None:
    """THREADS threads of four turns each in SCOPE, last written at AT under a retention of 24 h, in batches."""
    text = json.dumps(TURN)
    with engine.begin() as conn:
        for start in range(0, threads, BATCH):
            ids = [f"{prefix}{i}" for i in range(start, min(threads, start + BATCH))]
            conn.execute(store.threads.insert(), [{"scope": scope, "id": i, "created_at": at, "last_at": at,
                                                   "last_seq": 4, "expires_at": at + 24 * 3600, "system": None}
                                                  for i in ids])
            conn.execute(store.thread_turns.insert(), [{"scope": scope, "thread_id": i, "seq": seq, "at": at,
                                                        "messages": text, "tokens": 60}
                                                       for i in ids for seq in range(1, 5)])


def request(port: int, key: str, thread: str | None) -> float:
    body = json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "And now?"}]})
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if thread is not None:
        headers["x-llmgw-thread"] = thread
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, headers)
    resp = conn.getresponse()
    resp.read()
    elapsed = time.perf_counter() - t0
    conn.close()
    assert resp.status == 200, resp.status
    return elapsed


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50_ms": round(statistics.median(ordered) * 1000, 2),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2)}


def run(url: str, args, tmp: str) -> dict:
    engine = store.open_store(url)
    key = keys.create_key(engine, "bench")[1]
    project = keeping.set_threads(engine, "default", 24)[0].id
    t0 = time.perf_counter()
    fill(engine, project, "t", args.threads, time.time())
    filled = time.perf_counter() - t0
    procs: list[subprocess.Popen] = []
    try:
        sim_port, port = free_port(), free_port()
        with open(os.path.join(tmp, "sim.log"), "wb") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "llmgw", "sim", "--listen", f"127.0.0.1:{sim_port}",
                                           "--model", "m", "--ttft-ms", "0", "--tokens-per-s", "0", "--reply",
                                           "Noted."], stdout=log, stderr=subprocess.STDOUT))
        wait_for("the sim", 20, lambda: http_status(f"http://127.0.0.1:{sim_port}/health") == 200)
        config = os.path.join(tmp, "gateway.toml")
        with open(config, "w") as f:
            f.write(settings.to_toml({"gateway.listen": f"127.0.0.1:{port}", "gateway.workers": 1,
                                      "gateway.metrics_listen": f"127.0.0.1:{free_port()}", "store.url": url,
                                      "usage.spool_dir": os.path.join(tmp, "spool")},
                                     [{"id": "m", "url": f"http://127.0.0.1:{sim_port}", "models": ["m"]}],
                                     [{"name": "m", "max_context": 8192}]))
        with open(os.path.join(tmp, "gateway.log"), "wb") as log:
            procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "gateway.py"), "--config", config],
                                          stdout=log, stderr=subprocess.STDOUT))
        wait_for("the gateway", 60, lambda: http_status(f"http://127.0.0.1:{port}/ready") == 200)
        rng = random.Random(1)
        for _ in range(20):  # warm up both paths
            request(port, key, None)
            request(port, key, f"t{rng.randrange(args.threads)}")
        plain, threaded = [], []
        for _ in range(args.requests):
            plain.append(request(port, key, None))
            threaded.append(request(port, key, f"t{rng.randrange(args.threads)}"))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    fill(engine, project, "old", args.expired_messages // 8, time.time() - 48 * 3600)
    t0 = time.perf_counter()
    gone = conversations.sweep(engine, {project: 24})
    swept = time.perf_counter() - t0
    engine.dispose()
    figures = {"plain": summary(plain), "thread": summary(threaded)}
    return {**figures, "ratio_p50": round(figures["thread"]["p50_ms"] / figures["plain"]["p50_ms"], 2),
            "added_p50_ms": round(figures["thread"]["p50_ms"] - figures["plain"]["p50_ms"], 2),
            "threads_stored": args.threads, "fill_s": round(filled, 1),
            "sweep": {"threads": gone, "messages": gone * 8, "seconds": round(swept, 2)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--expired-messages", type=int, default=1_000_000)
    parser.add_argument("--store", choices=["sqlite", "postgresql", "both"], default="both")
    parser.add_argument("--pg-admin", default="postgresql://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    results = {"requests": args.requests}
    for kind in (["sqlite", "postgresql"] if args.store == "both" else [args.store]):
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{tmp}/bench.db" if kind == "sqlite" else settings.normalise_store_url(fresh_pg(args.pg_admin))
            results[kind] = run(url, args, tmp)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
