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
import hmac
import json
import re
import secrets
import time
from collections.abc import Iterator

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from llmgw import rules, store
from llmgw.ids import new_id
from llmgw.principals import PERSONAL, SECRET_PREFIX, KeyRecord, hash_secret

# The prefix people see in listings: enough to tell keys apart, far too little to guess the rest.
DISPLAY_CHARS = len(SECRET_PREFIX) + 6


class KeyRefused(Exception):
    """A key operation refused; the message says what to do instead."""




def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


# At most twelve digits: Python's int() refuses thousands, and no duration needs more.
_DURATION = re.compile(r"^(\d{1,12})\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# A century: a key that lasts longer is one that never expires, and a far larger one overflowed the
# arithmetic of times (a 500 on the people page).
LONGEST_DURATION = 36500 * 86400


def parse_duration(text: str) -> float:
    """`30d`, `12h`, `90m`, `2w`, `45s` in seconds, up to a century."""
    match = _DURATION.match(text.strip())
    seconds = int(match.group(1)) * _UNITS[match.group(2)] if match else 0
    if not 0 < seconds <= LONGEST_DURATION:
        raise ValueError(f"{text[:20]!r} is not a duration of up to a century; write a whole number and a unit, "
                         "such as 30d, 12h or 90m")
    return seconds


def create_key(engine: Engine, name: str, project: str | None = store.DEFAULT_PATH, expires_in: float | None = None,
               user_id: str | None = None, made_by: str | None = None, band: str | None = None,
               models: list[str] | None = None, member_only: bool = False,
               profile: str | None = None) -> tuple[KeyRecord, str]:
    """Make a key; returns its record and the secret, which is never stored.

    PROJECT (an id, path or unique name) is what it spends against; None makes a
    personal key, which needs USER_ID. With MEMBER_ONLY, USER_ID must be able to
    use the project through a membership (a person making their own key).
    BAND, MODELS and PROFILE are the key's own admission band, model allowlist and routing profile.
    """
    from llmgw.people import limits, memberships
    from llmgw.people.orgtree import Tree, TreeError

    if not name.strip():
        raise KeyRefused("a key needs a name, such as the person or program that will use it")
    if project is None and user_id is None:
        raise KeyRefused("a personal key belongs to a person: say whose (--for EMAIL), or give a project")
    own = {k: v for k, v in (("band", band), ("models", models), ("profile", profile)) if v is not None}
    try:
        own = limits.validate(own)
    except rules.LimitError as e:
        raise KeyRefused(str(e)) from None
    secret = new_secret()
    now = time.time()
    with store.writing(engine) as conn:
        tree = Tree.read(conn)
        path, project_id = PERSONAL, None
        if project is None and limits.personal_off(conn):
            raise KeyRefused("personal use is turned off here: make the key in a project (--project), or turn "
                             "personal use back on (`llmgw limits set --scope personal --disabled no`)")
        if project is not None:
            try:
                node = tree.find("project", project)
            except TreeError as e:
                raise KeyRefused(str(e)) from None
            if member_only and node.id not in memberships.reachable_projects(conn, tree, user_id):
                raise KeyRefused(f"you are not a member of {node.path}; make a personal key, "
                                 "or ask an operator to add you to the project")
            path, project_id = node.path, node.id
        key_id = new_id()
        values = dict(id=key_id, name=name.strip(), project_id=project_id, hash=hash_secret(secret),
                      prefix=secret[:DISPLAY_CHARS], created_at=now,
                      expires_at=now + expires_in if expires_in else None, user_id=user_id, made_by=made_by)
        conn.execute(store.api_keys.insert().values(**values))
        if own:
            conn.execute(store.limits.insert().values(
                scope="key", scope_id=key_id, band=own.get("band"), profile=own.get("profile"), updated_at=now,
                models=json.dumps(list(own["models"])) if "models" in own else None))
        store.bump_revision(conn, "keys", [("key", key_id)] + ([("limit", f"key:{key_id}")] if own else []))
    record = KeyRecord(id=key_id, name=values["name"], project_id=project_id, project=path, prefix=values["prefix"],
                       created_at=now, expires_at=values["expires_at"], revoked_at=None, user_id=user_id)
    return record, secret


_COLUMNS = ("id", "name", "project_id", "prefix", "created_at", "expires_at", "revoked_at", "user_id")


def _record(row, tree) -> KeyRecord:
    node = tree.by_id.get(row.project_id) if row.project_id else None
    return KeyRecord(row.id, row.name, row.project_id, node.path if node else PERSONAL, row.prefix,
                     row.created_at, row.expires_at, row.revoked_at, row.user_id)


def list_keys(engine: Engine, user_id: str | None = None, project_ids: set[str] | None = None,
              ownerless: bool = False) -> list[KeyRecord]:
    """Every key; or only USER_ID's; or only those in PROJECT_IDS; with OWNERLESS, only those of no person."""
    from llmgw.people.orgtree import Tree

    k = store.api_keys
    query = sa.select(*(k.c[c] for c in _COLUMNS)).order_by(k.c.created_at)
    if user_id is not None:
        query = query.where(k.c.user_id == user_id)
    if project_ids is not None:
        query = query.where(k.c.project_id.in_(project_ids))
    if ownerless:
        query = query.where(k.c.user_id.is_(None))
    with engine.connect() as conn:
        tree = Tree.read(conn)
        return [_record(row, tree) for row in conn.execute(query)]


def _listed(query, project_ids: set[str] | None, working_at: float | None):
    k = store.api_keys
    if project_ids is not None:
        query = query.where(k.c.project_id.in_(project_ids))
    if working_at is not None:
        query = query.where(k.c.revoked_at.is_(None), sa.or_(k.c.expires_at.is_(None), k.c.expires_at > working_at))
    return query


def count_keys(engine: Engine, project_ids: set[str] | None = None, working_at: float | None = None) -> int:
    """How many keys `page_of_keys` would list with no limit."""
    with engine.connect() as conn:
        return conn.execute(_listed(sa.select(sa.func.count()).select_from(store.api_keys), project_ids,
                                    working_at)).scalar_one()


def page_of_keys(engine: Engine, project_ids: set[str] | None = None, working_at: float | None = None,
                 after: str | None = None, limit: int | None = None) -> Iterator[tuple[KeyRecord, str | None]]:
    """Keys in the order they were made, each with its owner's email (None for no person's): only those in
    PROJECT_IDS; only those working at WORKING_AT (neither revoked nor expired then); only those after the key
    whose id is AFTER; at most LIMIT. Read from the store as they are taken, so a million are never held at
    once (`list_keys` holds them all)."""
    from llmgw.people.orgtree import Tree

    k, u = store.api_keys, store.users
    query = _listed(sa.select(*(k.c[c] for c in _COLUMNS), u.c.email).select_from(
        k.outerjoin(u, u.c.id == k.c.user_id)), project_ids, working_at).order_by(k.c.created_at, k.c.id)
    with engine.connect() as conn:
        if after is not None:
            made = conn.execute(sa.select(k.c.created_at).where(k.c.id == after)).scalar_one_or_none()
            if made is None:
                raise KeyRefused(f"no key has the id {after!r}; give --after the ID of the last key a page showed")
            query = query.where(sa.tuple_(k.c.created_at, k.c.id) > sa.tuple_(made, after))
        if limit is not None:
            query = query.limit(limit)
        tree = Tree.read(conn)
        for row in conn.execution_options(yield_per=1000).execute(query):
            yield _record(row, tree), row.email


def _named(which: str):
    k = store.api_keys
    return sa.or_(k.c.id == which, k.c.prefix == which, k.c.name == which)


def _records(engine: Engine, where) -> list[KeyRecord]:
    from llmgw.people.orgtree import Tree

    k = store.api_keys
    with engine.connect() as conn:
        tree = Tree.read(conn)
        return [_record(row, tree) for row in conn.execute(sa.select(*(k.c[c] for c in _COLUMNS)).where(where))]


def named(engine: Engine, which: str) -> list[KeyRecord]:
    """The keys whose id, display prefix or name is WHICH."""
    return _records(engine, _named(which))


def by_ids(engine: Engine, key_ids: set[str]) -> list[KeyRecord]:
    """The keys whose ids are among KEY_IDS (a page's worth)."""
    return _records(engine, store.api_keys.c.id.in_(sorted(key_ids)))


def revoke_key(engine: Engine, which: str, user_id: str | None = None) -> KeyRecord:
    """Revoke the key whose id, display prefix or name is WHICH (it must match exactly one);
    with USER_ID, only among that person's keys."""
    from llmgw.people.orgtree import Tree

    k = store.api_keys
    with store.writing(engine) as conn:
        query = sa.select(*(k.c[c] for c in _COLUMNS)).where(_named(which))
        if user_id is not None:
            query = query.where(k.c.user_id == user_id)
        rows = conn.execute(query).all()
        if not rows:
            raise KeyRefused(f"no key has the id, prefix or name {which!r}; `llmgw keys list` shows them")
        if len(rows) > 1:
            ids = ", ".join(r[0] for r in rows)
            raise KeyRefused(f"{len(rows)} keys match {which!r} ({ids}); revoke one by its id")
        record = _record(rows[0], Tree.read(conn))
        if record.revoked_at is None:
            now = time.time()
            conn.execute(k.update().where(k.c.id == record.id).values(revoked_at=now))
            store.bump_revision(conn, "keys", [("key", record.id)])
            record = dataclasses.replace(record, revoked_at=now)
    return record


# --- claim links ---------------------------------------------------------------------------------

CLAIM_TTL = 7 * 86400  # a link nobody opened within a week stops working


def _keystream(token: str, n: int) -> bytes:
    out = b""
    block = 0
    while len(out) < n:
        out += hmac.new(token.encode(), block.to_bytes(4, "big"), hashlib.sha256).digest()
        block += 1
    return out[:n]


def _seal(secret: str, token: str) -> str:
    # The token is random, used once and not kept, so a keystream derived from
    # it hides the secret from anyone who reads the database.
    data = secret.encode()
    return bytes(a ^ b for a, b in zip(data, _keystream(token, len(data)))).hex()


def _unseal(sealed: str, token: str) -> str:
    data = bytes.fromhex(sealed)
    return bytes(a ^ b for a, b in zip(data, _keystream(token, len(data)))).decode()


def make_claim(engine: Engine, key_id: str, secret: str, ttl: float = CLAIM_TTL) -> str:
    """A one-time token that shows SECRET to whoever opens /claim/<token> first."""
    token = secrets.token_urlsafe(24)
    now = time.time()
    with store.writing(engine) as conn:
        conn.execute(store.key_claims.insert().values(token_hash=hash_secret(token), key_id=key_id,
                                                      sealed=_seal(secret, token), created_at=now, expires_at=now + ttl))
    return token


def claim(engine: Engine, token: str) -> tuple[str, KeyRecord] | str:
    """Open a claim link: the secret and its key, once; afterwards (or when expired), why not."""
    c = store.key_claims
    with store.writing(engine) as conn:
        row = conn.execute(c.select().where(c.c.token_hash == hash_secret(token))).first()
        if row is None:
            return "This link is not known here. Check that it was copied whole."
        if row.claimed_at is not None:
            when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(row.claimed_at))
            return f"This key was already shown, at {when}. If that was not you, ask for the key to be revoked."
        if row.expires_at <= time.time():
            return "This link has expired. Ask for a new key."
        # Emptied in the same transaction that reads it: a second opener finds nothing.
        updated = conn.execute(c.update().where(sa.and_(c.c.token_hash == row.token_hash, c.c.claimed_at.is_(None)))
                               .values(sealed=None, claimed_at=time.time())).rowcount
        if updated != 1:
            return "This key was already shown."
    record = next(r for r in list_keys(engine) if r.id == row.key_id)
    return _unseal(row.sealed, token), record


