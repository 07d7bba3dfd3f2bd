"""Kept conversations: a project's threads and their turns in the store, read and written by gateway workers
and swept by the controller.

Nothing is kept unless the project asked (`llmgw keys threads --project P --retain-hours N`, which sets
`projects.threads_hours`); a gateway refuses a thread for any other project before it comes here. Every
lookup is by (scope, id), the scope being the project of the key that asks: another project's thread is
not found, with the same query and the same answer as an id nobody used. A thread whose last turn is older
than its project's retention is treated as gone before the hourly sweep deletes it, and a turn added to
such a thread starts it afresh rather than bringing its old turns back.

A turn is what one request added: the client's new messages (its system messages kept apart, on the
thread) and the answer, as chat-completions messages, whatever API the client spoke; so a thread begun in
one API or on one model continues in another. These functions run in a gateway worker's store thread
(SQLite) or on its loop (PostgreSQL, made cooperative by llmgw/gateway/greendb.py).
"""

from __future__ import annotations

import json
import re
import time
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import store

HOUR = 3600.0
# A client's thread id: what it may send in `x-llmgw-thread`. Ids the gateway makes for a Responses chain
# start with "@", which a client's cannot, so the two never meet.
THREAD_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
CHAIN = "@"
# Threads the sweep deletes in one transaction: a short write lock at a time, so usage rows and turns
# written meanwhile wait milliseconds, not the whole sweep.
SWEEP_BATCH = 500
# Appending retries this many times when another request on the same thread took the next place first.
APPEND_TRIES = 5


class Turn(NamedTuple):
    seq: int
    messages: list
    tokens: int


class History(NamedTuple):
    """A live thread as read: the system messages it keeps (None: none), its turns oldest first."""

    system: list | None
    turns: list[Turn]


def read(engine: Engine, scope: str, thread_id: str, hours: float, now: float | None = None,
         upto: int | None = None) -> History | None:
    """SCOPE's thread THREAD_ID, if it has a turn within the last HOURS; None otherwise (never made, another
    project's, deleted, or expired). UPTO: only the turns up to that one (a Responses chain continued from
    an earlier response)."""
    now = time.time() if now is None else now
    t, turns = store.threads, store.thread_turns
    with engine.connect() as conn:
        head = conn.execute(sa.select(t.c.system, t.c.last_at).where(t.c.scope == scope, t.c.id == thread_id)).first()
        if head is None or head.last_at < now - hours * HOUR:
            return None
        query = (sa.select(turns.c.seq, turns.c.messages, turns.c.tokens)
                 .where(turns.c.scope == scope, turns.c.thread_id == thread_id).order_by(turns.c.seq))
        if upto is not None:
            query = query.where(turns.c.seq <= upto)
        rows = conn.execute(query).all()
    return History(json.loads(head.system) if head.system else None,
                   [Turn(r.seq, json.loads(r.messages), r.tokens) for r in rows])


def append(engine: Engine, scope: str, thread_id: str, hours: float, system: list | None, messages: list,
           tokens: int, response_id: str | None = None, response: str | None = None, after: int | None = None,
           fork: str | None = None, now: float | None = None) -> tuple[str, int]:
    """Add a turn of MESSAGES (about TOKENS tokens) to SCOPE's thread THREAD_ID, making the thread where it
    is missing and starting it afresh where it expired (older than HOURS); SYSTEM, where given, becomes the
    thread's system messages. RESPONSE_ID and RESPONSE: the Responses API's id and object for the turn.
    AFTER: the turn it follows (a Responses request continues from one); where the thread has gone on since,
    the turns up to AFTER are copied into a new thread FORK, and the turn added there.
    Returns the thread and the turn's place in it."""
    now = time.time() if now is None else now
    t, turns = store.threads, store.thread_turns
    for attempt in range(APPEND_TRIES):
        try:
            with store.writing(engine) as conn:
                head = conn.execute(sa.select(t.c.last_at).where(t.c.scope == scope, t.c.id == thread_id)
                                    .with_for_update()).first()
                if head is not None and head.last_at < now - hours * HOUR:
                    _delete(conn, scope, [thread_id])
                    head = None
                if after is not None and head is not None and fork is not None and _last(conn, scope, thread_id) != after:
                    _copy(conn, scope, thread_id, after, fork, now)
                    thread_id = fork
                if head is None:
                    conn.execute(t.insert().values(scope=scope, id=thread_id, created_at=now, last_at=now,
                                                   system=json.dumps(system) if system else None))
                else:
                    changes: dict = {"last_at": max(now, head.last_at)}
                    if system:
                        changes["system"] = json.dumps(system)
                    conn.execute(t.update().where(t.c.scope == scope, t.c.id == thread_id).values(**changes))
                seq = _last(conn, scope, thread_id) + 1
                conn.execute(turns.insert().values(scope=scope, thread_id=thread_id, seq=seq, at=now,
                                                   messages=json.dumps(messages, ensure_ascii=False), tokens=tokens,
                                                   response_id=response_id, response=response))
            return thread_id, seq
        except sa.exc.IntegrityError:
            # Two turns of one thread at once (PostgreSQL: each read the same last place, or both made the
            # thread): the one that lost takes the next place.
            if attempt == APPEND_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _last(conn: Connection, scope: str, thread_id: str) -> int:
    """The place of the thread's last turn (0: none)."""
    turns = store.thread_turns
    return conn.execute(sa.select(sa.func.max(turns.c.seq))
                        .where(turns.c.scope == scope, turns.c.thread_id == thread_id)).scalar() or 0


