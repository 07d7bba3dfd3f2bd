"""Agents' notes: what a coding agent keeps for itself across conversations, per project, searchable.

Kept only for a project that asked (`llmgw keys memory --project P --retain-hours N`, which sets
`projects.memory_hours`), for that many hours after a note was last written, and scoped as
conversations are (llmgw/conversations.py): every lookup is by the project and the note's id together,
so another project's note is not found, as one never written. The gateway serves them as `/v1/memory`
and as MCP tools (llmgw/gateway/notes.py); the controller's sweep deletes what expired.

Search is the database's own full-text index: FTS5 on SQLite, a tsvector on PostgreSQL. Both index the
note's words as llmgw reads them (`tokens`: letters, digits, `_` and combining marks, lowered; anything
else separates), kept beside the text, so both stores find the same words in any script, where their own
parsers disagree (PostgreSQL's keeps "deploy/ansible" one word). A query is read as words the same way,
any of which may match, and neither store's query language is a client's to use. Matches are ordered by
how many of the query's words each holds, then the last written first: computed per note, never from the
whole index, whose statistics (FTS5's bm25) would tell one project how often a word occurs in another's.
"""

from __future__ import annotations

import os
import re
import time
import unicodedata
from typing import NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import expiry, store

HOUR = 3600.0
TEXT_MOST = 16_000  # characters of a note
NOTES_MOST = 10_000  # notes a project keeps at once
LIST_MOST = 100  # notes one listing or search returns
QUERY_MOST = 500  # characters of a search
WORDS_MOST = 20  # words of a search used
NOTE_ID = re.compile(r"note_[0-9a-f]{24}")
SWEEP_BATCH = 1000
MATCHES_MOST = 1000  # matching notes ordered for one search; past that, the last written


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
        conn.execute(n.insert().values(scope=scope, id=note.id, text=text, words=" ".join(tokens(text)),
                                       created_at=now, updated_at=now, expires_at=now + hours * HOUR))
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
                               .values(text=text, words=" ".join(tokens(text)), updated_at=now,
                                       expires_at=now + hours * HOUR)
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


def _word_character(c: str) -> bool:
    return c.isalnum() or c == "_" or unicodedata.category(c) in ("Mn", "Mc")


def tokens(text: str) -> list[str]:
    """TEXT's words: runs of letters, digits, `_` and combining marks (a vowel sign is part of its word),
    lowered."""
    found, word = [], []
    for c in text.lower():
        if _word_character(c):
            word.append(c)
        elif word:
            found.append("".join(word))
            word = []
    if word:
        found.append("".join(word))
    return found


def words(query: str) -> list[str]:
    """The words of QUERY a search looks for: its tokens, each once, at most WORDS_MOST."""
    return list(dict.fromkeys(tokens(query)))[:WORDS_MOST]


def search(engine: Engine, scope: str, query: str, hours: float, limit: int, now: float | None = None) -> list[Note]:
    """SCOPE's live notes holding any word of QUERY, those holding more of them first, then the last written."""
    now = time.time() if now is None else now
    found = words(query)
    if not found:
        return []
    params = {"scope": scope, "since": now - hours * HOUR, "now": now, "most": MATCHES_MOST}
    columns = "n.id, n.text, n.created_at, n.updated_at, n.words"
    live = "n.scope = :scope AND n.updated_at >= :since AND n.expires_at >= :now"
    if engine.dialect.name == "sqlite":
        # Each word quoted, so nothing in it is FTS5's syntax; OR: any word may match.
        params["q"] = " OR ".join('"' + w.replace('"', '""') + '"' for w in found)
        sql = (f"SELECT {columns} FROM notes_fts JOIN notes n ON n.num = notes_fts.rowid "
               f"WHERE notes_fts MATCH :q AND {live} ORDER BY n.updated_at DESC, n.num DESC LIMIT :most")
    else:
        # The words as lexemes of a tsquery value, quoted: its input reads no operator inside quotes, and
        # (unlike to_tsquery) runs no parser, so the words stay as tokens() made them.
        params["q"] = " | ".join("'" + w.replace("\\", "\\\\").replace("'", "''") + "'" for w in found)
        sql = (f"SELECT {columns} FROM notes n WHERE {live} AND n.search @@ CAST(:q AS tsquery) "
               "ORDER BY n.updated_at DESC, n.num DESC LIMIT :most")
    with engine.connect() as conn:
        rows = conn.execute(sa.text(sql), params).all()
    asked = set(found)
    held = sorted(rows, key=lambda r: -len(asked.intersection(r.words.split())))  # stable: the last written first
    return [Note(r.id, r.text, r.created_at, r.updated_at) for r in held[:limit]]


def sweep(engine: Engine, retention: dict[str, float], now: float | None = None) -> int:
    """Delete every note past its project's retention (RETENTION: hours by project), and every note of a
    project not in RETENTION; returns how many went (llmgw/expiry.py)."""
    now = time.time() if now is None else now
    return expiry.sweep(engine, store.notes, store.notes.c.num, retention, now, SWEEP_BATCH)


def retention(conn: Connection) -> dict[str, float]:
    """Hours each project keeps its notes, for the projects that keep them."""
    return expiry.retention(conn, store.projects.c.memory_hours)
