"""Old code on a store a newer llmgw migrated: every role that opens the store refuses to start, naming the
store's newest migration and its own, and changes nothing; a role already running when the newer code
migrates keeps serving (docs/operations.md, "Upgrades"). On SQLite and on PostgreSQL, with each role run as
the operator runs it, in its own process.

Before, such a store was used silently: a role started on it as on any other."""

import os
import subprocess
import sys
import time

import pytest
import sqlalchemy as sa

from llmgw import store
from llmgw.procs import free_port
from tests.conftest import ROOT, Gateway, Sim, count_usage, make_key, post, wait_until, write_config

FUTURE = store.MIGRATIONS[-1][0] + 1
MINE = store.MIGRATIONS[-1]


def from_the_future(url: str) -> None:
    """Record in the store at URL a migration this code does not know, as a newer llmgw's would be."""
    engine = store.open_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(store.schema_migrations.insert().values(version=FUTURE, description="what comes next",
                                                                 applied_at=time.time()))
    finally:
        engine.dispose()


def applied(url: str) -> list[int]:
    engine = store.open_engine(url)
    try:
        with engine.connect() as conn:
            return sorted(conn.execute(sa.select(store.schema_migrations.c.version)).scalars())
    finally:
        engine.dispose()


def refused_with_both_versions(text: str) -> bool:
    said = " ".join(text.split())
    return (f"adding migration {FUTURE}, which this llmgw" in said
            and f"The store's newest migration is {FUTURE} (what comes next); this llmgw's is {MINE[0]} ({MINE[1]})"
            in said and "Nothing was changed" in said and "Upgrades" in said)


def run(tmp_path, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_every_role_refuses_a_store_a_newer_llmgw_migrated(store_url, tmp_path):
    from_the_future(store_url)
    before = applied(store_url)
    # Ports nothing listens on: each role is refused before it opens one.
    listens = {name: f"127.0.0.1:{free_port()}" for name in (
        "gateway.listen", "gateway.metrics_listen", "controller.admin_listen", "controller.agent_listen",
        "controller.gateway_listen", "controller.metrics_listen")}
    config = write_config(tmp_path / "llmgw.toml", {
        "store.url": store_url, "controller.keys_dir": str(tmp_path / "keys"),
        "usage.spool_dir": str(tmp_path / "spool"), **listens})
    roles = {
        "gateway": [os.path.join(ROOT, "gateway.py"), "--config", config],
        "controller": [os.path.join(ROOT, "controller.py"), "--config", config],
        "llmgw keys list": ["-m", "llmgw", "--config", config, "keys", "list"],
        "llmgw users create": ["-m", "llmgw", "--config", config, "users", "create", "x@example.com",
                               "--password", "a long enough password"],
        "llmgw store move": ["-m", "llmgw", "store", "move", "--from", store_url,
                             "--to", f"sqlite:///{tmp_path}/elsewhere.db"],
        "llmgw up": ["-m", "llmgw", "--config", config, "up", "--listen", f"127.0.0.1:{free_port()}"],
    }
    for role, argv in roles.items():
        done = run(tmp_path, *argv)
        assert done.returncode != 0 and refused_with_both_versions(done.stderr), (role, done.stderr[-2000:])
    assert applied(store_url) == before
    assert not os.path.exists(tmp_path / "elsewhere.db")  # the move refused before it made its destination


def test_a_refused_migration_applies_nothing(store_url):
    # The store lacks this code's last migration and holds a newer one: nothing is applied, not even the last.
    engine = store.open_engine(store_url)
    try:
        with engine.begin() as conn:
            conn.execute(store.schema_migrations.delete().where(store.schema_migrations.c.version == MINE[0]))
        from_the_future(store_url)
        with pytest.raises(store.NewerSchema, match=f"adding migration {FUTURE}, "):
            store.migrate(engine)
    finally:
        engine.dispose()
    assert MINE[0] not in applied(store_url) and FUTURE in applied(store_url)


def test_a_running_gateway_keeps_serving_when_a_newer_llmgw_migrates(tmp_path):
    # The upgrade order: the controller first, then gateways one at a time. A gateway of the old version
    # that is still running when the controller migrates goes on serving and writing usage rows: the
    # migrations only add. Restarted on the old code, it is refused.
    url = f"sqlite:///{tmp_path}/gw.db"
    key = make_key(url)
    sim = Sim(model="m", replica="s", ttft_ms=1, tokens_per_s=1000)
    try:
        gw = Gateway(tmp_path, url, endpoints=[{"id": "s", "url": sim.url, "models": ["m"]}], workers=1,
                     usage__flush_interval=0.2)
        try:
            from_the_future(url)
            status, _, _ = post(gw.url + "/v1/chat/completions",
                                {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, key)
            assert status == 200
            wait_until("the usage row written", 20, lambda: count_usage(url) == 1)
        finally:
            gw.stop()
        with pytest.raises(RuntimeError, match="the gateway did not start") as e:
            Gateway(tmp_path, url, endpoints=[{"id": "s", "url": sim.url, "models": ["m"]}], workers=1).stop()
        assert refused_with_both_versions(str(e.value))
    finally:
        sim.stop()
