"""Moving a SQLite store into PostgreSQL (`llmgw init --postgres DSN`), every row of every table, in one transaction.

The target must hold nothing but what its migrations seed (the default project, the revision counters):
moving into a store that already serves a cluster would mix two clusters' keys and people. Afterwards the
SQLite file is renamed, not removed, so nothing keeps using it by mistake and nothing is lost if the move
was a mistake.

Imported by: llmgw/cli/init.py. Imports llmgw.store.
"""

from __future__ import annotations

import os

import sqlalchemy as sa

from llmgw import store

MOVED = ".moved-to-postgresql"
BATCH = 1000
# What migrations put in a new store; a target holding only these is empty.
SEEDED = {"schema_migrations", "revisions", "orgs", "teams", "projects"}


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


def move(sqlite_url: str, target_url: str) -> int:
    """Copy every row of the SQLite store at SQLITE_URL into the empty store at TARGET_URL, then rename the
    SQLite file (and its -wal, -shm) with MOVED. Returns the rows copied."""
    source = store.open_store(sqlite_url)
    target = store.open_store(target_url)
    try:
        if holds_data(target):
            raise MoveRefused(f"{store.describe(target_url)} already holds keys, people or usage, so the SQLite "
                              f"store {store.describe(sqlite_url)} was not moved there. Give an empty database, or "
                              "rename the SQLite file away to keep the PostgreSQL store as it is")
        copied = 0
        with source.connect() as src, target.begin() as dst:
            for table in reversed(store.metadata.sorted_tables):
                dst.execute(table.delete())  # the target's seeded rows, which the source's replace
            for table in store.metadata.sorted_tables:
                rows = src.execute(table.select()).mappings()
                while batch := [dict(row) for row in rows.fetchmany(BATCH)]:
                    dst.execute(table.insert(), batch)
                    copied += len(batch)
            for table in store.metadata.sorted_tables:
                if "id" in table.c and isinstance(table.c.id.type, sa.Integer) and table.c.id.autoincrement is True:
                    # Rows came with their ids; the sequence must start after them or the next insert collides.
                    dst.execute(sa.text(f"SELECT setval(pg_get_serial_sequence('{table.name}', 'id'), "
                                        f"COALESCE(MAX(id), 1), MAX(id) IS NOT NULL) FROM {table.name}"))
        with source.connect() as src:
            src.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        source.dispose()
        target.dispose()
    path = os.path.abspath(sqlite_url[len("sqlite:///"):])
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.rename(path + suffix, path + MOVED + suffix)
    return copied
