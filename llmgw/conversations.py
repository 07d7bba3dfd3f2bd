"""Kept conversations: a project's threads and their turns in the store, read and written by gateway workers
and swept by the controller.

Nothing is kept unless the project asked (`llmgw keys threads --project P --retain-hours N`, which sets
`projects.threads_hours`); a gateway refuses a thread for any other project before it comes here. Every
lookup is by (scope, id), the scope being the project of the key that asks: another project's thread is
not found, with the same query and the same answer as an id nobody used. A thread is live while its last
turn is within its project's retention, both as it is now and as it was when the turn was written
(`expires_at`): a window lengthened later does not bring back what had expired. Past it the thread reads
as gone, to a read and to a delete alike, before the hourly sweep deletes it; a turn added to it starts it
afresh.

A turn is what one request added: the client's new messages (its system messages kept apart, on the
thread) and the answer, as chat-completions messages, whatever API the client spoke; so a thread begun in
one API or on one model continues in another. These functions run in a gateway worker's store thread
(SQLite) or on its loop (PostgreSQL, made cooperative by llmgw/gateway/greendb.py).

Deleting takes the thread's row first, then its turns: on PostgreSQL an append holds that row from its
first statement, so a delete or a sweep waits for it and then takes its turn too, and no turn is left
without its thread (one was, when turns went first).
"""

from __future__ import annotations

import json
import re
import time
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import expiry, store

HOUR = 3600.0
# A client's thread id: what it may send in `x-llmgw-thread`. Ids the gateway makes for a Responses chain
# start with "@", which a client's cannot, so the two never meet.
THREAD_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
CHAIN = "@"
# The most turns a request reads back, newest first; older ones are left out as if they did not fit.
TURNS_MOST = 1000
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
    """A live thread as read: the system messages it keeps (None: none), its newest turns oldest first,
    and how many older ones were left out of the read (past TURNS_MOST or its byte budget)."""

    system: list | None
    turns: list[Turn]
    left_out: int = 0


