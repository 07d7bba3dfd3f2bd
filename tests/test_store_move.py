"""`llmgw store move`: every row into an empty database, checked, and never while something uses the source.

Run against the real CLI, from SQLite into PostgreSQL and between two PostgreSQL databases; each test makes
empty databases of its own on the shared server.
"""

import subprocess
import sys

import pytest
import sqlalchemy as sa

from llmgw import memory, store, storemove
from llmgw.control.lease import Lease
from llmgw.gateway.usage import UsageRecorder
from llmgw.people import accounts, keys
from llmgw.procs import wait_for
from tests.conftest import Gateway, store_url_for

LLMGW = [sys.executable, "-m", "llmgw"]
WAIT = 40.0


def filled(url: str) -> dict[str, int]:
    """A store at URL with people, keys and usage; its row counts by table."""
    engine = store.open_store(store_url_for(url))
    try:
        accounts.create_user(engine, "ada@example.org", "a long enough password", state=accounts.ACTIVE)
        for i in range(3):
            keys.create_key(engine, f"key-{i}")
        recorder = UsageRecorder(engine, batch_size=500)
        for i in range(1200):  # more than one batch of the copy
            recorder.record((1.0 + i, "k", "p", "asked", "served", "r1", "chat", True, 200, 10, 20, 5.5, None, None,
                             None))
        assert recorder.flush() == 1200
        for text in ("Deploys go through deploy/ansible.", "The staging host is stage-2."):  # agents' notes
            memory.add(engine, "p", text, 24)
        return counts(engine)
    finally:
        engine.dispose()


def counts(engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {t.name: conn.execute(sa.select(sa.func.count()).select_from(t)).scalar()
                for t in store.metadata.sorted_tables}


def move(source: str, target: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LLMGW, "store", "move", "--from", source, "--to", target], capture_output=True,
                          text=True, timeout=120)


def test_a_sqlite_store_moves_into_postgresql_whole_and_goes_on_there(tmp_path, empty_pg):
    source, target = f"sqlite:///{tmp_path}/old.db", empty_pg(1)
    before = filled(source)
    run = move(source, target)
    assert run.returncode == 0, run.stderr
    assert "  usage" in run.stdout and " 1200 rows" in run.stdout and "id sequences checked" in run.stdout
    engine = store.open_store(store_url_for(target))
    try:
        assert counts(engine) == before
        # The ids came with the rows; a usage row written there now gets the next one, not one already taken.
        recorder = UsageRecorder(engine, batch_size=10)
        recorder.record((9999.0, "k", "p", "asked", "served", "r1", "chat", True, 200, 1, 1, 1.0, None, None, None))
        assert recorder.flush() == 1
        with engine.connect() as conn:
            assert conn.execute(sa.select(store.usage.c.id).where(store.usage.c.at == 9999.0)).scalar() == 1201
        # Notes came searchable (PostgreSQL's index is made from the words copied), and a new one takes a
        # place of its own.
        assert [n.text for n in memory.search(engine, "p", "ansible", 24, 10)] == ["Deploys go through deploy/ansible."]
        memory.add(engine, "p", "Written after the move.", 24)
        assert len(memory.listing(engine, "p", 24, 10)) == 3
    finally:
        engine.dispose()
    again = move(source, target)
    assert again.returncode == 1 and "already holds keys, people or usage" in again.stderr
    assert counts_at(source) == before  # the source is left as it was


def counts_at(url: str) -> dict[str, int]:
    engine = store.open_engine(store_url_for(url))
    try:
        return counts(engine)
    finally:
        engine.dispose()


def test_a_postgresql_store_moves_to_another_server(empty_pg):
    source, target = empty_pg(1), empty_pg(2)
    before = filled(source)
    run = move(source, target)
    assert run.returncode == 0, run.stderr
    assert counts_at(target) == before


def test_the_move_refuses_while_a_controller_leads_on_the_source(tmp_path, empty_pg):
    source, target = f"sqlite:///{tmp_path}/old.db", empty_pg(1)
    filled(source)
    engine = store.open_store(source)
    lease = Lease(engine, "ctl-a.internal:7443", ttl=60, renew_interval=0.1)
    try:
        assert lease.renew()
        run = move(source, target)
        assert run.returncode == 1 and "the leading controller (ctl-a.internal:7443)" in run.stderr
        assert "Stop every controller and gateway" in run.stderr
        assert counts_at(target)["users"] == 0  # nothing was copied
        lease.release()  # a clean stop
        assert move(source, target).returncode == 0
    finally:
        engine.dispose()


