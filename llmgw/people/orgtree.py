"""The organisation tree: organisations hold teams, teams hold projects.

Anything in it is named by its id, by its path (`Acme/platform/gateway`), or
by its bare name when no other thing of its kind has that name. Names are
unique among siblings only. Only empty things are removed, and a project that
ever had a key never is: its usage history refers to it, so it is renamed
instead.
"""

from __future__ import annotations

import dataclasses
import time

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import store
from llmgw.ids import new_id

KINDS = ("org", "team", "project")
_TABLE = {"org": store.orgs, "team": store.teams, "project": store.projects}
_PARENT = {"team": ("org", "org_id"), "project": ("team", "team_id")}
_WORD = {"org": "organisation", "team": "team", "project": "project"}
MAX_NAME = 100


class TreeError(Exception):
    """A change to the tree refused, or a name that does not say which thing; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Node:
    kind: str
    id: str
    name: str
    parent_id: str | None
    path: str


class Tree:
    """The whole tree as read in one go: small (hundreds of nodes), so every lookup is in memory."""

    def __init__(self, rows: dict[str, list]):
        self.by_id: dict[str, Node] = {}
        self.children: dict[str | None, list[Node]] = {}
        for org in rows["org"]:
            self._add(Node("org", org.id, org.name, None, org.name))
        for team in rows["team"]:
            self._add(Node("team", team.id, team.name, team.org_id, f"{self.by_id[team.org_id].path}/{team.name}"))
        for project in rows["project"]:
            parent = self.by_id[project.team_id]
            self._add(Node("project", project.id, project.name, project.team_id, f"{parent.path}/{project.name}"))

    def _add(self, node: Node) -> None:
        self.by_id[node.id] = node
        self.children.setdefault(node.parent_id, []).append(node)

    @classmethod
    def read(cls, conn: Connection) -> "Tree":
        return cls({kind: conn.execute(_TABLE[kind].select().order_by(_TABLE[kind].c.name)).all()
                    for kind in KINDS})

    @classmethod
    def load(cls, engine: Engine) -> "Tree":
        with engine.connect() as conn:
            return cls.read(conn)

    def of_kind(self, kind: str) -> list[Node]:
        return sorted((n for n in self.by_id.values() if n.kind == kind), key=lambda n: n.path.lower())

    def find(self, kind: str, which: str) -> Node:
        """The KIND named WHICH: an id, a path, or a name no other KIND has."""
        which = which.strip().strip("/")
        node = self.by_id.get(which)
        if node is not None and node.kind == kind:
            return node
        matches = [n for n in self.by_id.values() if n.kind == kind and (n.path == which or n.name == which)]
        exact = [n for n in matches if n.path == which]
        if exact:
            return exact[0]
        if len(matches) == 1:
            return matches[0]
        word = _WORD[kind]
        if matches:
            paths = ", ".join(sorted(n.path for n in matches))
            raise TreeError(f"{len(matches)} {word}s are called {which!r} ({paths}); name one by its path")
        known = ", ".join(n.path for n in self.of_kind(kind)[:10]) or "none yet"
        raise TreeError(f"no {word} {which!r}; {word}s: {known}")

    def projects_under(self, node_id: str) -> list[Node]:
        node = self.by_id[node_id]
        if node.kind == "project":
            return [node]
        return [p for child in self.children.get(node_id, []) for p in self.projects_under(child.id)]


def _a(kind: str) -> str:
    return ("an " if kind == "org" else "a ") + _WORD[kind]


def _check_name(kind: str, name: str) -> str:
    name = name.strip()
    if not name or "/" in name or len(name) > MAX_NAME:
        raise TreeError(f"{_a(kind)} name is 1 to {MAX_NAME} characters without '/', not {name!r}")
    if sum(1 for c in name if c.isprintable()) != len(name):
        raise TreeError(f"{_a(kind)} name cannot hold control characters")
    return name


def _sibling_taken(tree: Tree, kind: str, parent_id: str | None, name: str, but: str | None = None) -> bool:
    return any(n.kind == kind and n.name == name and n.id != but for n in tree.children.get(parent_id, []))


def add(engine: Engine, kind: str, name: str, parent: str | None = None) -> Node:
    """Add an organisation, or a team in PARENT (an organisation), or a project in PARENT (a team)."""
    name = _check_name(kind, name)
    with store.writing(engine) as conn:
        tree = Tree.read(conn)
        values = {"id": new_id(), "name": name, "created_at": time.time()}
        parent_node = None
        if kind in _PARENT:
            parent_kind, column = _PARENT[kind]
            if not parent:
                raise TreeError(f"say where the {_WORD[kind]} goes: --in {'ORG' if kind == 'team' else 'ORG/TEAM'}")
            parent_node = tree.find(parent_kind, parent)
            values[column] = parent_node.id
        parent_id = parent_node.id if parent_node else None
        if _sibling_taken(tree, kind, parent_id, name):
            where = f" in {parent_node.path}" if parent_node else ""
            raise TreeError(f"there is already {_a(kind)} {name!r}{where}")
        conn.execute(_TABLE[kind].insert().values(**values))
        store.bump_revision(conn, "keys")
    path = f"{parent_node.path}/{name}" if parent_node else name
    return Node(kind, values["id"], name, parent_id, path)


def rename(engine: Engine, kind: str, which: str, new_name: str) -> Node:
    new_name = _check_name(kind, new_name)
    with store.writing(engine) as conn:
        tree = Tree.read(conn)
        node = tree.find(kind, which)
        if _sibling_taken(tree, kind, node.parent_id, new_name, but=node.id):
            raise TreeError(f"there is already {_a(kind)} {new_name!r} beside {node.path}")
        conn.execute(_TABLE[kind].update().where(_TABLE[kind].c.id == node.id).values(name=new_name))
        store.bump_revision(conn, "keys")
    return dataclasses.replace(node, name=new_name, path=node.path.rsplit("/", 1)[0] + "/" + new_name
                               if "/" in node.path else new_name)


def move(engine: Engine, kind: str, which: str, to: str) -> Node:
    """Move a team to another organisation, or a project to another team; its keys and limits go with it."""
    if kind not in _PARENT:
        raise TreeError("an organisation has nothing above it to move to; rename it instead")
    parent_kind, column = _PARENT[kind]
    with store.writing(engine) as conn:
        tree = Tree.read(conn)
        node = tree.find(kind, which)
        target = tree.find(parent_kind, to)
        if _sibling_taken(tree, kind, target.id, node.name, but=node.id):
            raise TreeError(f"{target.path} already has {_a(kind)} {node.name!r}; rename one first")
        conn.execute(_TABLE[kind].update().where(_TABLE[kind].c.id == node.id).values(**{column: target.id}))
        store.bump_revision(conn, "keys")
    return dataclasses.replace(node, parent_id=target.id, path=f"{target.path}/{node.name}")


def remove(engine: Engine, kind: str, which: str) -> Node:
    """Remove an empty thing: nothing under it, nobody in it, and (a project) never a key."""
    with store.writing(engine) as conn:
        tree = Tree.read(conn)
        node = tree.find(kind, which)
        inside = tree.children.get(node.id, [])
        if inside:
            raise TreeError(f"{node.path} is not empty: it holds {', '.join(n.name for n in inside[:5])}; "
                            "move or remove those first")
        if kind == "project":
            k = store.api_keys
            if conn.execute(sa.select(sa.func.count()).where(k.c.project_id == node.id)).scalar():
                raise TreeError(f"{node.path} has had keys, and its usage history refers to it; "
                                "it is never removed. Rename it instead.")
        m = store.memberships
        members = conn.execute(sa.select(sa.func.count()).where(
            sa.and_(m.c.scope == kind, m.c.scope_id == node.id))).scalar()
        if members:
            raise TreeError(f"{node.path} still has {members} member(s); remove them first")
        conn.execute(store.limits.delete().where(store.limits.c.scope_id == node.id))
        conn.execute(_TABLE[kind].delete().where(_TABLE[kind].c.id == node.id))
        store.bump_revision(conn, "keys")
    return node
