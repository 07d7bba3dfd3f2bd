"""Usage roll-ups and reports, on SQLite and PostgreSQL."""

import itertools
import json
import os

import sqlalchemy as sa
from click.testing import CliRunner

from llmgw import store
from llmgw.cli.main import main
from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.usage import FIELDS, UsageRecorder
from llmgw.people import keys, orgtree, rollup, usagereport
from tests.conftest import counted

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


def test_a_backlog_is_rolled_up_in_steps_that_add_into_the_same_buckets(engine, monkeypatch):
    a, b = setup_tree(engine)
    monkeypatch.setattr(rollup, "CHUNK", 2)  # a transaction a two rows: 5 rows take three
    old = NOW - 7200
    record(engine, [(old + i, "k1", a if i < 4 else b, "u1", "m", 500 if i == 1 else 200, 10, 5, 100)
                    for i in range(5)])
    marks = []
    real_step = rollup._step
    monkeypatch.setattr(rollup, "_step", lambda *args: (marks.append(1), real_step(*args))[1])
    assert rollup.roll_up(engine, NOW, going_on=lambda: False) == 2 and len(marks) == 1  # stopped after a step
    assert rollup.roll_up(engine, NOW) == 3 and len(marks) == 3
    with engine.connect() as conn:
        hourly = conn.execute(sa.select(store.usage_hourly.c.project_id, store.usage_hourly.c.requests,
                                        store.usage_hourly.c.errors, store.usage_hourly.c.prompt_tokens)
                              .order_by(store.usage_hourly.c.requests)).all()
        assert rollup.watermark(conn) == conn.execute(sa.select(sa.func.max(store.usage.c.id))).scalar()
    # Rows 0-1 and 2-3 of project a were summed in two steps into one hour's row; b's in a third.
    assert [tuple(r) for r in hourly] == [(b, 1, 0, 10), (a, 4, 1, 40)]


def test_a_report_of_the_busiest_groups_sums_the_rest_as_one_line(engine, monkeypatch):
    a, b = setup_tree(engine)
    old = NOW - 3 * 86400
    # k1 is busiest; the chat page's rows (one value a person) are one group; k2 and k3 are the rest.
    rows = [(old, "k1", a, "u1", "m", 200, 10, 5, 100)] * 4 + [(old, "session:u1", None, "u1", "m", 200, 1, 1, 1),
                                                              (old + 86400, "session:u2", None, "u2", "m", 500, 1, 1, 1),
                                                              (old, "k2", b, "u2", "m", 200, 2, 2, 2),
                                                              (old + 86400, "k3", b, "u2", "m", 200, 3, 3, 3)]
    record(engine, rows)
    rollup.roll_up(engine, NOW)
    record(engine, [(NOW - 5, "k3", b, "u2", "m", 200, 4, 4, 4)])  # past the watermark: read raw
    whole = usagereport.report(engine, "key", NOW - 7 * 86400, now=NOW)
    assert [(line.label, line.requests) for line in whole.lines] == [("k1", 4), ("(chat page)", 2), ("k3", 2),
                                                                     ("k2", 1)]
    for named in (1000, 1):  # the shown groups' values named in the query, or too many to name
        monkeypatch.setattr(usagereport, "MOST_NAMED", named)
        two = usagereport.report(engine, "key", NOW - 7 * 86400, now=NOW, top=2)
        assert [(line.label, line.requests, line.errors) for line in two.lines] == [
            ("k1", 4, 0), ("(chat page)", 2, 1), ("2 others", 3, 0)]
        assert [line.series for line in two.lines[:2]] == [line.series for line in whole.lines[:2]]
        others = two.lines[2]
        assert others.tokens == 4 + 6 + 8 and others.cost_micros == 2 + 3 + 4
        # Each bucket of the rest, as a report of them alone would draw it: k2 and k3 on their days, k3 today.
        rest = {}
        for line in whole.lines[2:]:
            for when, figures in line.series.items():
                rest[when] = [x + y for x, y in zip(rest.get(when, [0, 0, 0]), figures)]
        assert {w: f for w, f in others.series.items() if f != [0, 0, 0]} == rest
    assert usagereport.report(engine, "key", NOW - 7 * 86400, now=NOW, top=4).lines == whole.lines
    # An organisation's page: the rest is its own rest, never another organisation's use (k1 is project a's).
    only_b = usagereport.report(engine, "key", NOW - 7 * 86400, now=NOW, project_ids={b}, top=1)
    assert [(line.label, line.requests) for line in only_b.lines] == [("k3", 2), ("1 other", 1)]
    assert sum(f[0] for f in only_b.lines[1].series.values()) == 1


