"""Usage at scale: what a year of usage rows on PostgreSQL costs the pages, the reports, the roll-up, the
retention sweep and the gateways' flush, at 1, 10 and 50 million rows.

    python bench/usage.py [--quick] [--sizes 1000000,10000000,50000000] [--baseline CHECKOUT] [--pg URL]
                          [--out FILE] [--chart FILE]

For each size, a database of its own on the PostgreSQL server at --pg (an administrator's URL; the machine's
own by default) holds a large organisation: 10 organisations of 5 teams of 4 projects, 2,000 people and
20,000 keys, and N usage rows over the last 365 days, the busiest keys far busier than the rest (a key's share
falls as a power of its rank: the 20 busiest send a tenth of all requests). The rows are made by the server
itself (`INSERT ... SELECT` over `generate_series`, faster than COPY from a client), the two secondary indexes
built after them, and the roll-ups made up to a day ago, as a roller that had run all year would have left
them; the last day waits, as after a controller stopped for a day.

Then, with this checkout's code and with --baseline's (another checkout: the commit before a change), each on a
copy of that database (`CREATE DATABASE ... TEMPLATE`), in a process of its own:
- a report by each level (org, team, project, person, model, key) over 30 days (as `llmgw usage` reads it),
  the administrator's usage page (`/admin/usage`) by project over 30 and 90 days and by person over 90, and
  what a person's own page reads (its last-used times of the 20
  busiest keys, its report by model);
- the roll-up pass that catches up the day, then a pass with nothing new;
- the gateways' flush: rows a second written by one and by four flushers (500 rows a transaction), each for
  --seconds;
- the retention sweep deleting the oldest month (`usage.keep_raw_days` of 335);
and, on a second copy, the roll-up of the whole year at once (a store upgraded from before roll-ups, or one
whose roller was stopped long), in a process allowed 6 GiB of memory: its time and memory, or how it failed.

It needs PostgreSQL 13 or later, and free disk for the database twice over (its copy): about 35 GiB at 50
million rows. The 1-minute load average is recorded at the start and end of each size; above 1.0 at the start (two cores,
nothing else should run), the figures are marked noisy and no aim is judged on them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIZES = (1_000_000, 10_000_000, 50_000_000)
QUICK_SIZES = (20_000,)
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
ORGS, TEAMS, PROJECTS, PEOPLE, KEYS, MODELS = 10, 50, 200, 2_000, 20_000, 10
YEAR, DAY = 365 * 86400, 86400
LEVELS = ("org", "team", "project", "person", "model", "key")
PAGES = (("project", "30d"), ("project", "90d"), ("person", "90d"))  # /admin/usage's groupings and spans timed
WHOLE_YEAR_MEMORY = 6 * 2**30


def _admin(pg: str, statement: str) -> None:
    import psycopg2

    conn = psycopg2.connect(pg.replace("postgresql://", "postgres://", 1))
    conn.autocommit = True  # DROP and CREATE DATABASE run outside a transaction
    try:
        conn.cursor().execute(statement)
    finally:
        conn.close()


def _url(pg: str, database: str) -> str:
    from llmgw.settings import normalise_store_url

    return normalise_store_url(pg.rsplit("/", 1)[0] + "/" + database)


def make_database(pg: str, name: str, template: str | None = None) -> str:
    drop_database(pg, name)
    _admin(pg, f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    return _url(pg, name)


def drop_database(pg: str, name: str) -> None:
    _admin(pg, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- the organisation and its year of rows ----------------------------------------------------------

def fill(url: str, rows: int, now: float) -> dict:
    """The organisation and ROWS usage rows ending at NOW, rolled up to a day before NOW; returns timings."""
    import sqlalchemy as sa

    from llmgw import store
    from llmgw.people import rollup

    engine = store.open_store(url)
    t = {}
    with engine.begin() as conn:
        conn.execute(store.orgs.insert(), [{"id": f"o{i}", "name": f"org-{i}", "created_at": now} for i in range(ORGS)])
        conn.execute(store.teams.insert(), [{"id": f"t{i}", "org_id": f"o{i % ORGS}", "name": f"team-{i}",
                                             "created_at": now} for i in range(TEAMS)])
        conn.execute(store.projects.insert(), [{"id": f"p{i}", "team_id": f"t{i % TEAMS}", "name": f"project-{i}",
                                                "created_at": now} for i in range(PROJECTS)])
        conn.execute(store.users.insert(), [{"id": f"u{i}", "email": f"u{i}@example.com", "password_hash": "!",
                                             "state": "active", "is_admin": False, "created_at": now}
                                            for i in range(PEOPLE)])
        conn.execute(store.api_keys.insert(), [{"id": f"k{i}", "name": f"key-{i}", "project_id": f"p{i % PROJECTS}",
                                                "hash": f"{i:064x}", "prefix": f"sk-llmgw-{i:06d}"[:16],
                                                "created_at": now, "user_id": f"u{i % PEOPLE}"} for i in range(KEYS)])
    started = time.monotonic()
    with engine.begin() as conn:
        for index in store.usage.indexes:
            index.drop(conn)
        # Row g at now - a year + g * step; its key by a power of a random number (the busiest far busier), and
        # the key's project, person and model follow from it, as they do in service.
        conn.execute(sa.text(f"""
            INSERT INTO usage (at, key_id, project_id, model_asked, model_served, replica, endpoint, stream, status,
                               prompt_tokens, completion_tokens, latency_ms, ttft_ms, user_id, cost_micros)
            SELECT :start + g * :step, 'k' || k, 'p' || (k % {PROJECTS}), 'model-' || (k % {MODELS}),
                   'model-' || (k % {MODELS}), 'replica-' || (g % 40), 'chat', g % 3 = 0,
                   CASE WHEN g % 97 = 0 THEN 500 ELSE 200 END, 50 + (g * 7919) % 2000, 1 + (g * 104729) % 500,
                   800.0, 120.0, 'u' || (k % {PEOPLE}), (g * 31) % 5000
            FROM (SELECT g, floor({KEYS} * power(random(), 3))::int AS k FROM generate_series(1::bigint, :n) AS g) AS s
            """), {"start": now - YEAR, "step": (YEAR - 60) / rows, "n": rows})
    t["rows_s"] = time.monotonic() - started
    started = time.monotonic()
    with engine.begin() as conn:
        for index in store.usage.indexes:
            index.create(conn)
    t["indexes_s"] = time.monotonic() - started
    started = time.monotonic()
    u = store.usage
    with engine.begin() as conn:
        mark = conn.execute(sa.select(sa.func.max(u.c.id)).where(u.c.at < now - DAY)).scalar() or 0
        for table, column, seconds in rollup.BUCKETS:
            rollup.add_sums(conn, table, column, seconds, 0, mark)
        conn.execute(sa.text("INSERT INTO revisions (name, value) VALUES ('usage_rolled', :mark)"), {"mark": mark})
        t["hourly_rows"] = conn.execute(sa.text("SELECT count(*) FROM usage_hourly")).scalar()
        t["daily_rows"] = conn.execute(sa.text("SELECT count(*) FROM usage_daily")).scalar()
    t["rollups_s"] = time.monotonic() - started
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE"))
        t["bytes"] = conn.execute(sa.text("SELECT pg_database_size(current_database())")).scalar()
    engine.dispose()
    return t


# --- what is measured, in a process running CHECKOUT's llmgw ----------------------------------------

def timed(function, times: int = 1) -> tuple[float, object]:
    """The median seconds of TIMES calls of FUNCTION, and its last result."""
    spans, result = [], None
    for _ in range(times):
        started = time.perf_counter()
        result = function()
        spans.append(time.perf_counter() - started)
    return statistics.median(spans), result


def measure(url: str, now: float, rows: int, seconds: float) -> dict:
    """Everything but the whole year's roll-up, in the order a controller and its gateways would meet it."""
    from llmgw import store
    from llmgw.gateway.usage import UsageRecorder
    from llmgw.people import rollup, usagereport

    engine = store.open_engine(url)
    out: dict = {"reports_s": {}}
    for level in LEVELS:
        out["reports_s"][level], _ = timed(lambda by=level: usagereport.report(engine, by, now - 30 * DAY, now=now), 3)
    out["pages_s"] = usage_pages(url)
    busiest = [f"k{i}" for i in range(20)]
    out["last_used_s"], seen = timed(lambda: usagereport.last_used(engine, busiest), 3)
    assert len(seen) == 20
    out["own_report_s"], _ = timed(lambda: usagereport.report(engine, "model", now - 29 * DAY, now=now,
                                                              user_id="u0"), 3)
    out["day_pass_s"], out["day_pass_rows"] = timed(lambda: rollup.roll_up(engine, now + rollup.SETTLE))
    out["empty_pass_s"], _ = timed(lambda: rollup.roll_up(engine, now + rollup.SETTLE), 3)
    total = usagereport.report(engine, "org", now - 400 * DAY, now=now + rollup.SETTLE)
    assert sum(line.requests for line in total.lines) == rows, "the roll-ups and the raw rows disagree"
    for flushers in (1, 4):
        out[f"flush_{flushers}_rows_s"] = flush_rate(UsageRecorder, engine, flushers, now, seconds)
    out["sweep_s"], out["swept"] = timed(lambda: rollup.prune(engine, 335, now + rollup.SETTLE))
    engine.dispose()
    return out


