"""Reading usage back for people: when each key was last used, and reports over any span.

`last_used` goes through the `usage_key_at` index (key, time). Reports read the
hourly and daily roll-ups (see `rollup`) plus the raw rows not yet rolled up,
so a report costs the same over ten rows or ten million.
"""

from __future__ import annotations

import dataclasses
import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from llmgw import store
from llmgw.people import limits

DAY = 86400


def last_used(engine: Engine, key_ids: list[str]) -> dict[str, float]:
    """key id -> when it last made a request (absent: never). Each key's latest row is one step down the
    `usage_key_at` index; grouping the keys' rows instead read every row of each (a busy key's millions)."""
    if not key_ids:
        return {}
    u = store.usage
    latest = [sa.select(sa.literal(key_id, sa.String), sa.select(sa.func.max(u.c.at))
                        .where(u.c.key_id == key_id).scalar_subquery()) for key_id in key_ids]
    with engine.connect() as conn:
        rows = conn.execute(sa.union_all(*latest)).all()
    return {key_id: at for key_id, at in rows if at is not None}


# --- reports over roll-ups -------------------------------------------------------------------------

BY = ("org", "team", "project", "person", "model", "key")


@dataclasses.dataclass
class Line:
    """One group's use over a report's span: totals and one figure per bucket."""
    label: str
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0
    series: dict = dataclasses.field(default_factory=dict)  # bucket start -> [requests, tokens, cost]
    # The budget this row's own level sets, (micro-units, "day" or "month"), and None where it sets none:
    # an organisation's budget printed beside each of its teams would read as each team's.
    budget: tuple[int, str] | None = None

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclasses.dataclass
class Report:
    by: str
    step: int  # seconds per bucket
    buckets: list[float]
    lines: list[Line]


def report(engine: Engine, by: str, since: float, now: float | None = None, project_ids: set[str] | None = None,
           user_id: str | None = None) -> Report:
    """Use since SINCE grouped BY org, team, project, person, model or key, per day (per hour for
    two days or less). PROJECT_IDS or USER_ID narrow it (an organisation's page, a person's own).
    Reads the roll-ups and the raw rows not yet rolled up, never the whole raw table."""
    from llmgw.people import rollup
    from llmgw.people.orgtree import Tree

    if by not in BY:
        raise ValueError(f"--by is one of {', '.join(BY)}, not {by!r}")
    now = time.time() if now is None else now
    step = rollup.HOUR if now - since <= 2 * DAY else DAY
    table = store.usage_hourly if step == rollup.HOUR else store.usage_daily
    first = since // step * step
    column = {"org": "project_id", "team": "project_id", "project": "project_id", "person": "user_id",
              "model": "model", "key": "key_id"}[by]
    u = store.usage
    with engine.connect() as conn:
        mark = rollup.watermark(conn)
        bucket_col = table.c["hour" if step == rollup.HOUR else "day"]
        rolled = sa.select(bucket_col, table.c[column], sa.func.sum(table.c.requests), sa.func.sum(table.c.errors),
                           sa.func.sum(table.c.prompt_tokens), sa.func.sum(table.c.completion_tokens),
                           sa.func.sum(table.c.cost_micros)).where(bucket_col >= first)
        raw_when = rollup.bucket(u.c.at, step)
        raw_key = sa.func.coalesce(u.c["model_served" if column == "model" else column], "")
        raw = sa.select(raw_when, raw_key, *rollup.select_sums(u)).where(u.c.id > mark, u.c.at >= first)
        if project_ids is not None:
            rolled = rolled.where(table.c.project_id.in_(project_ids))
            raw = raw.where(u.c.project_id.in_(project_ids))
        if user_id is not None:
            rolled = rolled.where(table.c.user_id == user_id)
            raw = raw.where(u.c.user_id == user_id)
        rows = conn.execute(rolled.group_by(bucket_col, table.c[column])).all()
        rows += conn.execute(raw.group_by(raw_when, raw_key)).all()
        tree = Tree.read(conn)
        names = _names(conn, by)
        set_limits = limits.read_all(conn) if by in BUDGET_SCOPES else {}
    lines: dict[str, Line] = {}
    for when, value, requests, errors, prompt, completion, cost in rows:
        label = _label(by, value, tree, names)
        line = lines.get(label)
        if line is None:
            line = lines[label] = Line(label, budget=_budget(by, value, tree, set_limits))
        line.requests += int(requests)
        line.errors += int(errors or 0)
        line.prompt_tokens += int(prompt or 0)
        line.completion_tokens += int(completion or 0)
        line.cost_micros += int(cost or 0)
        figures = line.series.setdefault(float(when), [0, 0, 0])
        figures[0] += int(requests)
        figures[1] += int(prompt or 0) + int(completion or 0)
        figures[2] += int(cost or 0)
    buckets = [first + i * step for i in range(int((now // step * step - first) // step) + 1)]
    return Report(by, step, buckets, sorted(lines.values(), key=lambda x: (-x.requests, x.label)))


# The limits' scope of each grouping that is one, and so may set a budget of its own.
BUDGET_SCOPES = {"org": "org", "team": "team", "project": "project", "person": "user", "key": "key"}


def _budget(by: str, value: str, tree, set_limits: dict) -> tuple[int, str] | None:
    """The budget the level a row stands for sets itself: the row's project's organisation or team for those
    groupings (a row is a whole org or team), the person or key itself for the others."""
    scope = BUDGET_SCOPES.get(by)
    if scope is None or not value:
        return None
    scope_id = value
    if by in ("org", "team"):
        node = tree.by_id.get(value)
        while node is not None and node.kind != by:
            node = tree.by_id.get(node.parent_id)
        if node is None:
            return None
        scope_id = node.id
    own = set_limits.get((scope, scope_id))
    return (own.budget, own.period or "month") if own is not None and own.budget is not None else None


def _names(conn, by: str) -> dict[str, str]:
    if by == "person":
        return {r[0]: r[1] for r in conn.execute(sa.select(store.users.c.id, store.users.c.email))}
    if by == "key":
        return {r[0]: r[1] for r in conn.execute(sa.select(store.api_keys.c.id, store.api_keys.c.name))}
    return {}


def _label(by: str, value: str, tree, names: dict[str, str]) -> str:
    if by in ("org", "team", "project"):
        if not value:
            return "(personal and chat)"
        node = tree.by_id.get(value)
        if node is None:
            return f"(removed project {value})"
        parts = node.path.split("/")
        return "/".join(parts[:{"org": 1, "team": 2, "project": 3}[by]])
    if by in ("person", "key"):
        if value.startswith("session:"):
            return "(chat page)"
        return names.get(value, value or "(nobody)")
    return value or "(none)"
