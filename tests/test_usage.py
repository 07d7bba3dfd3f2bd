"""Usage roll-ups and reports, on SQLite and PostgreSQL."""

import json

import sqlalchemy as sa
from click.testing import CliRunner

from llmgw import store
from llmgw.cli.main import main
from llmgw.gateway.usage import UsageRecorder
from llmgw.people import keys, orgtree, rollup, usagereport

NOW = 1_800_000_000.0  # a fixed clock: 2027-01-15 08:00 UTC


def record(engine, rows):
    recorder = UsageRecorder(engine, batch_size=1000)
    for at, key_id, project_id, user_id, model, status, prompt, completion, cost in rows:
        recorder.record((at, key_id, project_id, model, model, "r", "chat", False, status, prompt, completion, 1.0,
                         None, user_id, cost))
    recorder.flush()


def setup_tree(engine):
    orgtree.add(engine, "org", "Acme")
    orgtree.add(engine, "team", "ml", "Acme")
    a = orgtree.add(engine, "project", "a", "Acme/ml")
    b = orgtree.add(engine, "project", "b", "Acme/ml")
    return a.id, b.id


def test_a_roll_up_counts_each_row_once_and_reports_match_the_raw_rows(engine):
    a, b = setup_tree(engine)
    # Two hours ago: 3 rows in a (one an error), 1 in b. Now: 1 row in a, too young to roll up.
    old = NOW - 7200
    record(engine, [(old, "k1", a, "u1", "m", 200, 10, 5, 100), (old + 1, "k1", a, "u1", "m", 500, 10, 0, 0),
                    (old + 2, "k2", a, None, "m", 200, 1, 1, 20), (old + 3, "k3", b, "u2", "n", 200, 7, 3, 50),
                    (NOW - 5, "k1", a, "u1", "m", 200, 2, 2, 4)])
    assert rollup.roll_up(engine, NOW) == 4
    assert rollup.roll_up(engine, NOW) == 0  # nothing new: the watermark moved
    with engine.connect() as conn:
        daily = conn.execute(sa.select(sa.func.sum(store.usage_daily.c.requests),
                                       sa.func.sum(store.usage_daily.c.cost_micros))).one()
        hourly = conn.execute(sa.select(sa.func.sum(store.usage_hourly.c.errors))).scalar()
    assert tuple(daily) == (4, 170) and hourly == 1
    # The report adds the row not yet rolled up: 5 requests, 174 spent.
    report = usagereport.report(engine, "project", NOW - 86400, now=NOW)
    by_label = {line.label: line for line in report.lines}
    assert by_label["Acme/ml/a"].requests == 4 and by_label["Acme/ml/a"].cost_micros == 124
    assert by_label["Acme/ml/a"].errors == 1
    assert by_label["Acme/ml/b"].tokens == 10
    assert report.step == rollup.HOUR
    team = usagereport.report(engine, "team", NOW - 86400, now=NOW)
    assert [(line.label, line.requests) for line in team.lines] == [("Acme/ml", 5)]
    only_b = usagereport.report(engine, "model", NOW - 86400, now=NOW, project_ids={b})
    assert [(line.label, line.requests) for line in only_b.lines] == [("n", 1)]


def test_reports_over_weeks_read_days(engine):
    a, _ = setup_tree(engine)
    record(engine, [(NOW - d * 86400, "k", a, "u", "m", 200, 1, 1, 1) for d in range(10)])
    rollup.roll_up(engine, NOW)
    report = usagereport.report(engine, "model", NOW - 7 * 86400, now=NOW)
    assert report.step == rollup.DAY and len(report.buckets) == 8
    assert report.lines[0].requests == 8  # today and the seven days before it


def test_raw_rows_are_pruned_only_once_rolled_up(engine):
    a, _ = setup_tree(engine)
    record(engine, [(NOW - 100 * 86400, "k", a, "u", "m", 200, 1, 1, 1), (NOW - 10, "k", a, "u", "m", 200, 1, 1, 1)])
    assert rollup.prune(engine, 90, NOW) == 0  # not rolled up yet: kept
    rollup.roll_up(engine, NOW)
    assert rollup.prune(engine, 90, NOW) == 1
    report = usagereport.report(engine, "model", NOW - 120 * 86400, now=NOW)
    assert report.lines[0].requests == 2  # the pruned row still counts, from its roll-up


def test_llmgw_usage_prints_a_table_and_json(store_url):
    engine = store.open_engine(store_url)
    a, _ = setup_tree(engine)
    key, _ = keys.create_key(engine, "ci", a)
    import time
    record(engine, [(time.time() - 3600, key.id, a, None, "m", 200, 3, 4, 0)])
    engine.dispose()
    runner = CliRunner()
    result = runner.invoke(main, ["--store", store_url, "usage", "--by", "key", "--since", "2d"])
    assert result.exit_code == 0 and "ci" in result.output and "REQUESTS" in result.output
    result = runner.invoke(main, ["--store", store_url, "usage", "--by", "org", "--json"])
    line = json.loads(result.output.splitlines()[0])
    assert line["org"] == "Acme" and line["completion_tokens"] == 4
    result = runner.invoke(main, ["--store", store_url, "usage", "--since", "soon"])
    assert result.exit_code == 2 and "not a duration" in result.output
