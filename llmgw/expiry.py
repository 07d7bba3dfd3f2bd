"""What a project keeps for a time (conversations, agents' notes): the hours each keeps it, and the sweep.

Both tables hold a row per thing with its `scope` (the project) and `expires_at` (when it was last
written plus the project's window then, lowered when the window shrinks: llmgw/people/keeping.py), so
`expires_at` alone says what expired, by an index on (scope, expires_at).
"""

from __future__ import annotations

from typing import Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import store


def retention(conn: Connection, column: sa.Column) -> dict[str, float]:
    """Hours each project keeps what COLUMN (of `projects`) is the window of, for the projects that keep it."""
    p = store.projects
    return dict(conn.execute(sa.select(p.c.id, column).where(column.is_not(None))).all())


def sweep(engine: Engine, table: sa.Table, key: sa.Column, retention: dict[str, float], now: float, batch: int,
          then: Callable[[Connection, str, list], None] | None = None) -> int:
    """Delete TABLE's rows past their expiry, and every row of a project not in RETENTION (it stopped keeping
    them), BATCH rows (by KEY) a transaction, so writes meanwhile wait for one batch, not the sweep. Whether
    a row expired is asked again as it is deleted: one written meanwhile stays. THEN(conn, scope, keys)
    deletes what hangs off the rows deleted, in their transaction. Returns how many rows went."""
    with engine.connect() as conn:
        scopes = conn.execute(sa.select(table.c.scope).distinct()).scalars().all()
    gone = 0
    for scope in scopes:
        expired = sa.true() if scope not in retention else table.c.expires_at < now
        while True:
            with store.writing(engine) as conn:
                found = conn.execute(sa.select(key).where(table.c.scope == scope, expired).limit(batch)).scalars().all()
                if found:
                    deleted = list(conn.execute(table.delete().where(table.c.scope == scope, key.in_(found), expired)
                                                .returning(key)).scalars())
                    if then is not None:
                        then(conn, scope, deleted)
                    gone += len(deleted)
            if len(found) < batch:
                break
    return gone