def _copy(conn: Connection, scope: str, thread_id: str, upto: int, into: str, now: float) -> None:
    """A new thread INTO holding THREAD_ID's system messages and its turns up to UPTO (their response ids
    stay with the originals: an id names one response)."""
    t, turns = store.threads, store.thread_turns
    system = conn.execute(sa.select(t.c.system).where(t.c.scope == scope, t.c.id == thread_id)).scalar()
    conn.execute(t.insert().values(scope=scope, id=into, created_at=now, last_at=now, system=system))
    conn.execute(turns.insert().from_select(
        ["scope", "thread_id", "seq", "at", "messages", "tokens"],
        sa.select(turns.c.scope, sa.literal(into), turns.c.seq, turns.c.at, turns.c.messages, turns.c.tokens)
        .where(turns.c.scope == scope, turns.c.thread_id == thread_id, turns.c.seq <= upto)))


class Stored(NamedTuple):
    """A Responses API turn as found by its response id: its thread, its place, and the response object."""

    thread_id: str
    seq: int
    response: str | None


def find_response(engine: Engine, scope: str, response_id: str, hours: float,
                  now: float | None = None) -> Stored | None:
    """SCOPE's turn whose response is RESPONSE_ID, if its thread is within its retention of HOURS."""
    now = time.time() if now is None else now
    t, turns = store.threads, store.thread_turns
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(turns.c.thread_id, turns.c.seq, turns.c.response)
            .join(t, sa.and_(t.c.scope == turns.c.scope, t.c.id == turns.c.thread_id))
            .where(turns.c.scope == scope, turns.c.response_id == response_id,
                   t.c.last_at >= now - hours * HOUR)).first()
    return Stored(row.thread_id, row.seq, row.response) if row is not None else None


def delete_response(engine: Engine, scope: str, response_id: str) -> bool:
    """Delete SCOPE's turn whose response is RESPONSE_ID (its messages with it); whether there was one. The
    turns after it stay, without it in their history."""
    turns = store.thread_turns
    with store.writing(engine) as conn:
        return conn.execute(turns.delete().where(turns.c.scope == scope,
                                                 turns.c.response_id == response_id)).rowcount > 0


def delete(engine: Engine, scope: str, thread_id: str) -> bool:
    """Delete SCOPE's thread THREAD_ID and its turns now; whether there was one."""
    with store.writing(engine) as conn:
        return _delete(conn, scope, [thread_id]) > 0


def _delete(conn: Connection, scope: str, ids: list[str]) -> int:
    t, turns = store.threads, store.thread_turns
    conn.execute(turns.delete().where(turns.c.scope == scope, turns.c.thread_id.in_(ids)))
    return conn.execute(t.delete().where(t.c.scope == scope, t.c.id.in_(ids))).rowcount


def sweep(engine: Engine, retention: dict[str, float], now: float | None = None) -> int:
    """Delete every thread past its project's retention (RETENTION: hours by project), and every thread of a
    project not in RETENTION (its threads were turned off); returns how many threads went."""
    now = time.time() if now is None else now
    t = store.threads
    with engine.connect() as conn:
        scopes = conn.execute(sa.select(t.c.scope).distinct()).scalars().all()
    gone = 0
    for scope in scopes:
        hours = retention.get(scope)
        query = sa.select(t.c.id).where(t.c.scope == scope).limit(SWEEP_BATCH)
        if hours is not None:
            query = query.where(t.c.last_at < now - hours * HOUR)
        while True:
            with store.writing(engine) as conn:
                ids = conn.execute(query).scalars().all()
                if ids:
                    gone += _delete(conn, scope, ids)
            if len(ids) < SWEEP_BATCH:
                break
    return gone


def retention(conn: Connection) -> dict[str, float]:
    """Hours each project keeps its threads, for the projects that keep them."""
    p = store.projects
    return dict(conn.execute(sa.select(p.c.id, p.c.threads_hours).where(p.c.threads_hours.is_not(None))).all())
