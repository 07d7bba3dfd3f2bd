"""What limits cost a request, and what a usage page costs over ten million requests.

    python bench/limits.py [--quick] [--rows N] [--out bench/results/limits.json]

1. Admitting and settling with limits at four levels (key, project, team,
   organisation: requests, tokens and a budget at each, all far from binding,
   so every check runs and none refuses). Measured three ways, each beside its
   baseline from the same run:
   - the accountant alone, in this process: admit + settle, p50 and p99;
   - one admit round trip to the accountant over ZeroMQ, as a gateway worker
     makes it, against a round trip that does no accounting (`status` of no
     levels);
   - requests through a real gateway (one worker, its master holding the
     accountant), one at a time: a key with the four levels against a key
     with none.
2. The usage page over generated raw rows (ten million by default), spread
   over 30 days, 200 keys, 50 projects, 100 people and 5 models: the report
   read from the roll-ups against the same report summed from the raw rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.curves import pct  # noqa: E402
from bench.rig import FOUR_LEVELS, Rig  # noqa: E402
from llmgw import store  # noqa: E402
from llmgw.people import orgtree, rollup, usagereport  # noqa: E402


def summary(values_s: list[float]) -> dict:
    us = [v * 1e6 for v in values_s]
    return {"p50_us": round(pct(us, 0.5), 1), "p99_us": round(pct(us, 0.99), 1), "n": len(us)}


def four_levels() -> list[list]:
    return [[f"{scope}:{scope}-1", FOUR_LEVELS["rpm"], FOUR_LEVELS["tpm"], FOUR_LEVELS["budget"], "month"]
            for scope in ("key", "project", "team", "org")]


def bench_accountant(n: int) -> dict:
    from llmgw.control.accountant import Accountant

    accountant = Accountant()
    levels = four_levels()
    timings = []
    for _ in range(n):
        started = time.perf_counter()
        r = accountant.admit(levels, True, 300, 300)
        accountant.settle(r.id, 250, 250)
        timings.append(time.perf_counter() - started)
    return summary(timings)


def bench_round_trip(n: int) -> dict:
    """Round trips from a gevent client, as a worker makes them."""

    from llmgw.control.accountant import Accountant
    from llmgw.control.accountserver import AccountServer
    from llmgw.gateway.limiter import Limiter

    server = AccountServer(Accountant(), "127.0.0.1:0").start()
    address = f"127.0.0.1:{server.port}"
    client = Limiter(timeout=5)
    levels = four_levels()
    try:
        for _ in range(200):  # warm
            client.ask(address, {"op": "status", "levels": []})
        empty, admits = [], []
        for _ in range(n):
            started = time.perf_counter()
            client.ask(address, {"op": "status", "levels": []})
            empty.append(time.perf_counter() - started)
            started = time.perf_counter()
            # Asked for without an allowance: this measures the round trip every request made before them.
            answer = client.ask(address, {"op": "admit", "levels": levels, "priced": True, "tokens": 300,
                                          "cost": 300})
            client.settle(address, answer["r"], 250, 250)
            admits.append(time.perf_counter() - started)
    finally:
        client.close()
        server.stop()
    return {"no_accounting": summary(empty), "admit_and_settle": summary(admits)}


def bench_gateway(tmp: str, n: int) -> dict:
    rig = Rig(tmp, name="limits")
    try:
        kw = dict(requests=n, concurrency=1, max_tokens=16)
        rig.load(rig.url, rig.key, **{**kw, "requests": 100})
        rig.load(rig.url, rig.limited_key, **{**kw, "requests": 100})
        plain = rig.load(rig.url, rig.key, **kw)
        before = rig.gateway_cpu()
        held = rig.load(rig.url, rig.limited_key, **kw)
        cpu_limited = rig.gateway_cpu() - before
        return {"no_limits": plain, "four_levels": held,
                "gateway_cpu_ms_per_limited_request": round(cpu_limited * 1000 / held["ok"], 3)}
    finally:
        rig.stop()


def generate_usage(path: str, rows: int, now: float) -> float:
    """ROWS raw usage rows over the last 30 days, written straight through sqlite3 for speed."""
    url = f"sqlite:///{path}"
    engine = store.open_store(url)
    orgtree.add(engine, "org", "Acme")
    projects = []
    for t in range(5):
        orgtree.add(engine, "team", f"team-{t}", "Acme")
        projects += [orgtree.add(engine, "project", f"p-{i}", f"Acme/team-{t}").id for i in range(10)]
    engine.dispose()
    started = time.monotonic()
    rng = random.Random(1)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    models = [f"model-{i}" for i in range(5)]
    insert = ("INSERT INTO usage (at, key_id, project_id, model_asked, model_served, replica, endpoint, stream, "
              "status, prompt_tokens, completion_tokens, latency_ms, ttft_ms, user_id, cost_micros) "
              "VALUES (?, ?, ?, ?, ?, 'r', 'chat', 0, ?, ?, ?, 12.5, NULL, ?, ?)")
    batch = 100_000
    for start in range(0, rows, batch):
        chunk = []
        for _ in range(min(batch, rows - start)):
            key = rng.randrange(200)
            model = models[key % 5]
            chunk.append((now - rng.random() * 30 * 86400, f"key-{key}", projects[key % 50], model, model,
                          200 if rng.random() > 0.01 else 500, rng.randrange(50, 2000), rng.randrange(1, 500),
                          f"user-{key % 100}", rng.randrange(0, 5000)))
        conn.executemany(insert, chunk)
        conn.commit()
    conn.close()
    return time.monotonic() - started


def bench_usage(tmp: str, rows: int) -> dict:
    path = os.path.join(tmp, "usage.db")
    now = time.time()
    generated = generate_usage(path, rows, now)
    engine = store.open_engine(f"sqlite:///{path}")
    started = time.monotonic()
    rolled = rollup.roll_up(engine, now + rollup.SETTLE + 1)
    rolling = time.monotonic() - started
    since = now - 30 * 86400
    report_times = []
    for _ in range(10):
        started = time.perf_counter()
        found = usagereport.report(engine, "project", since, now=now)
        report_times.append(time.perf_counter() - started)
    raw_times = []
    u = store.usage
    import sqlalchemy as sa
    for _ in range(2):
        started = time.perf_counter()
        with engine.connect() as conn:
            day = rollup.bucket(u.c.at, rollup.DAY)
            raw = conn.execute(sa.select(day, u.c.project_id, sa.func.count(), sa.func.sum(u.c.prompt_tokens),
                                         sa.func.sum(u.c.completion_tokens), sa.func.sum(u.c.cost_micros))
                               .where(u.c.at >= since).group_by(day, u.c.project_id)).all()
        raw_times.append(time.perf_counter() - started)
    engine.dispose()
    assert sum(line.requests for line in found.lines) == rows
    page_times = time_usage_page(f"sqlite:///{path}")
    return {"raw_rows": rows, "generate_s": round(generated, 1), "roll_up_s": round(rolling, 1), "rolled": rolled,
            "report_from_rollups_ms": {"p50": round(statistics.median(report_times) * 1000, 1),
                                       "max": round(max(report_times) * 1000, 1)},
            "same_report_from_raw_rows_ms": round(min(raw_times) * 1000, 1), "raw_groups": len(raw),
            "usage_page_ms": {"p50": round(statistics.median(page_times) * 1000, 1),
                              "max": round(max(page_times) * 1000, 1)}}


def time_usage_page(url: str) -> list[float]:
    """The whole /admin/usage page (report, chart, template) for an administrator, ten times."""
    from bench.adminpages import signed_in

    app, client = signed_in(url)
    times = []
    for _ in range(10):
        started = time.perf_counter()
        response = client.get("/admin/usage?by=project&since=30d&metric=tokens")
        times.append(time.perf_counter() - started)
        assert response.status_code == 200 and b"<svg" in response.data
    app.runtime.engine.dispose()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Fewer requests and a million rows.")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "limits.json"))
    parser.add_argument("--only", choices=["limits", "usage"], help="Run one half.")
    args = parser.parse_args()
    n = 500 if args.quick else 3000
    rows = min(args.rows, 1_000_000) if args.quick else args.rows
    tmp = tempfile.mkdtemp(prefix="llmgw-limits-")
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = {**json.load(f), **result}  # --only replaces its half and keeps the other
    if args.only != "usage":
        result.update(accountant_in_process=bench_accountant(n * 10), accountant_round_trip=bench_round_trip(n),
                      gateway=bench_gateway(tmp, n))
    if args.only != "limits":
        result["usage"] = bench_usage(tmp, rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(report(result))
    return 0


def report(r: dict) -> str:
    lines = []
    if "gateway" in r:
        a, rt, gw = r["accountant_in_process"], r["accountant_round_trip"], r["gateway"]
        plain, held = gw["no_limits"], gw["four_levels"]
        lines += [
            f"accountant, admit + settle, 4 levels, in process: p50 {a['p50_us']} us, p99 {a['p99_us']} us",
            f"round trip to the accountant: admit + settle p50 {rt['admit_and_settle']['p50_us']} us "
            f"(p99 {rt['admit_and_settle']['p99_us']}) vs an empty round trip {rt['no_accounting']['p50_us']} us "
            f"(p99 {rt['no_accounting']['p99_us']})",
            f"through the gateway, one at a time: p50 {held['p50_ms']} ms with 4 levels vs {plain['p50_ms']} ms "
            f"without (x{held['p50_ms'] / plain['p50_ms']:.2f}); p99 {held['p99_ms']} vs {plain['p99_ms']} ms"]
    if "usage" in r:
        us = r["usage"]
        rolled_ms, raw_ms = us["report_from_rollups_ms"]["p50"], us["same_report_from_raw_rows_ms"]
        lines.append(f"usage report over {us['raw_rows']:,} rows: {rolled_ms} ms from roll-ups vs {raw_ms} ms from raw "
                     f"rows (x{raw_ms / max(rolled_ms, 0.001):.0f}); rolling them up took {us['roll_up_s']} s once; "
                     f"the whole usage page {us['usage_page_ms']['p50']} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
