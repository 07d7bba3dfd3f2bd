"""People as identity providers know them: who a provider's sign-in is here, and what their groups give them.

A provider names a person by its `sub`, which it never gives to anyone else; that, not the email, is what
signs them in from the second time on (an address can change hands). The first time, a person is found or
made:

- only an address the provider says is verified (or whose addresses the operator trusts, `trust_email`),
  in ASCII, makes an account or links to one, so nobody takes an account, or an address, by writing it into
  a provider profile of their own, before or after its owner comes;
- an account here with that address is linked at once only when no sign-in is linked to it yet (a local
  account); to one that has a sign-in already, or where the provider's `link_existing` is `confirm`, once an
  administrator confirms (the people page, or `llmgw users link`);
- otherwise an account is made, with no password (`accounts.NO_PASSWORD`), approved when its address is at
  one of `approve_domains` or one of its groups is in `approve_groups`, else waiting.

Then, at every sign-in of an approved account, the provider's `[[auth.oidc.map]]` is applied (a groups claim
missing altogether leaves everything as it was, rather than taking everything away): each entry whose group the person is
in gives its place (or the administrator role); what this provider gave before and the groups no longer give
is taken away, keys made there revoked as leaving always does. What an operator gave by hand is never taken
away, and a suspended person stays suspended and is left as they are, whatever the provider says. What
changed is logged and kept on the identity, for the person's page.

Imported by the pages (llmgw/web/oidcpages.py) and the CLI (`llmgw users link`). Runs in one transaction per
sign-in.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import store
from llmgw.people import accounts, memberships
from llmgw.people.orgtree import Tree, TreeError

log = logging.getLogger("llmgw.identities")

MOST_GROUPS = 1000  # a provider sending more is sending something other than a person's groups
MOST_GROUP = 256  # characters of one group's name


@dataclasses.dataclass(frozen=True)
class Claims:
    """What a provider said about a person, its signature and times already checked."""
    provider: str
    subject: str
    email: str
    email_verified: bool
    groups: frozenset[str] | None  # None: the provider said nothing of them this time (not: none)


@dataclasses.dataclass(frozen=True)
class Outcome:
    user: accounts.User | None
    changes: list[str]
    refusal: str | None  # why this sign-in opens no session (the account may still have been made)
    result: str  # signed_in; waiting (for approval, or a link's confirmation); refused


class LinkError(Exception):
    """A link an administrator asked for cannot be made; the message says why."""


def sign_in(engine: Engine, provider: dict, claims: Claims, most_pending: int = 50) -> Outcome:
    """The account CLAIMS sign in to through PROVIDER (an `[[auth.oidc]]` entry), found, linked or made, with
    its groups applied; or why not. MOST_PENDING: accounts that may wait for approval at once
    (`gateway.sign_ups_pending`), past which none is made to wait."""
    i = store.identities
    with store.writing(engine) as conn:
        accounts.one_at_a_time(conn, [("none", "")])  # what it changes is named once done (`store.note_keys`)
        row = conn.execute(i.select().where(sa.and_(i.c.provider == claims.provider,
                                                    i.c.subject == claims.subject))).first()
        if row is None:
            user, refusal, result = _first_time(conn, provider, claims, most_pending)
            if user is None:
                return Outcome(None, [], refusal, result)
        elif row.confirmed_at is None:
            return Outcome(None, [], _awaiting_confirmation(provider, claims), "waiting")
        else:
            user = accounts.get_in(conn, row.user_id)
        if user.state == accounts.SUSPENDED:
            return Outcome(user, [], "Your account is suspended here. Ask an operator.", "refused")
        revoked: list[str] = []
        changes = _apply_groups(conn, provider, claims, user, revoked) if user.state == accounts.ACTIVE else []
        store.note_keys(conn, [("user", user.id)] + [("key", key_id) for key_id in revoked])
        user = accounts.get_in(conn, user.id)
        conn.execute(i.update().where(sa.and_(i.c.provider == claims.provider, i.c.subject == claims.subject))
                     .values(email=claims.email, signed_in_at=time.time(), changes=json.dumps(changes)))
    for change in changes:
        log.info("%s signed in through %s: %s", user.email, claims.provider, change)
    if user.state == accounts.PENDING:
        return Outcome(user, changes, "Your account waits for an operator's approval. You can sign in once it is "
                                      "approved.", "waiting")
    return Outcome(user, changes, None, "signed_in")


def _first_time(conn: Connection, provider: dict, claims: Claims,
                most_pending: int) -> tuple[accounts.User | None, str | None, str]:
    """The account a first sign-in of CLAIMS is, linked or made; or (None, why not, waiting or refused).

    Only an address the provider verified (or whose addresses the operator trusts: `trust_email`), spelt in
    ASCII (Python lowers the Kelvin sign to a `k`, and "\u212aate@" would be kate's), makes an account or
    links to one; and it links at once only to an account no sign-in is linked to yet (a local one):
    otherwise, or where the provider's `link_existing` is `confirm`, the link waits for an administrator. So
    an address someone wrote into their own profile at a provider, before or after its owner came, opens
    nobody's account and takes nobody's address."""
    email = claims.email.strip().lower()
    if not claims.email_verified or not claims.email.isascii():
        log.warning("%r signed in through %s with an address it does not say is verified (or not in ASCII): no "
                    "account made or linked", claims.email, claims.provider)
        return None, (f"{provider['label']} does not say your address is verified, so no account here is made or "
                      "linked for you. Ask an operator."), "refused"
    found = conn.execute(store.users.select().where(store.users.c.email == email)).first()
    now = time.time()
    if found is None:
        approved = email.rsplit("@", 1)[-1] in provider["approve_domains"] \
            or bool((claims.groups or frozenset()) & set(provider["approve_groups"]))
        if not approved and _waiting(conn) >= most_pending:
            return None, ("Sign-in of people new here is paused: too many accounts already wait for approval. Ask an "
                          "operator."), "refused"
        try:
            user = accounts.insert_user(conn, email, accounts.NO_PASSWORD,
                                        accounts.ACTIVE if approved else accounts.PENDING)
        except accounts.AccountError:
            return None, (f"{provider['label']} gave no usable email for you (its {provider['email_claim']} claim "
                          "holds none). Ask an operator."), "refused"
        if approved:
            conn.execute(store.users.update().where(store.users.c.id == user.id)
                         .values(approved_by=f"identity provider {claims.provider}", approved_at=now))
        log.info("%s signed in through %s for the first time: account made, %s", email, claims.provider,
                 user.state)
        _record(conn, claims, user.id, confirmed=True)
        return user, None, "signed_in"
    linked = conn.execute(sa.select(sa.func.count()).select_from(store.identities)
                          .where(store.identities.c.user_id == found.id)).scalar_one()
    confirm = provider["link_existing"] == "confirm" or linked > 0
    _record(conn, claims, found.id, confirmed=not confirm)
    if confirm:
        log.info("%s signed in through %s: a link to the account here waits for an administrator%s", email,
                 claims.provider, " (another sign-in is linked to it already)" if linked else "")
        return None, _awaiting_confirmation(provider, claims), "waiting"
    log.info("%s signed in through %s for the first time: linked to the account here", email, claims.provider)
    return accounts.get_in(conn, found.id), None, "signed_in"


def _waiting(conn: Connection) -> int:
    return conn.execute(sa.select(sa.func.count()).select_from(store.users)
                        .where(store.users.c.state == accounts.PENDING)).scalar_one()


def _awaiting_confirmation(provider: dict, claims: Claims) -> str:
    return (f"An account here already has your address; an administrator must confirm that it is yours before "
            f"you sign in with {provider['label']} (on the people page, or with llmgw users link YOUR-ADDRESS "
            f"--provider {claims.provider}).")


def _record(conn: Connection, claims: Claims, user_id: str, confirmed: bool) -> None:
    now = time.time()
    conn.execute(store.identities.insert().values(provider=claims.provider, subject=claims.subject, user_id=user_id,
                                                  email=claims.email, created_at=now,
                                                  confirmed_at=now if confirmed else None))


def _apply_groups(conn: Connection, provider: dict, claims: Claims, user: accounts.User,
                  revoked: list[str]) -> list[str]:
    """Give USER what PROVIDER's map gives CLAIMS's groups, take back what it gave and they no longer give;
    what changed, in words. The keys revoked with a membership taken back are added to REVOKED."""
    name, entries = claims.provider, provider["map"]
    if claims.groups is None:
        # A groups claim missing (a mapper switched off, Entra's overage) is not "in no group": taking every
        # place away on it would revoke keys over a provider's misconfiguration.
        log.warning("%s signed in through %s without its %s claim: places and roles left as they were",
                    user.email, name, provider["groups_claim"])
        return [f"{provider['label']} did not say your groups ({provider['groups_claim']}); places left as they were"] \
            if entries else []
    tree = Tree.read(conn)
    m = store.memberships
    held = {(r.scope, r.scope_id): r for r in conn.execute(m.select().where(m.c.user_id == user.id))}
    changes: list[str] = []
    wanted: dict[tuple[str, str], str] = {}  # (kind, node id) -> role; a manager entry wins over a member one
    admin = False
    for entry in entries:
        if entry["group"] not in claims.groups:
            continue
        if entry["role"] == "admin":
            admin = True
            continue
        try:
            node = tree.find(entry["kind"], entry["path"])
        except TreeError as e:
            changes.append(f"not added to {entry['kind']} {entry['path']} (group {entry['group']}): {e}")
            continue
        if wanted.get((node.kind, node.id)) != memberships.MANAGER:
            wanted[(node.kind, node.id)] = entry["role"]
    for (kind, node_id), role in wanted.items():
        node, had = tree.by_id[node_id], held.get((kind, node_id))
        if had is None:
            memberships.add(conn, user.id, node, role, source=name)
            changes.append(f"joined {kind} {node.path} as {role}")
        elif had.source == name and had.role != role:
            memberships.add(conn, user.id, node, role, source=name)
            changes.append(f"now {role} of {kind} {node.path}")
    for (kind, node_id), had in held.items():
        if had.source == name and (kind, node_id) not in wanted and node_id in tree.by_id:
            gone = memberships.remove(conn, tree, user.id, tree.by_id[node_id])
            revoked += gone
            changes.append(f"left {kind} {tree.by_id[node_id].path}"
                           + (f" ({len(gone)} key{'s' * (len(gone) != 1)} revoked)" if gone else ""))
    changes += _apply_admin(conn, name, user, admin)
    return changes


def _apply_admin(conn: Connection, name: str, user: accounts.User, admin: bool) -> list[str]:
    """Make USER an administrator when their groups say so; take it back when this provider gave it and they
    no longer do, or the map no longer gives it (never the last active administrator)."""
    users = store.users
    source = conn.execute(sa.select(users.c.admin_source).where(users.c.id == user.id)).scalar()
    if admin and not user.is_admin:
        conn.execute(users.update().where(users.c.id == user.id).values(is_admin=True, admin_source=name))
        return ["became an administrator"]
    if not admin and user.is_admin and source == name:
        try:
            if user.state == accounts.ACTIVE:
                accounts.keep_an_administrator(conn, user)
        except accounts.AccountError:
            return ["still an administrator: nobody else could administer"]
        conn.execute(users.update().where(users.c.id == user.id).values(is_admin=False, admin_source=None))
        return ["no longer an administrator"]
    return []


def changes_of(engine: Engine, user_id: str) -> list[tuple[str, float, list[str]]]:
    """For the person's page: each provider they sign in through, when they last did, and what it changed."""
    i = store.identities
    with engine.connect() as conn:
        rows = conn.execute(sa.select(i.c.provider, i.c.signed_in_at, i.c.changes)
                            .where(sa.and_(i.c.user_id == user_id, i.c.confirmed_at.is_not(None)))).all()
    return [(r.provider, r.signed_in_at, json.loads(r.changes or "[]")) for r in rows]


def of_everyone(engine: Engine, user_ids: set[str] | None = None) -> dict[str, list[dict]]:
    """For the people page: each person's sign-ins through providers (provider, subject, the address it gave,
    confirmed, signed_in_at, changes), by their account's id; only USER_IDS' when given."""
    found: dict[str, list[dict]] = {}
    query = store.identities.select().order_by(store.identities.c.provider)
    if user_ids is not None:
        query = query.where(store.identities.c.user_id.in_(user_ids))
    with engine.connect() as conn:
        for r in conn.execute(query):
            found.setdefault(r.user_id, []).append({
                "provider": r.provider, "subject": r.subject, "email": r.email, "confirmed": r.confirmed_at is not None,
                "signed_in_at": r.signed_in_at, "changes": json.loads(r.changes or "[]")})
    return found


def confirm_link(engine: Engine, which: str, provider: str, subject: str | None = None) -> accounts.User:
    """Confirm that the sign-in through PROVIDER waiting to be linked to WHICH's account is theirs (SUBJECT, the
    provider's id for them, where several wait)."""
    user = accounts.find(engine, which)
    i = store.identities
    waiting = sa.and_(i.c.user_id == user.id, i.c.provider == provider, i.c.confirmed_at.is_(None))
    with store.writing(engine) as conn:
        subjects = [r.subject for r in conn.execute(sa.select(i.c.subject).where(waiting))]
        if not subjects:
            raise LinkError(f"no sign-in through {provider} waits to be linked to {user.email}; it appears once they "
                            f"have signed in with {provider}")
        if subject is None and len(subjects) > 1:
            raise LinkError(f"{len(subjects)} sign-ins through {provider} wait to be linked to {user.email} "
                            f"(subjects {', '.join(subjects[:5])}); say which is theirs with --subject")
        chosen = subject or subjects[0]
        if chosen not in subjects:
            raise LinkError(f"no sign-in through {provider} with subject {chosen!r} waits for {user.email}")
        conn.execute(i.update().where(sa.and_(waiting, i.c.subject == chosen)).values(confirmed_at=time.time()))
    return user
