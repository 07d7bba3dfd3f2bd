"""Agents' notes: what a coding agent keeps for itself across conversations, per project, searchable.

Kept only for a project that asked (`llmgw keys memory --project P --retain-hours N`, which sets
`projects.memory_hours`), for that many hours after a note was last written, and scoped as
conversations are (llmgw/conversations.py): every lookup is by the project and the note's id together,
so another project's note is not found, as one never written. The gateway serves them as `/v1/memory`
and as MCP tools (llmgw/gateway/notes.py); the controller's sweep deletes what expired.

Search is the database's own full text: FTS5 on SQLite, a tsvector of the `simple` configuration on
PostgreSQL (no stemming and no stop words, so a search finds the words as they were written, in any
language). A query is read as words, any of which may match, best matches first: the query languages of
both would otherwise let a client's quotes or operators fail the statement.
"""

from __future__ import annotations

import os
import re
import time
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import store

HOUR = 3600.0
TEXT_MOST = 16_000  # characters of a note
NOTES_MOST = 10_000  # notes a project keeps at once
LIST_MOST = 100  # notes one listing or search returns
QUERY_MOST = 500  # characters of a search
WORDS_MOST = 20  # words of a search used
NOTE_ID = re.compile(r"note_[0-9a-f]{24}")
_WORD = re.compile(r"\w+")
SWEEP_BATCH = 1000


class Note(NamedTuple):
    id: str
    text: str
    created_at: float
    updated_at: float


class TooMany(Exception):
    """The project keeps NOTES_MOST notes already."""


def new_id() -> str:
    return "note_" + os.urandom(12).hex()


def _live(hours: float, now: float):
    """A note is live while it was written within the project's retention, as it is now and as it was then."""
    n = store.notes
    return sa.and_(n.c.updated_at >= now - hours * HOUR, n.c.expires_at >= now)


def add(engine: Engine, scope: str, text: str, hours: float, now: float | None = None) -> Note:
    """A new note of TEXT in SCOPE; raises TooMany where the project keeps as many as it may."""
    now = time.time() if now is None else now
    n = store.notes
    with store.writing(engine) as conn:
        held = conn.execute(sa.select(sa.func.count()).where(n.c.scope == scope, _live(hours, now))).scalar()
        if held >= NOTES_MOST:
            raise TooMany
        note = Note(new_id(), text, now, now)
        conn.execute(n.insert().values(scope=scope, id=note.id, text=text, created_at=now, updated_at=now,
                                       expires_at=now + hours * HOUR))
    return note


def get(engine: Engine, scope: str, note_id: str, hours: float, now: float | None = None) -> Note | None:
    now = time.time() if now is None else now
    n = store.notes
    with engine.connect() as conn:
        row = conn.execute(sa.select(n.c.id, n.c.text, n.c.created_at, n.c.updated_at)
                           .where(n.c.scope == scope, n.c.id == note_id, _live(hours, now))).first()
    return Note(*row) if row is not None else None


def update(engine: Engine, scope: str, note_id: str, text: str, hours: float, now: float | None = None) -> Note | None:
    """The note NOTE_ID with its text replaced by TEXT (its retention starts again); None where SCOPE has
    no such note, or it expired."""
    now = time.time() if now is None else now
    n = store.notes
    with store.writing(engine) as conn:
        created = conn.execute(n.update().where(n.c.scope == scope, n.c.id == note_id, _live(hours, now))
                               .values(text=text, updated_at=now, expires_at=now + hours * HOUR)
                               .returning(n.c.created_at)).scalar()
    return Note(note_id, text, created, now) if created is not None else None


def delete(engine: Engine, scope: str, note_id: str, hours: float, now: float | None = None) -> bool:
    """Delete SCOPE's note NOTE_ID now; whether it was there to delete (an expired one is deleted, and reads
    as never there)."""
    now = time.time() if now is None else now
    n = store.notes
    with store.writing(engine) as conn:
        live = conn.execute(sa.select(n.c.num).where(n.c.scope == scope, n.c.id == note_id, _live(hours, now))).first()
        conn.execute(n.delete().where(n.c.scope == scope, n.c.id == note_id))
    return live is not None