def test_a_roll_up_waits_for_a_flush_still_open_below_the_ids_it_sees(pg_url):
    """PostgreSQL only: SQLite has one writer at a time, so no id is given out uncommitted beside another."""
    import threading

    from llmgw.gateway.usage import insert_rows
    from llmgw.procs import wait_for
    from tests.conftest import store_url_for, wipe

    wipe(pg_url)
    engine = store.open_store(store_url_for(pg_url))
    a, _ = setup_tree(engine)
    row = (NOW - 7200, "k1", a, "m", "m", "r", "chat", False, 200, 1, 1, 1.0, None, "u1", 1)
    # A gateway's flush gets its id first and is slow to commit; another's, later and higher, commits at once.
    slow = engine.connect()
    slow_transaction = slow.begin()
    insert_rows(slow, [row])
    record(engine, [(NOW - 7200, "k1", a, "u1", "m", 200, 2, 2, 2)])
    counted = []
    roller = threading.Thread(target=lambda: counted.append(rollup.roll_up(engine, NOW)), daemon=True)
    waiting = sa.text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = :lock AND NOT granted "
                      "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")
    try:
        roller.start()
        with engine.connect() as conn:  # the roller waits for the lock the open flush shares (or, wrongly, ends)
            wait_for("the roller waiting", 60, lambda: not roller.is_alive() or conn.execute(
                waiting, {"lock": store.USAGE_WRITES_LOCK}).scalar() == 1)
        slow_transaction.commit()
    finally:
        slow.close()
    roller.join(timeout=60)
    assert counted == [2]
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.sum(store.usage_daily.c.requests))).scalar() == 2
        assert conn.execute(sa.select(sa.func.sum(store.usage_hourly.c.cost_micros))).scalar() == 1 + 2
    engine.dispose()


def test_a_flush_open_too_long_holds_the_roller_for_seconds_not_every_gateway(pg_url, monkeypatch, caplog):
    from llmgw.gateway.usage import insert_rows
    from tests.conftest import store_url_for, wipe

    wipe(pg_url)
    engine = store.open_store(store_url_for(pg_url))
    monkeypatch.setattr(rollup, "WRITERS_WAIT", 0.5)
    a, _ = setup_tree(engine)
    stuck = engine.connect()
    try:
        with stuck.begin():
            insert_rows(stuck, [(NOW - 7200, "k1", a, "m", "m", "r", "chat", False, 200, 1, 1, 1.0, None, "u1", 1)])
            try:
                rollup.roll_up(engine, NOW)
                raise AssertionError("rolled up past a flush still open")
            except rollup.FlushesOpen as e:
                assert "open for more than 0.5 s" in str(e)
            record(engine, [(NOW - 7200, "k2", a, "u1", "m", 200, 2, 2, 2)])  # other gateways still write
    finally:
        stuck.close()
    assert rollup.roll_up(engine, NOW) == 2
    engine.dispose()


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


def test_hourly_roll_ups_are_pruned_with_raw_rows_but_kept_a_week(engine):
    a, _ = setup_tree(engine)
    days = (100, 30, 5, 1)
    record(engine, [(NOW - d * 86400, "k", a, "u", "m", 200, 1, 1, 1) for d in days])
    rollup.roll_up(engine, NOW)

    def hours():
        with engine.connect() as conn:
            return sorted(round((NOW - h) / 86400) for h in conn.execute(sa.select(store.usage_hourly.c.hour)).scalars())

    rollup.prune(engine, 90, NOW)
    assert hours() == [1, 5, 30]
    assert rollup.prune(engine, 2, NOW) == 2  # the raw rows of 30 and 5 days ago; hourly ones stay a week
    assert hours() == [1, 5]
    assert usagereport.report(engine, "model", NOW - 2 * 86400, now=NOW).lines[0].requests == 1
    assert usagereport.report(engine, "model", NOW - 120 * 86400, now=NOW).lines[0].requests == 4  # daily stay


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


# --- writing rows: one row never blocks the others, and none is lost at a stop --------------------

def usage_row(key_id="k", model="m", endpoint="chat"):
    return (NOW, key_id, None, model, model, "r", endpoint, False, 200, 1, 1, 1.0, None, None, None)


