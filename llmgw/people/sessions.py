"""Signed-in sessions of the pages, and the secret that signs their cookies.

A session is a row in the store: the cookie carries a random token and the
store only its hash. A page request counts as signed in only while its row
exists, is younger than `gateway.session_lifetime` and was seen within
`gateway.session_idle`; ending a session deletes the row, so a cookie copied
before sign-out is worth nothing after it. Pages and the chat endpoint read
the row; `/v1` requests never do (they carry keys, not sessions).

The cookie-signing secret is a file (mode 0600) beside the store, never in
it: a store readable by others once let any local user forge an
administrator's cookie.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import tempfile
import time

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import filemodes, settings, store
from llmgw.principals import hash_secret

# A session's last sight is written at most this often: a write on every page would cost more than an idle
# timeout measured to the minute is worth.
TOUCH_EVERY = 60.0


@dataclasses.dataclass(frozen=True)
class Lifetimes:
    idle: float  # seconds a session lasts unused
    absolute: float  # seconds a session lasts at most


def start(engine: Engine, user_id: str, lifetimes: Lifetimes, provider: str | None = None,
          lasts: float | None = None) -> str:
    """A new session for USER_ID: the token for its cookie. Sessions past their lifetimes are cleared out.
    PROVIDER: the identity provider it began through; LASTS: seconds it lasts at most, however used (a
    provider's sign-in: auth.provider_session_lifetime)."""
    now = time.time()
    token = secrets.token_urlsafe(32)
    s = store.sessions
    with store.writing(engine) as conn:
        conn.execute(s.delete().where(sa.or_(s.c.seen_at < now - lifetimes.idle,
                                             s.c.created_at < now - lifetimes.absolute, s.c.expires_at < now)))
        conn.execute(s.insert().values(id=hash_secret(token), user_id=user_id, created_at=now, seen_at=now,
                                       provider=provider, expires_at=now + lasts if lasts else None))
    return token


def holds(engine: Engine, token: str | None, user_id: str, lifetimes: Lifetimes) -> bool:
    """Whether TOKEN is a live session of USER_ID; a live one is marked seen, an expired one deleted."""
    if not token:
        return False
    now = time.time()
    s = store.sessions
    key = hash_secret(token)
    with engine.connect() as conn:
        row = conn.execute(sa.select(s.c.user_id, s.c.created_at, s.c.seen_at, s.c.expires_at)
                           .where(s.c.id == key)).first()
    if row is None or row.user_id != user_id:
        return False
    if now - row.seen_at >= lifetimes.idle or now - row.created_at >= lifetimes.absolute \
            or (row.expires_at is not None and now >= row.expires_at):
        end(engine, token)
        return False
    if now - row.seen_at >= TOUCH_EVERY:
        with store.writing(engine) as conn:
            conn.execute(s.update().where(s.c.id == key).values(seen_at=now))
    return True


def end(engine: Engine, token: str | None) -> None:
    """End the session TOKEN (sign-out); nothing to do when there is none."""
    if token:
        with store.writing(engine) as conn:
            conn.execute(store.sessions.delete().where(store.sessions.c.id == hash_secret(token)))


def end_all(conn: Connection, user_id: str) -> int:
    """End every session of USER_ID, inside the caller's transaction; how many there were."""
    return conn.execute(store.sessions.delete().where(store.sessions.c.user_id == user_id)).rowcount


def count(engine: Engine, user_ids: set[str]) -> dict[str, int]:
    """How many sessions each of USER_IDS has (expired ones not yet cleared out included)."""
    s = store.sessions
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(s.c.user_id, sa.func.count()).where(s.c.user_id.in_(user_ids))
                                 .group_by(s.c.user_id)).all())


# --- the secret that signs session cookies ------------------------------------------------------------

class SecretFileError(settings.ConfigError):
    """The session secret's file holds no usable key; the message says what to do."""


def secret_path(cfg: settings.Config) -> str:
    """Where the session secret lives: `gateway.session_key_file`, or `session.key` beside a SQLite store,
    or in `var/`."""
    if cfg["gateway.session_key_file"]:
        return cfg["gateway.session_key_file"]
    database = filemodes.sqlite_path(cfg["store.url"])
    return os.path.join(os.path.dirname(os.path.abspath(database)) if database else "var", "session.key")


def ensure_secret(path: str) -> str:
    """The secret in PATH, made (mode 0600) when missing. Refused (filemodes.LooseFiles, with the chmod that
    fixes it) when others may read it.

    Made whole in a temporary file and linked into place, so two workers starting together cannot both
    make one, and nobody ever reads half of one."""
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    folder = os.path.dirname(os.path.abspath(path))
    filemodes.make_private_dir(folder)
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=".session.key.")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(48) + "\n")
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another process made it first: theirs is the one
    finally:
        os.unlink(temporary)
    return _read_secret(path)


def _read_secret(path: str) -> str:
    with open(path, encoding="ascii") as f:
        filemodes.refuse_loose({path: filemodes.OTHERS})
        value = f.read().strip()
    if len(value) < 32:
        raise SecretFileError(f"{path} holds no usable session key; remove it and start again to make a new one "
                              "(everyone signs in again)")
    return value