def text(value) -> str:
    """VALUE as the JSON text the store keeps. A lone surrogate, which JSON allows and a client may send,
    cannot be encoded for the database: it is kept as the `\\uXXXX` escape it came as (json.dumps writes
    characters only inside strings, where that escape is valid), so it reads back as it was."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "backslashreplace").decode("utf-8")


def _live(t, hours: float, now: float):
    return sa.and_(t.c.last_at >= now - hours * HOUR, t.c.expires_at >= now)


def read(engine: Engine, scope: str, thread_id: str, hours: float, now: float | None = None,
         upto: int | None = None, most_bytes: int | None = None) -> History | None:
    """SCOPE's thread THREAD_ID where it is live; None otherwise (never made, another project's, deleted,
    or expired). UPTO: only the turns up to that one (a Responses chain continued from an earlier
    response). MOST_BYTES: the newest turns whose messages fit in that many bytes, the rest left out, as
    at most TURNS_MOST are read. One query: it is on the request path."""
    now = time.time() if now is None else now
    t, turns = store.threads, store.thread_turns
    on = sa.and_(turns.c.scope == t.c.scope, turns.c.thread_id == t.c.id)
    if upto is not None:
        on = sa.and_(on, turns.c.seq <= upto)
    query = (sa.select(t.c.system, t.c.last_seq, turns.c.seq, turns.c.messages, turns.c.tokens)
             .select_from(t.outerjoin(turns, on))
             .where(t.c.scope == scope, t.c.id == thread_id, _live(t, hours, now))
             .order_by(turns.c.seq.desc()).limit(TURNS_MOST))
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    if not rows:
        return None
    system = rows[0].system
    kept: list[Turn] = []
    budget = most_bytes if most_bytes is not None else float("inf")
    for row in rows:
        if row.seq is None:
            break
        budget -= len(row.messages)
        if budget < 0:
            break
        kept.append(Turn(row.seq, json.loads(row.messages), row.tokens))
    found = sum(1 for row in rows if row.seq is not None)
    if found == TURNS_MOST:  # there may be more than were read: count them (a thread of a thousand turns)
        with engine.connect() as conn:
            count = sa.select(sa.func.count()).where(turns.c.scope == scope, turns.c.thread_id == thread_id)
            found = conn.execute(count.where(turns.c.seq <= upto) if upto is not None else count).scalar()
    return History(json.loads(system) if system else None, kept[::-1], found - len(kept))


def append(engine: Engine, scope: str, thread_id: str, hours: float, system: list | None, messages: list,
           tokens: int, response_id: str | None = None, response: str | None = None, after: int | None = None,
           fork: str | None = None, now: float | None = None) -> tuple[str, int]:
    """Add a turn of MESSAGES (about TOKENS tokens) to SCOPE's thread THREAD_ID, making the thread where it
    is missing and starting it afresh where it expired (older than HOURS); SYSTEM, where given, becomes the
    thread's system messages. RESPONSE_ID and RESPONSE: the Responses API's id and object for the turn.
    AFTER: the turn it follows (a Responses request continues from one); where the thread has gone on since,
    the turns up to AFTER are copied into a new thread FORK, and the turn added there.
    Returns the thread and the turn's place in it.

    A live thread takes its turn in two statements, one that moves its last turn's place (and with it
    holds the thread's row, so that two turns of one thread take places in turn) and the turn's insert."""
    now = time.time() if now is None else now
    for attempt in range(APPEND_TRIES):
        try:
            with store.writing(engine) as conn:
                if after is not None and fork is not None:
                    thread_id = _branch(conn, scope, thread_id, after, fork, hours, now)
                seq = _next_place(conn, scope, thread_id, hours, system, now)
                conn.execute(store.thread_turns.insert().values(
                    scope=scope, thread_id=thread_id, seq=seq, at=now, messages=text(messages), tokens=tokens,
                    response_id=response_id, response=response))
            return thread_id, seq
        except sa.exc.IntegrityError:
            # Two first turns of one thread at once (PostgreSQL): the one that lost finds the thread made.
            if attempt == APPEND_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _next_place(conn: Connection, scope: str, thread_id: str, hours: float, system: list | None, now: float) -> int:
    """The place a new turn of the thread takes, the thread made (or made afresh, where it expired) first."""
    t = store.threads
    changes: dict = {"last_at": sa.func.max(t.c.last_at, now) if conn.dialect.name == "sqlite"
                     else sa.func.greatest(t.c.last_at, now), "last_seq": t.c.last_seq + 1,
                     "expires_at": now + hours * HOUR}
    if system:
        changes["system"] = text(system)
    seq = conn.execute(t.update().where(t.c.scope == scope, t.c.id == thread_id, _live(t, hours, now))
                       .values(**changes).returning(t.c.last_seq)).scalar()
    if seq is not None:
        return seq
    _delete(conn, scope, [thread_id])  # expired, where it was there at all: it starts afresh
    conn.execute(t.insert().values(scope=scope, id=thread_id, created_at=now, last_at=now, last_seq=1,
                                   expires_at=now + hours * HOUR, system=text(system) if system else None))
    return 1


def _branch(conn: Connection, scope: str, thread_id: str, after: int, fork: str, hours: float, now: float) -> str:
    """The thread a turn after turn AFTER of THREAD_ID goes in: that thread where AFTER is its last turn,
    else a new thread FORK holding its system messages and copies of its turns up to AFTER, each naming
    the turn it is a copy of (its response id stays with the original: an id names one response)."""
    t, turns = store.threads, store.thread_turns
    head = conn.execute(sa.select(t.c.system, t.c.last_seq).where(t.c.scope == scope, t.c.id == thread_id)
                        .with_for_update()).first()
    if head is None or head.last_seq == after:
        return thread_id
    conn.execute(t.insert().values(scope=scope, id=fork, created_at=now, last_at=now, last_seq=after,
                                   expires_at=now + hours * HOUR, system=head.system))
    conn.execute(turns.insert().from_select(
        ["scope", "thread_id", "seq", "at", "messages", "tokens", "origin_thread", "origin_seq"],
        sa.select(turns.c.scope, sa.literal(fork), turns.c.seq, turns.c.at, turns.c.messages, turns.c.tokens,
                  sa.func.coalesce(turns.c.origin_thread, turns.c.thread_id),
                  sa.func.coalesce(turns.c.origin_seq, turns.c.seq))
        .where(turns.c.scope == scope, turns.c.thread_id == thread_id, turns.c.seq <= after)))
    return fork


class Stored(NamedTuple):
    """A Responses API turn as found by its response id: its thread, its place, and the response object."""

    thread_id: str
    seq: int
    response: str | None


def find_response(engine: Engine, scope: str, response_id: str, hours: float,
                  now: float | None = None) -> Stored | None:
    """SCOPE's turn whose response is RESPONSE_ID, where its thread is live."""
    now = time.time() if now is None else now
    t, turns = store.threads, store.thread_turns
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(turns.c.thread_id, turns.c.seq, turns.c.response)
            .join(t, sa.and_(t.c.scope == turns.c.scope, t.c.id == turns.c.thread_id))
            .where(turns.c.scope == scope, turns.c.response_id == response_id, _live(t, hours, now))).first()
    return Stored(row.thread_id, row.seq, row.response) if row is not None else None


