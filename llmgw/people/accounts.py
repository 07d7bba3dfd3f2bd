"""People: accounts, their passwords, and the states an operator moves them through.

Sign-up (when open) makes a `pending` account that can do nothing until an
operator approves it (`active`); an operator can suspend and reinstate it, or
remove it; rejecting a sign-up removes it. Passwords are kept as scrypt hashes
(memory-hard, in the standard library), each with its own salt; a wrong
password and an unknown address get the same answer, so sign-in cannot be used
to find out who has an account.

Every change to a person moves the store's key revision, as a change to a
key does: gateways hold who is active beside the keys, and reload both when
the revision moves (a suspended person's key once kept working until some
unrelated key changed). Suspension, removal and a new password end the
person's sessions. The last active administrator cannot be demoted,
suspended or removed: nobody would be left to administer.

Hashing a password takes tens of milliseconds of CPU; callers on an event
loop pass `offload` to run it elsewhere (the pages hand it to threads of
their own), so a burst of sign-ins never stalls the loop.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import re
import secrets
import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from llmgw import store
from llmgw.ids import new_id
from llmgw.people import sessions

PENDING, ACTIVE, SUSPENDED = "pending", "active", "suspended"
# scrypt with N=2^14, r=8: about 16 MiB and a few tens of milliseconds per check.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2 ** 14, 8, 1
MIN_PASSWORD = 10
# The password hash of an account an identity provider made: no password matches it, and none can be set
# without the current one, so such a person signs in only through the provider.
NO_PASSWORD = "!"
EMAIL = re.compile(r"^[^@\s]+@[^@\s]+$")


class AccountError(Exception):
    """An account operation refused; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class User:
    id: str
    email: str
    state: str
    is_admin: bool
    created_at: float
    approved_by: str | None = None
    approved_at: float | None = None


def inline(function, *args):
    """Run FUNCTION here and now: the `offload` of callers that are not on an event loop."""
    return function(*args)


def hash_password(password: str) -> str:
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32)
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return f"scrypt${SCRYPT_N}${SCRYPT_R}${SCRYPT_P}${b64(salt)}${b64(digest)}"


def check_password(password: str, stored: str) -> bool:
    try:
        kind, n, r, p, salt, digest = stored.split("$")
        if kind != "scrypt":
            return False
        want = base64.b64decode(digest)
        got = hashlib.scrypt(password.encode(), salt=base64.b64decode(salt), n=int(n), r=int(r), p=int(p),
                             dklen=len(want))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, want)


# Checked against when an address is unknown, so that the answer takes as long as for a known one.
_DUMMY_HASH = hash_password(secrets.token_urlsafe(16))


def row_of(row) -> User:
    return User(row.id, row.email, row.state, bool(row.is_admin), row.created_at, row.approved_by, row.approved_at)


def check_new_password(password: str) -> None:
    if len(password) < MIN_PASSWORD:
        raise AccountError(f"a password needs at least {MIN_PASSWORD} characters")


def create_user(engine: Engine, email: str, password: str, state: str = PENDING, is_admin: bool = False,
                offload=inline) -> User:
    check_new_password(password)
    password_hash = offload(hash_password, password)
    try:
        with store.writing(engine) as conn:
            return insert_user(conn, email, password_hash, state, is_admin)
    except sa.exc.IntegrityError:
        raise AccountError(f"{email.strip().lower()} already has an account") from None


def insert_user(conn, email: str, password_hash: str, state: str, is_admin: bool = False) -> User:
    """A new account inside the caller's transaction (NO_PASSWORD: one only a provider signs in)."""
    email = email.strip().lower()
    if not EMAIL.match(email) or len(email) > 320:
        raise AccountError(f"{email[:330]!r} is not an email address")
    user = User(new_id(), email, state, is_admin, time.time())
    conn.execute(store.users.insert().values(id=user.id, email=email, password_hash=password_hash,
                                             state=state, is_admin=is_admin, created_at=user.created_at))
    store.bump_revision(conn, "keys", [("user", user.id)])
    return user


def find(engine: Engine, which: str) -> User:
    """The account whose id or email is WHICH."""
    with engine.connect() as conn:
        row = conn.execute(store.users.select().where(
            sa.or_(store.users.c.id == which, store.users.c.email == which.strip().lower()))).first()
    if row is None:
        raise AccountError(f"no account {which!r}; `llmgw users list` shows them")
    return row_of(row)


def get(engine: Engine, user_id: str) -> User | None:
    with engine.connect() as conn:
        return get_in(conn, user_id)


def get_in(conn, user_id: str) -> User | None:
    row = conn.execute(store.users.select().where(store.users.c.id == user_id)).first()
    return row_of(row) if row else None


def has_password(engine: Engine, user_id: str) -> bool:
    """Whether the person can sign in with a password (an identity provider's account has none)."""
    with engine.connect() as conn:
        stored = conn.execute(sa.select(store.users.c.password_hash).where(store.users.c.id == user_id)).scalar()
    return stored not in (None, NO_PASSWORD)


def list_users(engine: Engine, state: str | None = None) -> list[User]:
    query = store.users.select().order_by(store.users.c.created_at)
    if state:
        query = query.where(store.users.c.state == state)
    with engine.connect() as conn:
        return [row_of(r) for r in conn.execute(query)]