def stored(engine, *columns):
    with engine.connect() as conn:
        return conn.execute(sa.select(*[store.usage.c[c] for c in columns]).order_by(store.usage.c.id)).all()


def test_a_long_model_name_is_stored_cut_and_holds_up_no_other_row(engine):
    # On PostgreSQL a name over 200 characters failed its batch, and every batch after it, for good;
    # SQLite stored all 100,000 characters.
    recorder = UsageRecorder(engine, batch_size=5)
    for i in range(13):
        recorder.record(usage_row(key_id=f"k{i}", model="m" * 100_000 if i == 2 else "m"))
    assert recorder.flush() == 13 and recorder.pending() == 0
    rows = stored(engine, "key_id", "model_asked", "model_served")
    assert [r.key_id for r in rows] == [f"k{i}" for i in range(13)]
    assert rows[2].model_asked == "m" * 200 and rows[2].model_served == "m" * 200


def test_a_flush_writes_what_was_buffered_when_it_began_and_leaves_what_comes_meanwhile(engine):
    # Chasing the rows that came in while it wrote, a flush on a store slow to commit never ended, writing
    # batch after small batch, each with its own transaction.
    recorder = UsageRecorder(engine, batch_size=2)
    for i in range(3):
        recorder.record(usage_row(key_id=f"k{i}"))
    write, late = recorder._write, iter(range(5))

    def write_while_requests_come(rows):
        for i in itertools.islice(late, 1):
            recorder.record(usage_row(key_id=f"late{i}"))
        write(rows)

    recorder._write = write_while_requests_come
    assert recorder.flush() == 3 and recorder.pending() == 2
    assert [r.key_id for r in stored(engine, "key_id")] == ["k0", "k1", "k2"]
    assert recorder.flush() == 2 and recorder.pending() == 1


def test_a_row_the_store_refuses_is_dropped_logged_and_counted_and_the_rest_written(engine, caplog):
    metrics = GatewayMetrics()
    recorder = UsageRecorder(engine, batch_size=500, metrics=metrics)
    for i in range(6):
        recorder.record(usage_row(key_id=f"k{i}", endpoint=None if i == 3 else "chat"))  # endpoint is NOT NULL
    assert recorder.flush() == 6 and recorder.pending() == 0
    assert [r.key_id for r in stored(engine, "key_id")] == ["k0", "k1", "k2", "k4", "k5"]
    assert counted(metrics, metrics.usage_dropped) == 1
    dropped = [r.getMessage() for r in caplog.records if "usage row dropped" in r.getMessage()]
    assert len(dropped) == 1 and '"key_id": "k3"' in dropped[0] and "the store refused it" in dropped[0]
    recorder.record(usage_row(key_id="k6"))
    assert recorder.flush() == 1  # never tried again


def test_rows_wait_while_the_store_cannot_take_them_and_none_is_dropped(engine):
    metrics = GatewayMetrics()
    recorder = UsageRecorder(engine, batch_size=2, metrics=metrics)
    for i in range(3):
        recorder.record(usage_row(key_id=f"k{i}"))
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE usage RENAME TO usage_away"))  # what a failed store looks like to a write
    try:
        assert recorder.flush() == 0 and recorder.flush() == 0
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE usage_away RENAME TO usage"))
    assert recorder.pending() == 3 and counted(metrics, metrics.usage_dropped) == 0
    assert recorder.flush() == 3 and [r.key_id for r in stored(engine, "key_id")] == ["k0", "k1", "k2"]


def test_spooled_rows_are_written_by_the_next_start_once(engine, tmp_path):
    spool = tmp_path / "spool"
    stopping = UsageRecorder(engine, batch_size=4, spool_dir=str(spool))
    for i in range(10):
        stopping.record(usage_row(key_id=f"k{i}"))
    path, count = stopping.spool()
    assert count == 10 and stopping.pending() == 0
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(spool).st_mode & 0o777 == 0o700
    with open(path, "rb") as f:
        kept = f.read()
    # Two workers start together and both find the file: it is written once.
    first, second = (UsageRecorder(engine, batch_size=4, spool_dir=str(spool)) for _ in range(2))
    assert first.flush() == 0 and second.flush() == 0
    assert os.listdir(spool) == []
    # A start that stopped after writing the rows but before removing the file: not written again.
    with open(path, "wb") as f:
        f.write(kept)
    UsageRecorder(engine, batch_size=4, spool_dir=str(spool)).flush()
    assert os.listdir(spool) == []
    assert sorted(r.key_id for r in stored(engine, "key_id")) == sorted(f"k{i}" for i in range(10))


