import pytest
import sqlalchemy as sa

from llmgw import store
from tests.conftest import wipe


def test_migrations_build_the_schema_once(store_url):
    engine = store.open_engine(store_url)
    assert store.migrate(engine) == []  # the fixture already applied them
    with engine.connect() as conn:
        versions = [r[0] for r in conn.execute(sa.select(store.schema_migrations.c.version))]
        projects = [r[0] for r in conn.execute(sa.select(store.projects.c.name))]
    assert versions == [v for v, _, _ in store.MIGRATIONS]
    assert projects == [store.DEFAULT_PROJECT]
    engine.dispose()


def test_fresh_store_is_migrated_at_open(tmp_path):
    engine = store.open_store(f"sqlite:///{tmp_path}/sub/dir/new.db")
    assert (tmp_path / "sub" / "dir" / "new.db").exists()
    with engine.connect() as conn:
        assert store.read_revision(conn, "keys") == 1
    engine.dispose()


def test_usage_rows_round_trip(store_url):
    from llmgw.gateway.usage import FIELDS, UsageRecorder

    engine = store.open_engine(store_url)
    recorder = UsageRecorder(engine, batch_size=2)
    for i in range(5):
        recorder.record((1.0 + i, "k", "p", "asked", "served", "r1", "chat", True, 200, 10, 20 + i, 5.5, None, None, None))
    assert recorder.flush() == 5 and recorder.pending() == 0
    with engine.connect() as conn:
        rows = conn.execute(sa.select(*[store.usage.c[f] for f in FIELDS]).order_by(store.usage.c.at)).all()
    assert [r.completion_tokens for r in rows] == [20, 21, 22, 23, 24]
    assert rows[0].ttft_ms is None  # not known stays absent
    engine.dispose()


def test_failed_usage_write_keeps_the_rows(tmp_path):
    from llmgw.gateway.usage import UsageRecorder

    engine = store.open_engine(f"sqlite:///{tmp_path}/unmigrated.db")  # no usage table: writes fail
    recorder = UsageRecorder(engine, batch_size=10)
    recorder.record((1.0, "k", "p", "a", "s", "r", "chat", False, 200, 1, 1, 1.0, None, None, None))
    assert recorder.flush() == 0
    assert recorder.pending() == 1
    store.migrate(engine)
    assert recorder.flush() == 1
    engine.dispose()


def test_wipe_refuses_a_database_not_named_for_tests():
    with pytest.raises(RuntimeError, match="does not say it is for tests"):
        wipe("postgresql://postgres@127.0.0.1:5432/llmgw")


def test_describe_hides_the_password():
    assert "s3cret" not in store.describe("postgresql+psycopg2://gw:s3cret@db/llmgw")


def test_last_use_of_each_key(store_url):
    from llmgw.gateway.usage import UsageRecorder
    from llmgw.people import usagereport

    engine = store.open_engine(store_url)
    recorder = UsageRecorder(engine, batch_size=10)
    day = 86400
    now = 100 * day + 3600
    rows = [(now, "k1", "p", "m", "m", "r", "chat", True, 200, 3, 4, 1.0, None),
            (now - day, "k1", "p", "m", "m", "r", "chat", True, 200, None, None, 1.0, None),
            (now - 40 * day, "k1", "p", "m", "m", "r", "chat", True, 200, 7, 7, 1.0, None),
            (now, "k2", "p", "m", "m", "r", "chat", True, 200, 1, 1, 1.0, None)]
    for row in rows:
        recorder.record(row)
    recorder.flush()
    assert usagereport.last_used(engine, ["k1", "k3"]) == {"k1": now}
    # More keys than one statement joins (SQLite refuses a compound SELECT of more than 500).
    many = [f"unused-{i}" for i in range(1100)] + ["k2"]
    assert usagereport.last_used(engine, many) == {"k2": now}
    engine.dispose()
