"""Agents' notes on the gateway: `/v1/memory`, a project's notes made, read, changed, deleted, listed and searched.

Only for a project that keeps them (`llmgw keys memory`, pushed to workers with the keys), and never for
a personal key: either is refused saying how to turn them on. The project is the key's; every lookup is
by it and the note's id together (llmgw/memory.py), so another project's note is a 404 like one never
written. The same notes are the gateway's MCP tools (llmgw/gateway/mcpserver.py). Store work runs where
a kept conversation's does (llmgw/gateway/threads.py: SQLite in threads of its own).

    POST   /v1/memory            {"text": "..."}       a note made (201)
    GET    /v1/memory?query=Q&limit=N                  notes holding any word of Q, best first; without
                                                       Q the last written first
    GET    /v1/memory/ID                               a note
    PATCH  /v1/memory/ID         {"text": "..."}       its text replaced (PUT alike)
    DELETE /v1/memory/ID                               gone now
"""

from __future__ import annotations

import urllib.parse

from llmgw import memory
from llmgw.gateway import apirequest
from llmgw.gateway.errors import ApiError

PATH = "/v1/memory"
HOW_TO_TURN_ON = ("An operator turns notes on for a project with `llmgw keys memory --project P --retain-hours N`.")
DEFAULT_LIMIT = 20
QUERY_FIELDS_MOST = 10


class Notes:
    def __init__(self, runtime, run):
        """RUN(job, *args): a store job run off the loop where it must be (Threads.run)."""
        self.rt = runtime
        self.engine = runtime.engine
        self.run = run

    def scope(self, caller) -> tuple[str, float]:
        """The project CALLER's notes are kept in and for how many hours; raises ApiError(403) where it keeps none."""
        if caller.project_id is None:
            raise ApiError(403, "A personal key keeps no notes: they belong to a project. Use a key of a project "
                                "that keeps them. " + HOW_TO_TURN_ON, "memory_needs_project")
        hours = self.rt.keys.memory.get(caller.project_id)
        if hours is None:
            raise ApiError(403, "This key's project keeps no notes. " + HOW_TO_TURN_ON, "memory_off")
        return caller.project_id, hours

    # --- what the API and the MCP tools share --------------------------------------------------

    def add(self, caller, text) -> memory.Note:
        scope, hours = self.scope(caller)
        try:
            return self.run(memory.add, self.engine, scope, checked_text(text), hours)
        except memory.TooMany:
            raise ApiError(409, f"This project keeps {memory.NOTES_MOST} notes already, the most it may. Delete "
                                "some (DELETE /v1/memory/ID) or update one instead.", "too_many_notes") from None

    def get(self, caller, note_id: str) -> memory.Note:
        scope, hours = self.scope(caller)
        return self._found(note_id, memory.NOTE_ID.fullmatch(note_id) and self.run(
            memory.get, self.engine, scope, note_id, hours))

    def update(self, caller, note_id: str, text) -> memory.Note:
        scope, hours = self.scope(caller)
        text = checked_text(text)
        return self._found(note_id, memory.NOTE_ID.fullmatch(note_id) and self.run(
            memory.update, self.engine, scope, note_id, text, hours))

    def delete(self, caller, note_id: str) -> None:
        scope, hours = self.scope(caller)
        self._found(note_id, memory.NOTE_ID.fullmatch(note_id) and self.run(
            memory.delete, self.engine, scope, note_id, hours))

    def find(self, caller, query, limit) -> list[memory.Note]:
        """Notes holding any word of QUERY, best first; without one, the last written first."""
        scope, hours = self.scope(caller)
        limit = checked_limit(limit)
        if query is None or query == "":
            return self.run(memory.listing, self.engine, scope, hours, limit)
        if not isinstance(query, str) or len(query) > memory.QUERY_MOST or not _unicode(query):
            raise ApiError(400, f"query must be text of at most {memory.QUERY_MOST} characters.", "invalid_request",
                           "query")
        return self.run(memory.search, self.engine, scope, query, hours, limit)

    @staticmethod
    def _found(note_id: str, found):
        if not found:
            raise ApiError(404, f"No note {note_id[:40]!r} is kept for this key's project.", "note_not_found")
        return found

    # --- the HTTP API --------------------------------------------------------------------------

    def answer(self, caller, method: str, rest: str, query_string: str, body: bytes) -> tuple[int, dict]:
        """(status, JSON object) for a `/v1/memory` request; raises ApiError."""
        if rest in ("", "/"):
            if method == "POST":
                return 201, shown(self.add(caller, apirequest.read_object(body).get("text")))
            if method == "GET":
                try:
                    asked = urllib.parse.parse_qs(query_string, max_num_fields=QUERY_FIELDS_MOST)
                except ValueError:
                    raise ApiError(400, "The query string has too many fields: give query and limit, nothing else.",
                                   "invalid_request") from None
                limit = asked.get("limit", [None])[0]
                notes = self.find(caller, asked.get("query", [None])[0],
                                  int(limit) if limit is not None and limit.isascii() and limit.isdigit() else limit)
                return 200, {"object": "list", "data": [shown(n) for n in notes]}
            raise ApiError(405, f"Use GET or POST for {PATH}.", "method_not_allowed")
        note_id = rest.lstrip("/")
        if method == "GET":
            return 200, shown(self.get(caller, note_id))
        if method in ("PATCH", "PUT"):
            return 200, shown(self.update(caller, note_id, apirequest.read_object(body).get("text")))
        if method == "DELETE":
            self.delete(caller, note_id)
            return 200, {"id": note_id, "object": "memory.note.deleted", "deleted": True}
        raise ApiError(405, f"Use GET, PATCH or DELETE for {PATH}/ID.", "method_not_allowed")


def checked_text(text) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ApiError(400, "text is required: the note, as a string.", "invalid_request", "text")
    if len(text) > memory.TEXT_MOST:
        raise ApiError(400, f"text is {len(text)} characters; a note holds at most {memory.TEXT_MOST}.",
                       "invalid_request", "text")
    if not _unicode(text):
        raise ApiError(400, "text holds a lone surrogate (an escape such as \\ud800 alone) or a NUL, which "
                            "a note cannot keep; a note is text.", "invalid_request", "text")
    return text


def _unicode(value: str) -> bool:
    """Whether VALUE is text a store keeps as it is: no lone surrogate, and no NUL (PostgreSQL refuses it)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in value


def checked_limit(limit) -> int:
    if limit is None:
        return DEFAULT_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= memory.LIST_MOST:
        raise ApiError(400, f"limit must be a whole number from 1 to {memory.LIST_MOST}.", "invalid_request", "limit")
    return limit


def shown(note: memory.Note) -> dict:
    return {"id": note.id, "object": "memory.note", "text": note.text, "created_at": int(note.created_at),
            "updated_at": int(note.updated_at)}