def current_revision(engine: Engine) -> int:
    """The store's key revision: it moves with every change to a key, a limit, the tree or a person."""
    with engine.connect() as conn:
        return store.read_revision(conn, "keys")


def key_set(engine: Engine) -> dict:
    """Every key with what it is held to, as one `keys` message's fields (llmgw.wire.gateways): the keys,
    the limits, the tree they are resolved along, the prices, who is active and who administers, read at
    one moment.
    The controller pushes it to gateways; a gateway without a controller reads it itself."""
    from llmgw import conversations, memory
    from llmgw.people.limits import read_prices, read_rules
    from llmgw.people.orgtree import Tree

    k, u = store.api_keys, store.users
    # At one moment: a set labelled with a revision must hold exactly the changes up to it, since gateways
    # apply what changed between two sets (llmgw/wire/keychanges.py) and drop a set at a revision they hold.
    with store.one_moment(engine) as conn:
        revision = store.read_revision(conn, "keys")
        tree = Tree.read(conn)
        rows = conn.execute(sa.select(*(k.c[c] for c in _COLUMNS), k.c.hash)).all()
        ruleset = read_rules(conn)
        prices = read_prices(conn)
        people = conn.execute(sa.select(u.c.id, u.c.state, u.c.is_admin)).all()
        threads = conversations.retention(conn)
        notes = memory.retention(conn)
    states = {r.id: r.state for r in people}
    paths = {node.id: node.path for node in tree.of_kind("project")}
    keys = [_entry(row, paths) for row in rows]

    def row(lim: rules.Limits) -> list:
        return [lim.rpm, lim.tpm, lim.budget, lim.period, list(lim.models) if lim.models is not None else None,
                lim.band]

    personal = ruleset.limits.get(("personal", ""))
    # Personal use travels in a field of its own: a gateway of the version before refuses a `limits` row
    # whose scope it does not know, and so the whole message; it lets a field it does not know by.
    return {"revision": revision, "keys": keys,
            **({"personal": [*row(personal), bool(personal.disabled)]} if personal else {}),
            # Likewise the routing profiles: `limits` rows keep the shape the version before reads.
            "profiles": [[scope, sid, lim.profile] for (scope, sid), lim in ruleset.limits.items() if lim.profile],
            "limits": [[scope, sid, *row(lim)] for (scope, sid), lim in ruleset.limits.items() if scope != "personal"],
            "parents": {project: list(up) for project, up in ruleset.parents.items()}, "team_org": ruleset.team_org,
            "prices": [[model, price.input, price.output] for model, price in prices.by_model.items()],
            "suspended": sorted(i for i, state in states.items() if state != "active"),
            "active": sorted(i for i, state in states.items() if state == "active"),
            "admins": sorted(r.id for r in people if r.is_admin and r.state == "active"),
            "threads": [[project, hours] for project, hours in sorted(threads.items())],
            "memory": [[project, hours] for project, hours in sorted(notes.items())]}