def test_spooled_rows_wait_while_the_store_cannot_be_written(tmp_path):
    spool = tmp_path / "spool"
    engine = store.open_engine(f"sqlite:///{tmp_path}/unmigrated.db")  # no usage table: writes fail
    stopping = UsageRecorder(engine, batch_size=10, spool_dir=str(spool))
    stopping.record(usage_row())
    assert stopping.flush() == 0 and stopping.spool()[1] == 1
    starting = UsageRecorder(engine, batch_size=10, spool_dir=str(spool))
    starting.record(usage_row(key_id="new"))
    assert starting.flush() == 0 and len(os.listdir(spool)) == 1 and starting.pending() == 1
    store.migrate(engine)
    assert starting.flush() == 1 and os.listdir(spool) == []
    assert sorted(r.key_id for r in stored(engine, "key_id")) == ["k", "new"]
    engine.dispose()


def test_rows_neither_store_nor_spool_takes_are_logged_with_their_content(tmp_path, caplog):
    engine = store.open_engine(f"sqlite:///{tmp_path}/unmigrated.db")
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    recorder = UsageRecorder(engine, batch_size=10, metrics=GatewayMetrics(), spool_dir=str(blocked / "spool"))
    recorder.record(usage_row(key_id="lost"))
    assert recorder.spool() == (None, 1)
    assert counted(recorder.metrics, recorder.metrics.usage_dropped) == 1
    assert any('"key_id": "lost"' in r.getMessage() for r in caplog.records)
    engine.dispose()


def test_a_spool_line_that_holds_no_row_is_logged_and_the_others_written(engine, tmp_path, caplog):
    spool = tmp_path / "spool"
    stopping = UsageRecorder(engine, batch_size=10, spool_dir=str(spool))
    stopping.record(usage_row(key_id="kept"))
    path, _ = stopping.spool()
    shaped_wrong = {**dict(zip(FIELDS, usage_row(key_id="wrong"))), "status": {"code": 200}}
    with open(path, "a") as f:
        f.write("not json\n" + json.dumps(shaped_wrong) + "\n")
    starting = UsageRecorder(engine, batch_size=10, metrics=GatewayMetrics(), spool_dir=str(spool))
    starting.flush()
    assert [r.key_id for r in stored(engine, "key_id")] == ["kept"] and os.listdir(spool) == []
    assert counted(starting.metrics, starting.metrics.usage_dropped) == 2
    assert any("unreadable in the spool: not json" in r.getMessage() for r in caplog.records)


def test_a_budget_is_shown_beside_a_row_only_where_that_level_sets_one(store_url):
    # An organisation's budget printed beside each of its teams read as each team's own.
    import time

    from llmgw.people import limits

    engine = store.open_engine(store_url)
    a, b = setup_tree(engine)
    tree = orgtree.Tree.load(engine)
    limits.set_limits(engine, "org", tree.find("org", "Acme").id, "test", budget=50_000_000)
    limits.set_limits(engine, "project", a, "test", budget=5_000_000, period="day")
    record(engine, [(time.time() - 3600, "k", a, None, "m", 200, 3, 4, 10), (time.time() - 3600, "k", b, None, "m",
                                                                              200, 3, 4, 10)])
    try:
        by_project = {line.label: line.budget for line in usagereport.report(engine, "project", time.time() - 86400)
                      .lines}
        assert by_project == {"Acme/ml/a": (5_000_000, "day"), "Acme/ml/b": None}
        assert [line.budget for line in usagereport.report(engine, "org", time.time() - 86400).lines] == [
            (50_000_000, "month")]
        assert [line.budget for line in usagereport.report(engine, "team", time.time() - 86400).lines] == [None]
    finally:
        engine.dispose()
    runner = CliRunner()
    table = runner.invoke(main, ["--store", store_url, "usage", "--by", "project"]).output
    assert "BUDGET" in table and "5 a day" in table
    assert "BUDGET" not in runner.invoke(main, ["--store", store_url, "usage", "--by", "team"]).output
    line = json.loads(runner.invoke(main, ["--store", store_url, "usage", "--by", "org", "--json"]).output)
    assert (line["budget_micros"], line["budget_period"]) == (50_000_000, "month")
