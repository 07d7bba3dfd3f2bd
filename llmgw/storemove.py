"""Moving a store to another database: every row of every table, in one transaction, checked afterwards.

`llmgw store move --from URL --to URL` (SQLite to PostgreSQL, or between two PostgreSQL servers), and
`llmgw init --postgres DSN`, which moves the SQLite store it made before. The destination must hold nothing
but what its migrations seed (the default project, the revision counters, the free leader lease): moving
into a store that already serves a cluster would mix two clusters' keys and people. The source must be
idle: a leading controller or a running gateway holds a row of its `leases` (llmgw/control/lease.py,
llmgw/gateway/presence.py), and what they wrote after the copy would stay behind, so the move refuses
while one does. The move takes the controllers' lease itself, in the statement that checks it, and holds
it until it is done: a standby that took it just after a check once could have led, and written, while
the copy ran. `leases` rows are not copied: the destination starts with its own free lease, where a
copied one (the move's, or a killed gateway's mark) would make it look led or used.

The copy is one transaction for all tables rather than one per table: a move that fails half way leaves
the destination as empty as it was, so it can simply be run again. The source is read in one transaction
too (REPEATABLE READ on PostgreSQL, whose default reads each table at another moment: a key made during a
move could arrive without its project), and before the destination commits, the source is looked at
again: rows or revisions that changed meanwhile were written by something still using it, and the move
is refused rather than leave them behind. Tables go in foreign-key order; then each table's rows are
counted on both sides, and on PostgreSQL each id sequence is set past the ids that came with the rows and
checked.

Imported by: llmgw/cli/init.py, llmgw/cli/storecmd.py. Imports llmgw.store.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from llmgw import store

MOVED = ".moved-to-postgresql"
BATCH = 1000
# What migrations put in a new store; a target holding only these is empty.
SEEDED = {"schema_migrations", "revisions", "orgs", "teams", "projects", "leases"}
# Who uses a store now, not what it holds: never copied (see the module's docstring).
NOT_COPIED = {"leases"}
HOLD = 60.0  # seconds the move's hold on the lease lasts unless renewed: a move killed half way frees it by then


class MoveRefused(Exception):
    """The move cannot be made; the message says what to do."""


def holds_data(engine: sa.engine.Engine) -> bool:
    """Whether ENGINE's store holds anything its migrations did not put there."""
    with engine.connect() as conn:
        for table in store.metadata.sorted_tables:
            if table.name in SEEDED:
                continue
            if conn.execute(sa.select(sa.func.count()).select_from(table)).scalar():
                return True
        return conn.execute(sa.select(sa.func.count()).select_from(store.projects)).scalar() > 1


def _serial(table: sa.Table) -> str | None:
    """The name of TABLE's key where the database numbers it (an integer key of its own), else None."""
    keys = list(table.primary_key.columns)
    if len(keys) == 1 and isinstance(keys[0].type, sa.Integer) and keys[0].autoincrement is True:
        return keys[0].name
    return None


def _count(conn, table: sa.Table) -> int:
    return conn.execute(sa.select(sa.func.count()).select_from(table)).scalar()


def _copied_tables() -> list[sa.Table]:
    return [t for t in store.metadata.sorted_tables if t.name not in NOT_COPIED]


class Hold:
    """The controllers' lease, held by the move: no controller leads the source while it is copied."""

    def __init__(self, engine: sa.engine.Engine):
        self.engine = engine
        self.owner = "move-" + os.urandom(6).hex()
        self.address = f"llmgw store move on {socket.gethostname()}"
        self.renewed = 0.0
        self._now = store.db_now(engine.dialect.name)

    def _set(self, where, values: dict) -> bool:
        table = store.leases
        with self.engine.begin() as conn:
            return conn.execute(table.update().where(table.c.name == "controller").where(where)
                                .values(**values)).rowcount == 1

    def take(self) -> bool:
        """Take the lease if no controller holds it (free, or expired); whether it was taken."""
        table = store.leases
        taken = self._set(sa.or_(table.c.owner == "", table.c.expires_at < self._now),
                          {"owner": self.owner, "address": self.address, "expires_at": self._now + HOLD})
        self.renewed = time.monotonic()
        return taken

    def keep(self) -> None:
        """Renew the hold when a quarter of it has passed (called as the copy goes on)."""
        if time.monotonic() - self.renewed >= HOLD / 4:
            self._set(store.leases.c.owner == self.owner, {"expires_at": self._now + HOLD})
            self.renewed = time.monotonic()

    def release(self) -> None:
        self._set(store.leases.c.owner == self.owner, {"owner": "", "address": "", "expires_at": 0.0})


def _state(conn) -> dict[str, int]:
    """What tells a later look at a store from this one: every copied table's rows, and each revision."""
    found = {table.name: _count(conn, table) for table in _copied_tables()}
    found.update({f"revision {name}": value for name, value in conn.execute(
        sa.select(store.revisions.c.name, store.revisions.c.value))})
    return found


def _opened(which: str, url: str) -> sa.engine.Engine:
    """The store at URL, migrated; MoveRefused where a newer llmgw migrated it: this code would leave behind
    what it does not know of, or write into a schema it does not know."""
    try:
        return store.open_store(url)
    except store.NewerSchema as e:
        raise MoveRefused(f"cannot open the {which} {store.describe(url)}: {e}") from None