def _entry(row, paths: dict[str, str]) -> dict:
    """A key as a `keys` message carries it, from its row (with its hash) and the projects' PATHS. Written out
    rather than through its record and dataclasses.asdict, which deep-copies field by field: two thirds of the
    time at 100,000 keys (bench/keys.py)."""
    return {"hash": row.hash, "id": row.id, "name": row.name, "project_id": row.project_id,
            "project": paths.get(row.project_id, PERSONAL) if row.project_id else PERSONAL, "prefix": row.prefix,
            "created_at": row.created_at, "expires_at": row.expires_at, "revoked_at": row.revoked_at,
            "user_id": row.user_id}


# Identities read a statement: SQLite takes at most 999 variables in one.
CHUNK = 500


def changed_since(engine: Engine, since: int) -> dict | None:
    """What changed in the key set after revision SINCE, as the store holds it now, read at one moment: the
    revision, the keys that changed (as `key_set` gives them), each person who changed ((state, is_admin), or
    None when removed) and each limit ((scope, id) -> rules.Limits, or None when cleared). None where what
    changed is not named (a writer that named nothing, one of the version before, or rows pruned): the set
    is to be read whole. A change costs what it names, not what the set holds (`store.key_log`)."""
    from llmgw.people.limits import from_row
    from llmgw.people.orgtree import Tree

    k, u, lim, log = store.api_keys, store.users, store.limits, store.key_log
    with store.one_moment(engine) as conn:
        revision = store.read_revision(conn, "keys")
        named = conn.execute(sa.select(log.c.revision, log.c.what, log.c.ident)
                             .where(log.c.revision > since, log.c.revision <= revision)).all()
        if len({row.revision for row in named}) != revision - since or any(row.what == "all" for row in named):
            return None
        wanted: dict[str, set[str]] = {"key": set(), "user_keys": set(), "user": set(), "limit": set(), "none": set()}
        for row in named:
            if row.what not in wanted or row.what == "limit" and ":" not in row.ident:
                return None  # a writer of a later version, say: what it names is not known here
            wanted[row.what].add(row.ident)
        paths = {node.id: node.path for node in Tree.read(conn).of_kind("project")}
        columns = (*(k.c[c] for c in _COLUMNS), k.c.hash)
        keys = {}
        for column, idents in ((k.c.id, wanted["key"]), (k.c.user_id, wanted["user_keys"])):
            for chunk in _chunks(idents):
                keys.update((row.id, _entry(row, paths)) for row in conn.execute(sa.select(*columns)
                                                                                 .where(column.in_(chunk))))
        people: dict[str, tuple | None] = dict.fromkeys(wanted["user"])
        for chunk in _chunks(wanted["user"]):
            people.update((row.id, (row.state, bool(row.is_admin)))
                          for row in conn.execute(sa.select(u.c.id, u.c.state, u.c.is_admin).where(u.c.id.in_(chunk))))
        pools: dict[tuple[str, str], rules.Limits | None] = {
            tuple(ident.split(":", 1)): None for ident in wanted["limit"]}  # type: ignore[misc]
        for chunk in _chunks(pools, CHUNK // 2):  # two variables each
            for row in conn.execute(lim.select().where(sa.tuple_(lim.c.scope, lim.c.scope_id).in_(chunk))):
                pools[row.scope, row.scope_id] = from_row(row)
    return {"revision": revision, "keys": list(keys.values()), "people": people, "limits": pools}


def _chunks(items, size: int = CHUNK) -> Iterator[list]:
    items = list(items)
    for start in range(0, len(items), size):
        yield items[start:start + size]


def usable(engine: Engine, secret: str) -> bool:
    """Whether SECRET is a key that works now: known, not revoked, not expired."""
    k = store.api_keys
    with engine.connect() as conn:
        row = conn.execute(sa.select(k.c.revoked_at, k.c.expires_at).where(k.c.hash == hash_secret(secret))).first()
    return row is not None and works(row, time.time())


def works(key, now: float) -> bool:
    """Whether KEY (a record or a row: its `revoked_at` and `expires_at`) is neither revoked nor expired at NOW."""
    return key.revoked_at is None and (key.expires_at is None or key.expires_at > now)