def delete_response(engine: Engine, scope: str, response_id: str, hours: float, now: float | None = None) -> bool:
    """Delete SCOPE's turn whose response is RESPONSE_ID, its copies in branches, and its thread where no
    turn is left; whether it was there to delete (an expired one is deleted, and reads as never there).
    The turns after it stay, without it in their history."""
    now = time.time() if now is None else now
    t, turns = store.threads, store.thread_turns
    with store.writing(engine) as conn:
        row = conn.execute(sa.select(turns.c.thread_id, turns.c.seq).where(
            turns.c.scope == scope, turns.c.response_id == response_id)).first()
        if row is None:
            return False
        live = conn.execute(sa.select(t.c.id).where(t.c.scope == scope, t.c.id == row.thread_id,
                                                    _live(t, hours, now)).with_for_update()).first() is not None
        conn.execute(turns.delete().where(turns.c.scope == scope, sa.or_(
            sa.and_(turns.c.thread_id == row.thread_id, turns.c.seq == row.seq),
            sa.and_(turns.c.origin_thread == row.thread_id, turns.c.origin_seq == row.seq))))
        left = conn.execute(sa.select(turns.c.seq).where(turns.c.scope == scope,
                                                         turns.c.thread_id == row.thread_id).limit(1)).first()
        if left is None:
            _delete(conn, scope, [row.thread_id])
    return live


def delete(engine: Engine, scope: str, thread_id: str, hours: float, now: float | None = None) -> bool:
    """Delete SCOPE's thread THREAD_ID, its turns and their copies in branches now; whether it was there to
    delete (an expired one is deleted, and reads as never there)."""
    now = time.time() if now is None else now
    t = store.threads
    with store.writing(engine) as conn:
        live = conn.execute(sa.select(t.c.id).where(t.c.scope == scope, t.c.id == thread_id, _live(t, hours, now))
                            .with_for_update()).first() is not None
        _delete(conn, scope, [thread_id], copies=True)
    return live


def _delete(conn: Connection, scope: str, ids: list[str], copies: bool = False) -> list[str]:
    """Delete SCOPE's threads IDS (the rows first: see the top of the module) and their turns, and with COPIES
    the copies of their turns in other threads; returns the ids that were there."""
    t, turns = store.threads, store.thread_turns
    gone = list(conn.execute(t.delete().where(t.c.scope == scope, t.c.id.in_(ids)).returning(t.c.id)).scalars())
    conn.execute(turns.delete().where(turns.c.scope == scope, turns.c.thread_id.in_(ids)))
    if copies:
        conn.execute(turns.delete().where(turns.c.scope == scope, turns.c.origin_thread.in_(ids)))
    return gone


def sweep(engine: Engine, retention: dict[str, float], now: float | None = None) -> int:
    """Delete every thread past its project's retention (RETENTION: hours by project), and every thread of a
    project not in RETENTION (its threads were turned off), with their turns; returns how many threads went
    (llmgw/expiry.py). Its row goes first: a turn racing the sweep waits for it (see the top)."""
    now = time.time() if now is None else now
    t, turns = store.threads, store.thread_turns

    def their_turns(conn: Connection, scope: str, ids: list) -> None:
        conn.execute(turns.delete().where(turns.c.scope == scope, turns.c.thread_id.in_(ids)))

    return expiry.sweep(engine, t, t.c.id, retention, now, SWEEP_BATCH, their_turns)


def retention(conn: Connection) -> dict[str, float]:
    """Hours each project keeps its threads, for the projects that keep them."""
    return expiry.retention(conn, store.projects.c.threads_hours)
