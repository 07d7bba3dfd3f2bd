"""bench/usage.py keeps running: a year of usage rows on the local PostgreSQL, in databases of its own, measured
with this checkout as its own baseline so the side-by-side report is exercised too; and what it reads adds up."""

import json
import subprocess
import sys

import psycopg2

from tests.conftest import PG_ADMIN, ROOT


def test_the_usage_benchmark_runs_quick_and_leaves_no_database(tmp_path):
    out, svg = tmp_path / "usage.json", tmp_path / "usage.svg"
    bench = subprocess.Popen([sys.executable, f"{ROOT}/bench/usage.py", "--quick", "--baseline", ROOT, "--pg", PG_ADMIN,
                              "--out", str(out), "--chart", str(svg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        stdout, stderr = bench.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        bench.kill()
        left(bench.pid, drop=True)
        raise
    assert bench.returncode == 0, stdout + stderr
    assert "this: report by key, 30 days (ms)" in stdout and "baseline: `/admin/usage` by person over 90d" in stdout
    (result,) = json.loads(out.read_text())["results"]
    assert result["size"] == 20_000
    for which in ("this", "baseline"):
        figures = result[which]
        # Counts, not timings (the bench itself checks that the roll-ups and raw rows give the same total):
        # the last day's rows are caught up, the whole year is rolled up from nothing, the oldest month is swept.
        assert 20_000 / 365 * 0.8 < figures["day_pass_rows"] < 20_000 / 365 * 1.2
        assert figures["whole_year"]["rows"] == 20_000
        assert 20_000 / 12 * 0.8 < figures["swept"] < 20_000 / 12 * 1.2
        assert figures["flush_1_rows_s"] > 0 and figures["flush_4_rows_s"] > 0
    assert svg.read_text().startswith("<svg") and "roll-up after a day down" in svg.read_text()
    assert left(bench.pid) == []


def left(pid: int, drop: bool = False) -> list[str]:
    """The databases the bench of process PID left (its two are named for it); DROP them."""
    admin = psycopg2.connect(PG_ADMIN.replace("postgresql://", "postgres://", 1))
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", (f"llmgw_bench_usage_{pid}_%",))
            names = [name for (name,) in cur.fetchall()]
            for name in names if drop else ():
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.close()
    return names