def test_the_move_refuses_while_a_gateway_runs_on_the_source(tmp_path, empty_pg):
    source, target = f"sqlite:///{tmp_path}/old.db", empty_pg(1)
    filled(source)
    gw = Gateway(tmp_path, source, workers=1)
    try:
        engine = store.open_engine(source)
        try:
            wait_for("the gateway's presence in the store", WAIT,
                     lambda: any(name.startswith("gateway ") for name, _ in held(engine)))
        finally:
            engine.dispose()
        run = move(source, target)
        assert run.returncode == 1 and "a gateway on " in run.stderr and f"127.0.0.1:{gw.port}" in run.stderr
    finally:
        gw.stop()
    run = move(source, target)  # a gateway that stopped cleanly took its presence away
    assert run.returncode == 0, run.stderr


def held(engine):
    with engine.connect() as conn:
        return storemove.holders(conn)


def test_a_source_that_does_not_exist_is_not_made(tmp_path, empty_pg):
    run = move(f"sqlite:///{tmp_path}/typo.db", empty_pg(1))
    assert run.returncode == 1 and "there is no store at" in run.stderr
    assert not (tmp_path / "typo.db").exists()


def test_force_moves_past_the_mark_of_a_gateway_that_was_killed(tmp_path, empty_pg):
    from llmgw.gateway import presence

    source, target = f"sqlite:///{tmp_path}/old.db", empty_pg(1)
    filled(source)
    presence.mark(source, "127.0.0.1:8080")  # as a gateway's master does at its start, and never took away
    run = move(source, target)
    assert run.returncode == 1 and "--force moves regardless" in run.stderr
    forced = subprocess.run([*LLMGW, "store", "move", "--from", source, "--to", target, "--force"],
                            capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0, forced.stderr


def test_a_standby_cannot_take_the_source_lease_while_the_move_copies(tmp_path, empty_pg):
    from llmgw import storemove

    source, target = f"sqlite:///{tmp_path}/old.db", empty_pg(1)
    filled(source)
    engine = store.open_engine(source)
    standby = Lease(engine, "ctl-b.internal:7443", ttl=60, renew_interval=0.1)
    tries = []
    try:
        # A standby renews every few seconds: here, as each table is copied (the move checked the lease first).
        storemove.move(source, store_url_for(target), lambda table, rows: tries.append(standby.renew()))
        assert tries and not any(tries), tries
        assert standby.renew()  # the move is done and gave the lease back
    finally:
        standby.release()
        engine.dispose()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_source_is_read_at_one_moment_and_a_write_during_the_move_refuses_it(tmp_path, empty_pg, kind):
    from llmgw import storemove
    from llmgw.people import orgtree

    source = f"sqlite:///{tmp_path}/old.db" if kind == "sqlite" else empty_pg(1)
    target = store_url_for(empty_pg(2))
    filled(source)
    engine = store.open_engine(store_url_for(source))
    made = []

    def write_meanwhile(table, rows):
        if table == "projects" and not made:
            # A project and its key, made once the projects were copied: read at another moment, the key
            # arrived without its project (PostgreSQL's default reads each table afresh).
            orgtree.add(engine, "project", "late", "default/default")
            made.append(keys.create_key(engine, "late", project="default/default/late"))

    try:
        with pytest.raises(storemove.MoveRefused, match="changed while it was copied") as refused:
            storemove.move(store_url_for(source), target, write_meanwhile)
        assert "api_keys" in str(refused.value) and "the destination was left empty" in str(refused.value)
        assert made and not storemove.holds_data(store.open_engine(target))
        assert held(engine) == []  # the move's hold on the lease was given back
    finally:
        engine.dispose()


def test_leases_are_not_copied_so_the_destination_is_neither_led_nor_used(tmp_path, empty_pg):
    from llmgw.gateway import presence

    source, target = f"sqlite:///{tmp_path}/old.db", empty_pg(1)
    filled(source)
    presence.mark(source, "127.0.0.1:8080")  # a killed gateway's mark, moved past with --force
    forced = subprocess.run([*LLMGW, "store", "move", "--from", source, "--to", target, "--force"],
                            capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0, forced.stderr
    assert not [line for line in forced.stdout.splitlines() if line.split()[:1] == ["leases"]]
    engine = store.open_engine(store_url_for(target))
    try:
        assert held(engine) == []
        with engine.connect() as conn:
            assert conn.execute(sa.select(store.leases.c.name, store.leases.c.owner)).all() == [("controller", "")]
    finally:
        engine.dispose()
    assert move(target, empty_pg(2)).returncode == 0  # and it can be moved on