def listing(engine: Engine, scope: str, hours: float, limit: int, now: float | None = None) -> list[Note]:
    """SCOPE's live notes, the last written first."""
    now = time.time() if now is None else now
    n = store.notes
    with engine.connect() as conn:
        rows = conn.execute(sa.select(n.c.id, n.c.text, n.c.created_at, n.c.updated_at)
                            .where(n.c.scope == scope, _live(hours, now))
                            .order_by(n.c.updated_at.desc(), n.c.num.desc()).limit(limit)).all()
    return [Note(*r) for r in rows]


def words(query: str) -> list[str]:
    """The words of QUERY a search looks for: letters and digits, lowered, each once, at most WORDS_MOST."""
    seen: dict[str, None] = {}
    for word in _WORD.findall(query.lower()):
        seen.setdefault(word, None)
    return list(seen)[:WORDS_MOST]


def search(engine: Engine, scope: str, query: str, hours: float, limit: int, now: float | None = None) -> list[Note]:
    """SCOPE's live notes holding any word of QUERY, the best matches first."""
    now = time.time() if now is None else now
    found = words(query)
    if not found:
        return []
    columns = "n.id, n.text, n.created_at, n.updated_at"
    params = {"scope": scope, "since": now - hours * HOUR, "now": now, "limit": limit}
    if engine.dialect.name == "sqlite":
        # Each word quoted, so nothing in it is FTS5's syntax; OR: any word may match, bm25 ranks.
        params["q"] = " OR ".join('"' + w.replace('"', '""') + '"' for w in found)
        sql = (f"SELECT {columns} FROM notes_fts JOIN notes n ON n.num = notes_fts.rowid "
               "WHERE notes_fts MATCH :q AND n.scope = :scope AND n.updated_at >= :since AND n.expires_at >= :now "
               "ORDER BY notes_fts.rank, n.num DESC LIMIT :limit")
    else:
        # The words as tsquery lexemes, each quoted for to_tsquery, joined by | (any may match).
        params["q"] = " | ".join("'" + w.replace("'", "''").replace("\\", "\\\\") + "'" for w in found)
        sql = (f"SELECT {columns} FROM notes n, to_tsquery('simple', :q) q "
               "WHERE n.scope = :scope AND n.updated_at >= :since AND n.expires_at >= :now AND n.search @@ q "
               "ORDER BY ts_rank(n.search, q) DESC, n.num DESC LIMIT :limit")
    with engine.connect() as conn:
        rows = conn.execute(sa.text(sql), params).all()
    return [Note(*r) for r in rows]


def sweep(engine: Engine, retention: dict[str, float], now: float | None = None) -> int:
    """Delete every note past its project's retention (RETENTION: hours by project), and every note of a
    project not in RETENTION; returns how many went. A batch a transaction, as the conversations' sweep."""
    now = time.time() if now is None else now
    n = store.notes
    with engine.connect() as conn:
        scopes = conn.execute(sa.select(n.c.scope).distinct()).scalars().all()
    gone = 0
    for scope in scopes:
        hours = retention.get(scope)
        expired = sa.true() if hours is None else sa.not_(_live(hours, now))
        while True:
            with store.writing(engine) as conn:
                nums = conn.execute(sa.select(n.c.num).where(n.c.scope == scope, expired).limit(SWEEP_BATCH)).scalars().all()
                if nums:
                    # Asked again as it is deleted: a note written meanwhile stays.
                    gone += conn.execute(n.delete().where(n.c.num.in_(nums), expired)).rowcount
            if len(nums) < SWEEP_BATCH:
                break
    return gone


def retention(conn: Connection) -> dict[str, float]:
    """Hours each project keeps its notes, for the projects that keep them."""
    p = store.projects
    return dict(conn.execute(sa.select(p.c.id, p.c.memory_hours).where(p.c.memory_hours.is_not(None))).all())