def move(source_url: str, target_url: str, progress: Callable[[str, int], None] = lambda table, rows: None,
         force: bool = False) -> dict[str, int]:
    """Copy every row of the store at SOURCE_URL into the empty store at TARGET_URL; the rows copied, by table.
    PROGRESS(table, rows) is called as each table is copied. The source is left as it was. FORCE: go ahead
    although gateways marked the source as theirs (the operator knows they were killed, not running); a
    leading controller's lease still refuses, since it runs out on its own."""
    if store.describe(source_url) == store.describe(target_url):
        raise MoveRefused("the source and the destination are the same database")
    source = _opened("source", source_url)
    try:
        target = _opened("destination", target_url)
    except MoveRefused:
        source.dispose()
        raise
    hold = Hold(source)
    try:
        if not hold.take():
            with source.connect() as src:
                leader = [address for name, address in holders(src) if name == "controller"]
            _refuse_in_use(source_url, [("controller", leader[0] if leader else "one that leads now")])
        try:
            copied = _copy(source, target, source_url, target_url, hold, progress, force)
        finally:
            hold.release()
        _check(source, target, copied)
        return copied
    finally:
        source.dispose()
        target.dispose()


def _refuse_in_use(source_url: str, held: list[tuple[str, str]]) -> None:
    users = "; ".join(f"the leading controller ({address})" if name == "controller" else
                      f"a gateway on {name.split(' ', 1)[1]}" for name, address in held)
    raise MoveRefused(f"{store.describe(source_url)} is in use: {users}. Stop every controller and "
                      "gateway that uses it (systemctl stop llmgw-controller llmgw-gateway), then move: "
                      "what they wrote after the copy would be left behind. A gateway that was killed "
                      "rather than stopped keeps its mark until it starts and stops again; when you know "
                      "none runs, --force moves regardless")


def _copy(source: sa.engine.Engine, target: sa.engine.Engine, source_url: str, target_url: str, hold: Hold,
          progress: Callable[[str, int], None], force: bool) -> dict[str, int]:
    """The copy itself, with the source's lease held: the rows copied, by table."""
    if not force:
        with source.connect() as src:
            gateways = [(name, address) for name, address in holders(src) if name != "controller"]
        if gateways:
            _refuse_in_use(source_url, gateways)
    if holds_data(target):
        raise MoveRefused(f"{store.describe(target_url)} already holds keys, people or usage, so "
                          f"{store.describe(source_url)} was not moved there. Give an empty database")
    copied: dict[str, int] = {}
    with store.one_moment(source) as src, target.begin() as dst:
        before = _state(src)  # the first read: the moment the whole copy is read at
        for table in reversed(_copied_tables()):
            dst.execute(table.delete())  # the target's seeded rows, which the source's replace
        for table in _copied_tables():
            copied[table.name] = 0
            rows = src.execute(table.select()).mappings()
            while batch := [dict(row) for row in rows.fetchmany(BATCH)]:
                dst.execute(table.insert(), batch)
                copied[table.name] += len(batch)
                hold.keep()
            progress(table.name, copied[table.name])
        if target.dialect.name == "postgresql":
            for table in filter(_serial, _copied_tables()):
                # Rows came with their ids; the sequence must start after them or the next insert collides.
                key = _serial(table)
                dst.execute(sa.text(f"SELECT setval(pg_get_serial_sequence('{table.name}', '{key}'), "
                                    f"COALESCE(MAX({key}), 1), MAX({key}) IS NOT NULL) FROM {table.name}"))
        with source.connect() as now:
            after = _state(now)
        changed = sorted(name for name in before if before[name] != after[name])
        if changed:
            # Raised before the destination commits: it stays empty, and the move can be run again.
            raise MoveRefused(f"{store.describe(source_url)} changed while it was copied ({', '.join(changed)}): "
                              "something still writes to it (a controller, a gateway, an llmgw command), and "
                              "what it wrote would be left behind. Stop it, then move again; the destination "
                              "was left empty")
    return copied


def _check(source: sa.engine.Engine, target: sa.engine.Engine, copied: dict[str, int]) -> None:
    """Each table holds as many rows on both sides, and no id sequence would hand out an id that is taken."""
    with source.connect() as src, target.connect() as dst:
        for table in _copied_tables():
            there = _count(dst, table)
            if there != _count(src, table) or there != copied[table.name]:
                raise MoveRefused(f"table {table.name}: {copied[table.name]} rows copied but {there} found in the "
                                  "destination; empty it and move again")
            key = _serial(table)
            if target.dialect.name == "postgresql" and key and there:
                top = dst.execute(sa.select(sa.func.max(table.c[key]))).scalar()
                sequence = dst.execute(sa.text("SELECT pg_get_serial_sequence(:t, :k)"),
                                       {"t": table.name, "k": key}).scalar()
                next_id = dst.execute(sa.text("SELECT CASE WHEN is_called THEN last_value + 1 ELSE last_value END "
                                              f"FROM {sequence}")).scalar()
                if next_id <= top:
                    raise MoveRefused(f"table {table.name}: its id sequence would next give {next_id}, which is taken")


def move_sqlite_away(sqlite_url: str, target_url: str) -> int:
    """`llmgw init --postgres`: move the SQLite store at SQLITE_URL into TARGET_URL, then rename the SQLite
    file (and its -wal, -shm) with MOVED, so nothing keeps using it by mistake and nothing is lost if the
    move was a mistake. Returns the rows copied."""
    copied = sum(move(sqlite_url, target_url).values())
    source = store.open_engine(sqlite_url)
    try:
        with source.connect() as src:
            src.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        source.dispose()
    path = os.path.abspath(sqlite_url[len("sqlite:///"):])
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.rename(path + suffix, path + MOVED + suffix)
    return copied


def holders(conn: Connection) -> list[tuple[str, str]]:
    """(name, address) of each lease held now: a leading controller, running gateways."""
    now = store.db_now(conn.dialect.name)
    return [(r.name, r.address) for r in conn.execute(
        sa.select(store.leases.c.name, store.leases.c.address).where(store.leases.c.owner != "")
        .where(store.leases.c.expires_at >= now)
        .order_by(store.leases.c.name))]
