"""API keys: making them, keeping only their hashes, and checking them from memory.

A secret is shown once, when it is made; the store keeps its SHA-256 and a
short prefix people can recognise it by. Gateway workers hold a `KeyTable`
built from the store and refreshed when the store's key revision changes, so a
request is authenticated with one hash and one dictionary lookup, never a
query. Expiry is checked against the clock at each request, so an expired key
needs no refresh to stop working.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import secrets
import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from llmgw import store
from llmgw.ids import new_id

SECRET_PREFIX = "sk-llmgw-"
# The prefix people see in listings: enough to tell keys apart, far too little to guess the rest.
DISPLAY_CHARS = len(SECRET_PREFIX) + 6


class KeyRefused(Exception):
    """A key operation refused; the message says what to do instead."""


@dataclasses.dataclass(frozen=True)
class KeyRecord:
    id: str
    name: str
    project_id: str
    project: str
    prefix: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


_DURATION = re.compile(r"^(\d+)\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """`30d`, `12h`, `90m`, `2w`, `45s` in seconds."""
    match = _DURATION.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"{text!r} is not a duration; write a whole number and a unit, such as 30d, 12h or 90m")
    return int(match.group(1)) * _UNITS[match.group(2)]


def _project_id(conn, project: str) -> str:
    row = conn.execute(sa.select(store.projects.c.id).where(
        sa.or_(store.projects.c.name == project, store.projects.c.id == project))).first()
    if row is None:
        names = [r[0] for r in conn.execute(sa.select(store.projects.c.name).order_by(store.projects.c.name))]
        raise KeyRefused(f"no project named {project!r}; projects: {', '.join(names)}")
    return row[0]


def create_key(engine: Engine, name: str, project: str = store.DEFAULT_PROJECT,
               expires_in: float | None = None, user_id: str | None = None) -> tuple[KeyRecord, str]:
    """Make a key; returns its record and the secret, which is never stored."""
    if not name.strip():
        raise KeyRefused("a key needs a name, such as the person or program that will use it")
    secret = new_secret()
    now = time.time()
    with engine.begin() as conn:
        project_id = _project_id(conn, project)
        key_id = new_id()
        values = dict(id=key_id, name=name, project_id=project_id, hash=hash_secret(secret),
                      prefix=secret[:DISPLAY_CHARS], created_at=now,
                      expires_at=now + expires_in if expires_in else None, user_id=user_id)
        conn.execute(store.api_keys.insert().values(**values))
        store.bump_revision(conn, "keys")
    record = KeyRecord(id=key_id, name=name, project_id=project_id, project=project, prefix=values["prefix"],
                       created_at=now, expires_at=values["expires_at"], revoked_at=None)
    return record, secret


def _select_keys():
    k, p = store.api_keys, store.projects
    return sa.select(k.c.id, k.c.name, k.c.project_id, p.c.name, k.c.prefix, k.c.created_at,
                     k.c.expires_at, k.c.revoked_at, k.c.hash).join(p, p.c.id == k.c.project_id)


def list_keys(engine: Engine, user_id: str | None = None) -> list[KeyRecord]:
    """Every key, or only those USER_ID made."""
    query = _select_keys().order_by(store.api_keys.c.created_at)
    if user_id is not None:
        query = query.where(store.api_keys.c.user_id == user_id)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [KeyRecord(*row[:8]) for row in rows]


def revoke_key(engine: Engine, which: str, user_id: str | None = None) -> KeyRecord:
    """Revoke the key whose id, display prefix or name is WHICH (it must match exactly one);
    with USER_ID, only among the keys that person made."""
    k = store.api_keys
    with engine.begin() as conn:
        query = _select_keys().where(sa.or_(k.c.id == which, k.c.prefix == which, k.c.name == which))
        if user_id is not None:
            query = query.where(k.c.user_id == user_id)
        rows = conn.execute(query).all()
        if not rows:
            raise KeyRefused(f"no key has the id, prefix or name {which!r}; `llmgw keys list` shows them")
        if len(rows) > 1:
            ids = ", ".join(r[0] for r in rows)
            raise KeyRefused(f"{len(rows)} keys match {which!r} ({ids}); revoke one by its id")
        record = KeyRecord(*rows[0][:8])
        if record.revoked_at is None:
            now = time.time()
            conn.execute(k.update().where(k.c.id == record.id).values(revoked_at=now))
            store.bump_revision(conn, "keys")
            record = dataclasses.replace(record, revoked_at=now)
    return record


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a key was not accepted, in words for the client."""
    message: str
    code: str


MISSING = Refusal("No API key was given. Send it as `Authorization: Bearer sk-llmgw-...`; "
                  "an operator makes one with `llmgw keys create NAME`.", "missing_api_key")
UNKNOWN = Refusal("This API key is not known here. Check that it was copied whole; "
                  "an operator can list keys with `llmgw keys list`.", "invalid_api_key")


class KeyTable:
    """Keys by hash, as one worker knows them. Replaced whole on refresh, so a
    lookup never sees a half-built table."""

    def __init__(self, records: dict[str, KeyRecord], revision: int):
        self.by_hash = records
        self.revision = revision

    @classmethod
    def load(cls, engine: Engine) -> "KeyTable":
        with engine.connect() as conn:
            revision = store.read_revision(conn, "keys")
            rows = conn.execute(_select_keys()).all()
        return cls({row[8]: KeyRecord(*row[:8]) for row in rows}, revision)

    def authenticate(self, authorization: str | None, now: float) -> KeyRecord | Refusal:
        if not authorization:
            return MISSING
        scheme, _, secret = authorization.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            return Refusal("The Authorization header must be `Bearer <key>`.", "invalid_api_key")
        record = self.by_hash.get(hash_secret(secret.strip()))
        if record is None:
            return UNKNOWN
        if record.revoked_at is not None:
            return Refusal(f"This API key ({record.prefix}...) was revoked. Ask an operator for a new one.",
                           "revoked_api_key")
        if record.expires_at is not None and now >= record.expires_at:
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(record.expires_at))
            return Refusal(f"This API key ({record.prefix}...) expired at {when}. Ask an operator for a new one.",
                           "expired_api_key")
        return record


def current_revision(engine: Engine) -> int:
    with engine.connect() as conn:
        return store.read_revision(conn, "keys")
