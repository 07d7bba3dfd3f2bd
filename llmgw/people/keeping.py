"""What a project keeps of its requests' text, and for how long: its conversations (`llmgw keys threads`) and
its agents' notes (`llmgw keys memory`).

Every project starts keeping nothing. Turning it on takes a retention window in hours, measured from a
thread's last turn, because a store without one keeps everything a team ever typed for as long as nobody
picks a number. Turning it off stops new turns at once (gateways hear of it with the keys, within seconds)
and the hourly sweep deletes what was kept. Each change bumps the keys' revision, so every gateway takes it
with the keys it pushes or reads.
"""

from __future__ import annotations

import logging

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from llmgw import store
from llmgw.people.orgtree import Node, Tree

log = logging.getLogger("llmgw.keeping")

SWEEP_EVERY = 3600.0  # seconds between sweeps (threads.sweep_every)
# The longest window: ten years, past which "how long" means "for ever", which is not offered.
MOST_HOURS = 24 * 3653


class KeepingRefused(Exception):
    """The message says what to do."""


# What a project may keep: the column its hours are in, and the words for it.
KINDS = {"threads": ("threads_hours", "conversations"), "memory": ("memory_hours", "notes")}


def set_threads(engine: Engine, project: str, hours: float | None) -> tuple[Node, float | None]:
    """Keep PROJECT's conversations for HOURS after their last turn (None: keep none); returns the project
    and the hours it kept them for before."""
    return set_keeping(engine, "threads", project, hours)


def set_memory(engine: Engine, project: str, hours: float | None) -> tuple[Node, float | None]:
    """Keep PROJECT's agents' notes for HOURS after each was last written (None: keep none)."""
    return set_keeping(engine, "memory", project, hours)


def set_keeping(engine: Engine, kind: str, project: str, hours: float | None) -> tuple[Node, float | None]:
    if hours is not None and not 0 < hours <= MOST_HOURS:
        raise KeepingRefused(f"--retain-hours must be more than 0 and at most {MOST_HOURS}; got {hours:g}")
    p = store.projects
    column = p.c[KINDS[kind][0]]
    with store.writing(engine) as conn:
        node = Tree.read(conn).find("project", project)
        before = conn.execute(sa.select(column).where(p.c.id == node.id)).scalar()
        if before != hours:
            conn.execute(p.update().where(p.c.id == node.id).values({column: hours}))
            if hours is None or (before is not None and hours < before):
                _shorten(conn, kind, node.id, hours)
            store.bump_revision(conn, "keys")
    return node, before


def _shorten(conn, kind: str, project_id: str, hours: float | None) -> None:
    """A shorter window (or none) is final: what it expires stays expired, whatever window comes later.
    Each thread and note carries the expiry it was written under (llmgw/conversations.py); lower it."""
    import time

    table, since = (store.threads, store.threads.c.last_at) if kind == "threads" else (store.notes,
                                                                                       store.notes.c.updated_at)
    now = time.time()
    ends = sa.literal(now) if hours is None else since + hours * 3600.0
    least = sa.func.min if conn.dialect.name == "sqlite" else sa.func.least
    conn.execute(table.update().where(table.c.scope == project_id).values(expires_at=least(table.c.expires_at, ends)))


def kept(engine: Engine, kind: str = "threads") -> list[tuple[str, float]]:
    """(project path, hours) for every project that keeps KIND (threads, memory)."""
    from llmgw import expiry

    with engine.connect() as conn:
        tree = Tree.read(conn)
        hours = expiry.retention(conn, store.projects.c[KINDS[kind][0]])
    return sorted((tree.by_id[pid].path, h) for pid, h in hours.items() if pid in tree.by_id)


class Sweeper:
    """A thread that deletes, once an hour, the conversations and notes past their project's retention and
    those of projects that stopped keeping them. LEADING says whether to sweep now: with two controllers on one
    store, only the leader does."""

    def __init__(self, engine: Engine, every: float = SWEEP_EVERY, leading=lambda: True):
        import threading

        self.engine = engine
        self.every = every
        self.leading = leading
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="threads-sweep", daemon=True)

    def start(self) -> "Sweeper":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def sweep(self) -> int:
        from llmgw import conversations, memory

        gone = 0
        for module, what in ((conversations, "conversations"), (memory, "notes")):
            with self.engine.connect() as conn:
                hours = module.retention(conn)
            count = module.sweep(self.engine, hours)
            if count:
                log.info("deleted %d %s past their project's retention", count, what)
            gone += count
        return gone

    def _run(self) -> None:
        while not self.stopping.wait(self.every):
            if not self.leading():
                continue
            try:
                self.sweep()
            except Exception:
                log.exception("sweeping kept conversations failed; the next pass tries again")
