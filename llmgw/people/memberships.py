"""Who belongs where in the tree, and what that lets them use.

A person may belong to any number of organisations, teams and projects, or
to none (then they use the gateway on their own, with personal keys). A member
of an organisation or team may use every project in it. Leaving revokes the
keys the person made in projects no other membership still reaches.
"""

from __future__ import annotations

import dataclasses
import time

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import store
from llmgw.people import accounts
from llmgw.people.orgtree import Node, Tree, TreeError

MEMBER, MANAGER = "member", "manager"


@dataclasses.dataclass(frozen=True)
class Membership:
    user_id: str
    scope: str
    scope_id: str
    role: str
    path: str


def of_user(conn: Connection, tree: Tree, user_id: str) -> list[Membership]:
    m = store.memberships
    rows = conn.execute(m.select().where(m.c.user_id == user_id)).all()
    return sorted((Membership(r.user_id, r.scope, r.scope_id, r.role, tree.by_id[r.scope_id].path)
                   for r in rows if r.scope_id in tree.by_id), key=lambda x: x.path.lower())


def all_memberships(conn: Connection) -> list:
    return conn.execute(store.memberships.select()).all()


def reachable_projects(conn: Connection, tree: Tree, user_id: str) -> set[str]:
    """The ids of every project USER_ID may use through some membership."""
    found: set[str] = set()
    for membership in of_user(conn, tree, user_id):
        found.update(p.id for p in tree.projects_under(membership.scope_id))
    return found


def join(engine: Engine, who: str, kind: str, which: str, role: str = MEMBER) -> tuple[accounts.User, Membership]:
    """Make WHO a member (or, of an organisation, a manager) of the KIND named WHICH."""
    if role not in (MEMBER, MANAGER):
        raise TreeError(f"a role is {MEMBER} or {MANAGER}, not {role!r}")
    if role == MANAGER and kind != "org":
        raise TreeError("managers are managers of an organisation; join the organisation with --role manager")
    user = accounts.find(engine, who)
    with store.writing(engine) as conn:
        node = Tree.read(conn).find(kind, which)
        add(conn, user.id, node, role)
        store.bump_revision(conn, "keys", [("none", "")])  # gateways hold no memberships
    return user, Membership(user.id, kind, node.id, role, node.path)


def add(conn: Connection, user_id: str, node: Node, role: str, source: str | None = None) -> None:
    """Make USER_ID a ROLE of NODE inside the caller's transaction (which bumps the keys' revision). SOURCE:
    the identity provider whose groups give it, or None for an operator, whose it is from then on (a
    provider takes back only what it gave)."""
    m = store.memberships
    key = sa.and_(m.c.user_id == user_id, m.c.scope == node.kind, m.c.scope_id == node.id)
    if conn.execute(sa.select(m.c.role).where(key)).first():
        conn.execute(m.update().where(key).values(role=role, source=source))
    else:
        conn.execute(m.insert().values(user_id=user_id, scope=node.kind, scope_id=node.id, role=role,
                                       created_at=time.time(), source=source))


def leave(engine: Engine, who: str, kind: str, which: str) -> tuple[Membership, int]:
    """End WHO's membership of the KIND named WHICH; returns it and how many keys were revoked."""
    user = accounts.find(engine, who)
    m = store.memberships
    with store.writing(engine) as conn:
        tree = Tree.read(conn)
        node = tree.find(kind, which)
        key = sa.and_(m.c.user_id == user.id, m.c.scope == kind, m.c.scope_id == node.id)
        if not conn.execute(sa.select(m.c.role).where(key)).first():
            raise TreeError(f"{user.email} is not a member of {node.path}")
        revoked = remove(conn, tree, user.id, node)
        store.bump_revision(conn, "keys", [("key", key_id) for key_id in revoked] or [("none", "")])
    return Membership(user.id, kind, node.id, "", node.path), len(revoked)


def remove(conn: Connection, tree: Tree, user_id: str, node: Node) -> list[str]:
    """End USER_ID's membership of NODE inside the caller's transaction (which bumps the keys' revision), and
    revoke the keys they made in projects no other membership still reaches; the ids of those revoked."""
    m, k = store.memberships, store.api_keys
    conn.execute(m.delete().where(sa.and_(m.c.user_id == user_id, m.c.scope == node.kind, m.c.scope_id == node.id)))
    still = reachable_projects(conn, tree, user_id)
    lost = [p.id for p in tree.projects_under(node.id) if p.id not in still]
    if not lost:
        return []
    mine = sa.and_(k.c.project_id.in_(lost), k.c.made_by == user_id, k.c.revoked_at.is_(None))
    # One statement returning what it revoked, so the keys named to gateways (key_log) are exactly those.
    return list(conn.execute(k.update().where(mine).values(revoked_at=time.time()).returning(k.c.id)).scalars())


def managed_orgs(conn: Connection, user_id: str) -> list[str]:
    m = store.memberships
    return [r[0] for r in conn.execute(sa.select(m.c.scope_id).where(sa.and_(
        m.c.user_id == user_id, m.c.scope == "org", m.c.role == MANAGER)))]