def authenticate(engine: Engine, email: str, password: str, offload=inline) -> User | str:
    """The user, or why not, in words for the sign-in page."""
    with engine.connect() as conn:
        row = conn.execute(store.users.select().where(store.users.c.email == email.strip().lower())).first()
    if row is None or row.password_hash == NO_PASSWORD:
        # An account made by an identity provider has no password: it is answered as an unknown one, in as long.
        offload(check_password, password, _DUMMY_HASH)
        return "Wrong email or password."
    if not offload(check_password, password, row.password_hash):
        return "Wrong email or password."
    if row.state == PENDING:
        return "Your account waits for an operator's approval."
    if row.state == SUSPENDED:
        return "Your account is suspended. Ask an operator."
    return row_of(row)


def _update(engine: Engine, which: str, end_sessions: bool = False, **values) -> User:
    """Change WHICH's row; with END_SESSIONS, end every session of theirs in the same transaction."""
    user = find(engine, which)
    with store.writing(engine) as conn:
        one_at_a_time(conn, [("user", user.id)])
        if user.is_admin and user.state == ACTIVE and (values.get("state", ACTIVE) != ACTIVE
                                                       or not values.get("is_admin", True)):
            keep_an_administrator(conn, user)
        conn.execute(store.users.update().where(store.users.c.id == user.id).values(**values))
        if end_sessions:
            sessions.end_all(conn, user.id)
    return dataclasses.replace(user, **{k: v for k, v in values.items() if k in ("state", "is_admin")})


def one_at_a_time(conn, changes: list[tuple[str, str]] | None = None) -> None:
    """Begin a change to a person by bumping the keys' revision (every such change must: workers reload
    people when it moves), first: the row's write lock makes changes to people run one after another.
    Two administrators stepping down at once each saw the other still there, and both went. CHANGES: what
    the change touches of the key set (`store.bump_revision`), all of it by default."""
    store.bump_revision(conn, "keys", changes)


def keep_an_administrator(conn, user: User) -> None:
    """Refuse to take USER, an active administrator, out of administering when nobody else could."""
    u = store.users
    others = conn.execute(sa.select(sa.func.count()).where(sa.and_(
        u.c.is_admin.is_(True), u.c.state == ACTIVE, u.c.id != user.id))).scalar_one()
    if not others:
        raise AccountError(f"nobody could administer after this: {user.email} is the last active administrator. "
                           "Make someone else an administrator first (llmgw users promote EMAIL)")


def approve(engine: Engine, which: str, by: str) -> User:
    """Let the sign-up WHICH in, recording BY (who approved it: an operator's name, an administrator's email)."""
    user = find(engine, which)
    if user.state != PENDING:
        raise AccountError(f"{user.email} is {user.state}, not waiting for approval")
    if not by.strip() or len(by) > 320 or any(not c.isprintable() for c in by):
        raise AccountError("say who approves with a name or an email of printable characters (--by)")
    now = time.time()
    _update(engine, which, state=ACTIVE, approved_by=by.strip(), approved_at=now)
    return dataclasses.replace(user, state=ACTIVE, approved_by=by.strip(), approved_at=now)


def suspend(engine: Engine, which: str) -> User:
    return _update(engine, which, end_sessions=True, state=SUSPENDED)


def reinstate(engine: Engine, which: str) -> User:
    user = find(engine, which)
    if user.state != SUSPENDED:
        raise AccountError(f"{user.email} is {user.state}, not suspended")
    return _update(engine, which, state=ACTIVE)


def promote(engine: Engine, which: str, admin: bool = True) -> User:
    """An operator's doing: from now on the role is theirs, and no identity provider's groups take it back."""
    return _update(engine, which, is_admin=admin, admin_source=None)


def change_password(engine: Engine, user_id: str, current: str, new: str, offload=inline) -> None:
    """Set a new password and end every session of the person (one may have been someone else's)."""
    with engine.connect() as conn:
        row = conn.execute(store.users.select().where(store.users.c.id == user_id)).first()
    if row is None or not offload(check_password, current, row.password_hash):
        raise AccountError("the current password is wrong")
    check_new_password(new)
    _update(engine, user_id, end_sessions=True, password_hash=offload(hash_password, new))


def end_sessions(engine: Engine, which: str) -> tuple[User, int]:
    """End every session of WHICH (an administrator's doing); the account and how many ended."""
    user = find(engine, which)
    with store.writing(engine) as conn:
        return user, sessions.end_all(conn, user.id)


def remove(engine: Engine, which: str) -> User:
    """Remove an account (rejecting a sign-up is removing it); its keys are revoked."""
    user = find(engine, which)
    now = time.time()
    with store.writing(engine) as conn:
        one_at_a_time(conn, [("user", user.id), ("user_keys", user.id), ("limit", f"user:{user.id}")])
        if user.is_admin and user.state == ACTIVE:
            keep_an_administrator(conn, user)
        sessions.end_all(conn, user.id)
        conn.execute(store.identities.delete().where(store.identities.c.user_id == user.id))
        conn.execute(store.api_keys.update().where(sa.and_(store.api_keys.c.user_id == user.id,
                                                            store.api_keys.c.revoked_at.is_(None)))
                     .values(revoked_at=now))
        conn.execute(store.memberships.delete().where(store.memberships.c.user_id == user.id))
        conn.execute(store.limits.delete().where(sa.and_(store.limits.c.scope == "user",
                                                         store.limits.c.scope_id == user.id)))
        conn.execute(store.users.delete().where(store.users.c.id == user.id))
    return user


def reject(engine: Engine, which: str) -> User:
    """Turn down a sign-up: the account is deleted, so the address may sign up again."""
    user = find(engine, which)
    if user.state != PENDING:
        raise AccountError(f"{user.email} is {user.state}, not waiting for approval; suspend or remove it instead")
    return remove(engine, user.id)