def usage_pages(url: str) -> dict:
    """The administrator's /admin/usage page (report, chart, template) for each of PAGES: median seconds."""
    from bench.adminpages import signed_in

    app, client = signed_in(url)
    out = {}
    for by, span in PAGES:
        def get(by=by, span=span):
            response = client.get(f"/admin/usage?by={by}&since={span}&metric=tokens")
            assert response.status_code == 200 and b"<svg" in response.data
        out[f"{by} {span}"], _ = timed(get, 3)
    app.runtime.engine.dispose()
    return out


def flush_rate(recorder_class, engine, flushers: int, now: float, seconds: float) -> float:
    """Rows a second that FLUSHERS recorders, each flushing 500-row transactions as a gateway worker does,
    write together for SECONDS."""
    written = [0] * flushers
    stop = time.monotonic() + seconds
    row = (now, "k1", "p1", "model-1", "model-1", "replica-1", "chat", False, 200, 500, 100, 800.0, 120.0, "u1", 42,
           None, None)

    def run(i: int) -> None:
        recorder = recorder_class(engine, batch_size=500)
        while time.monotonic() < stop:
            for _ in range(500):
                recorder.record(row)
            written[i] += recorder.flush()

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(flushers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(written) / (time.monotonic() - started)


def whole_year(url: str, now: float) -> dict:
    """The roll-up of every row at once, from nothing."""
    import sqlalchemy as sa

    from llmgw import store
    from llmgw.people import rollup

    engine = store.open_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE usage_hourly, usage_daily"))
        conn.execute(sa.text("UPDATE revisions SET value = 0 WHERE name = 'usage_rolled'"))
    seconds, counted = timed(lambda: rollup.roll_up(engine, now + rollup.SETTLE))
    engine.dispose()
    return {"s": seconds, "rows": counted, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def in_checkout(checkout: str, what: str, url: str, now: float, rows: int, seconds: float) -> dict:
    """WHAT (measure, whole_year) run by CHECKOUT's llmgw in a process of its own; the whole year's roll-up
    with at most WHOLE_YEAR_MEMORY of address space and an hour."""
    command = [sys.executable, os.path.abspath(__file__), "--run", what, "--checkout", checkout, "--url", url,
               "--now", repr(now), "--rows", str(rows), "--seconds", repr(seconds)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired:
        return {"failed": "not done in an hour"}
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(nothing said)"])[-1]
        if what != "whole_year":
            raise RuntimeError(f"{what} with {checkout} failed:\n{done.stderr[-3000:]}")
        return {"failed": f"exit {done.returncode}: {last[:200]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_one(args: argparse.Namespace) -> int:
    """--run: one measurement in this process, with --checkout's llmgw first on the path; prints its JSON."""
    sys.path.insert(0, args.checkout)
    if args.run == "whole_year":
        resource.setrlimit(resource.RLIMIT_AS, (WHOLE_YEAR_MEMORY, WHOLE_YEAR_MEMORY))
        result = whole_year(args.url, args.now)
    else:
        result = measure(args.url, args.now, args.rows, args.seconds or 5.0)
    print(json.dumps(result))
    return 0


def one_size(pg: str, rows: int, checkouts: dict[str, str], seconds: float) -> dict:
    """The figures for ROWS, in two databases of this process's own on PG (dropped after, whatever happens)."""
    sys.path.insert(0, ROOT)
    now = time.time()
    # Named for this process and a random part: another run on the same server (a container reusing the pid)
    # must not drop these, nor these its.
    base = f"llmgw_bench_usage_{os.getpid()}_{secrets.token_hex(4)}"
    run = f"{base}_run"
    try:
        out: dict = {"setup": fill(make_database(pg, base), rows, now)}
        for label, checkout in checkouts.items():
            out[label] = in_checkout(checkout, "measure", make_database(pg, run, template=base), now, rows, seconds)
            out[label]["whole_year"] = in_checkout(checkout, "whole_year", make_database(pg, run, template=base),
                                                   now, rows, seconds)
        return out
    finally:
        drop_database(pg, run)
        drop_database(pg, base)


# --- the report -----------------------------------------------------------------------------------

def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}" if seconds < 10 else f"{seconds * 1000:,.0f}"


def report(results: list[dict], labels: list[str]) -> str:
    from bench import curves

    row = curves.row
    lines = [curves.header(results, "rows"),
             row("database size (GiB)", (f"{r['setup']['bytes'] / 2**30:.1f}" for r in results)),
             row("rows made, indexes built, roll-ups made (s)", (
                 f"{r['setup']['rows_s']:.0f}, {r['setup']['indexes_s']:.0f}, {r['setup']['rollups_s']:.0f}"
                 for r in results)),
             row("roll-up rows, hourly / daily", (f"{r['setup']['hourly_rows']:,} / {r['setup']['daily_rows']:,}"
                                                  for r in results))]
    for label in labels:
        e = [r[label] for r in results]
        lines += [row(f"{label}: report by {level}, 30 days (ms)", (ms(x["reports_s"][level]) for x in e))
                  for level in LEVELS]
        lines += [row(f"{label}: `/admin/usage` by {by} over {span} (ms)", (ms(x["pages_s"][f"{by} {span}"])
                                                                             for x in e)) for by, span in PAGES]
        lines += [row(f"{label}: last used, the 20 busiest keys (ms)", (ms(x["last_used_s"]) for x in e)),
                  row(f"{label}: a person's own report, 29 days (ms)", (ms(x["own_report_s"]) for x in e)),
                  row(f"{label}: roll-up pass after a day down: rows, ms", (
                      f"{x['day_pass_rows']:,}, {ms(x['day_pass_s'])}" for x in e)),
                  row(f"{label}: roll-up pass with nothing new (ms)", (ms(x["empty_pass_s"]) for x in e)),
                  row(f"{label}: the whole year rolled up at once: s, peak MiB", (_whole(x["whole_year"]) for x in e)),
                  row(f"{label}: flush, rows a second, 1 / 4 flushers", (
                      f"{x['flush_1_rows_s']:,.0f} / {x['flush_4_rows_s']:,.0f}" for x in e)),
                  row(f"{label}: retention sweep of the oldest month: rows, s", (
                      f"{x['swept']:,}, {x['sweep_s']:.1f}" for x in e))]
    lines.append(curves.load_row(results))
    return "".join(lines)


def _whole(figure: dict) -> str:
    if "failed" in figure:
        return figure["failed"]
    return f"{figure['s']:.1f}, {figure['peak_rss_mib']:,.0f}"


def chart(results: list[dict]) -> str:
    from bench.chart import log_lines

    sizes = [r["size"] for r in results]
    this = [r["this"] for r in results]
    series = {"report by key, 30 days": [x["reports_s"]["key"] * 1000 for x in this],
              "/admin/usage by project, 90 days": [x["pages_s"]["project 90d"] * 1000 for x in this],
              "roll-up after a day down": [x["day_pass_s"] * 1000 for x in this]}
    if "baseline" in results[0]:
        series["roll-up after a day down, baseline"] = [r["baseline"]["day_pass_s"] * 1000 for r in results]
    return log_lines("Usage on PostgreSQL, by rows held", "usage rows", "milliseconds", sizes, series)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default=PG_ADMIN, help=f"a PostgreSQL administrator's URL [{PG_ADMIN}]")
    parser.add_argument("--run", choices=("measure", "whole_year"), help=argparse.SUPPRESS)
    parser.add_argument("--checkout", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--now", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    from bench import curves

    curves.arguments(parser, "usage rows", SIZES, f"sizes {QUICK_SIZES} and 1 s flushes: a smoke run",
                     "seconds each flush rate is measured over [5; --quick 1]")
    args = parser.parse_args()
    if args.run:
        return run_one(args)
    if args.baseline and not os.path.isfile(os.path.join(args.baseline, "llmgw", "people", "rollup.py")):
        parser.error(f"--baseline: {args.baseline} holds no llmgw/people/rollup.py")
    sizes = curves.sizes_of(args, SIZES, QUICK_SIZES)
    checkouts = {"this": ROOT, **({"baseline": os.path.abspath(args.baseline)} if args.baseline else {})}
    seconds = args.seconds or (1.0 if args.quick else 5.0)
    results = []
    for size in sizes:
        results.append(curves.under_load(size, lambda size=size: one_size(args.pg, size, checkouts, seconds)))
        print(f"{size:,} rows done", file=sys.stderr, flush=True)
    curves.finish(args, sizes, seconds, results, report(results, list(checkouts)), chart)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
