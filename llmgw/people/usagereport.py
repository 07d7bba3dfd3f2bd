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
    rows = []
    with engine.connect() as conn:
        # SQLite takes at most 500 SELECTs in one compound statement.
        for start in range(0, len(latest), COMPOUND):
            rows += conn.execute(sa.union_all(*latest[start:start + COMPOUND])).all()
    return {key_id: at for key_id, at in rows if at is not None}


COMPOUND = 200  # the most SELECTs last_used joins in one statement


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
           user_id: str | None = None, top: int | None = None) -> Report:
    """Use since SINCE grouped BY org, team, project, person, model or key, per day (per hour for
    two days or less). PROJECT_IDS or USER_ID narrow it (an organisation's page, a person's own).
    With TOP, only the TOP groups that made the most requests are lines of their own; the rest are one
    line, "N others", last. Reads the roll-ups and the raw rows not yet rolled up, never the whole raw
    table, all at one moment."""
    from llmgw.people import rollup
    from llmgw.people.orgtree import Tree

    if by not in BY:
        raise ValueError(f"--by is one of {', '.join(BY)}, not {by!r}")
    now = time.time() if now is None else now
    step = rollup.HOUR if now - since <= 2 * DAY else DAY
    first = since // step * step
    with store.one_moment(engine) as conn:
        sums = _Sums(conn, by, step, first, project_ids, user_id)
        tree = Tree.read(conn)
        names = _names(conn, by)
        set_limits = limits.read_all(conn) if by in BUDGET_SCOPES else {}
        lines: dict[str, Line] = {}
        label_of: dict[str, str] = {}

        def line_of(value: str) -> Line:
            label = label_of.get(value)
            if label is None:
                label = label_of[value] = _label(by, value, tree, names)
            line = lines.get(label)
            if line is None:
                line = lines[label] = Line(label, budget=_budget(by, value, tree, set_limits))
            return line

        others = None
        if top is None:
            for when, value, *figures in sums.read():
                line = line_of(value)
                _add(line, figures)
                _add_series(line, when, figures)
            ranked = sorted(lines.values(), key=lambda x: (-x.requests, x.label))
        else:
            # Each group's totals first, summed by the database: over a month by key, one row a key where its
            # series are a row a key a day (580,000 rows at 50 million requests a year).
            for value, *figures in sums.read(by_bucket=False):
                _add(line_of(value), figures)
            ranked = sorted(lines.values(), key=lambda x: (-x.requests, x.label))
            if len(ranked) > top:
                ranked, rest = ranked[:top], ranked[top:]
                others = Line(f"{len(rest):,} other{'s' if len(rest) > 1 else ''}")
                for line in rest:
                    _add(others, (line.requests, line.errors, line.prompt_tokens, line.completion_tokens,
                                  line.cost_micros))
                # The rest's series: each bucket's whole, less the groups named.
                for when, *figures in sums.read(by_value=False):
                    _add_series(others, when, figures)
            kept = {line.label for line in ranked}
            values = [v for v, label in label_of.items() if label in kept]
            series = sums.read(values=values if others and len(values) <= MOST_NAMED else None)
            for when, value, *figures in series:
                line = line_of(value)
                if line.label in kept:
                    _add_series(line, when, figures)
                    if others is not None:
                        _add_series(others, when, [-(f or 0) for f in figures])
    buckets = [first + i * step for i in range(int((now // step * step - first) // step) + 1)]
    return Report(by, step, buckets, ranked + ([others] if others else []))


# The most values a report names in one query's IN (...): past it (a key report whose first groups include the
# chat page, whose rows carry one value a person), it reads every group's series and keeps those shown.
MOST_NAMED = 1000


class _Sums:
    """A report's sums over its span, from the roll-ups and the raw rows past the watermark, grouped by bucket,
    by the report's column, or both."""

    def __init__(self, conn, by: str, step: int, first: float, project_ids: set[str] | None, user_id: str | None):
        from llmgw.people import rollup

        self.conn = conn
        table = store.usage_hourly if step == rollup.HOUR else store.usage_daily
        column = {"org": "project_id", "team": "project_id", "project": "project_id", "person": "user_id",
                  "model": "model", "key": "key_id"}[by]
        u = store.usage
        self.rolled_when, self.rolled_value = table.c["hour" if step == rollup.HOUR else "day"], table.c[column]
        self.raw_when = rollup.bucket(u.c.at, step)
        self.raw_value = sa.func.coalesce(u.c["model_served" if column == "model" else column], "")
        self.rolled_sums = [sa.func.sum(table.c[c]) for c in rollup.SUMS]
        self.raw_sums = rollup.select_sums(u)
        rolled_where = [self.rolled_when >= first]
        raw_where = [u.c.id > rollup.watermark(conn), u.c.at >= first]
        if project_ids is not None:
            rolled_where.append(table.c.project_id.in_(project_ids))
            raw_where.append(u.c.project_id.in_(project_ids))
        if user_id is not None:
            rolled_where.append(table.c.user_id == user_id)
            raw_where.append(u.c.user_id == user_id)
        self.rolled_where, self.raw_where = rolled_where, raw_where

    def read(self, by_bucket: bool = True, by_value: bool = True, values: list[str] | None = None) -> list:
        """Rows of (bucket?, value?, requests, errors, prompt tokens, completion tokens, cost); VALUES narrows
        them to those groups."""
        out = []
        for when, value, sums, where in ((self.rolled_when, self.rolled_value, self.rolled_sums, self.rolled_where),
                                         (self.raw_when, self.raw_value, self.raw_sums, self.raw_where)):
            keys = [when] * by_bucket + [value] * by_value
            query = sa.select(*keys, *sums).where(*where)
            if values is not None:
                query = query.where(value.in_(values))
            out += self.conn.execute(query.group_by(*keys)).all()
        return out


def _add(line: Line, figures) -> None:
    requests, errors, prompt, completion, cost = figures
    line.requests += int(requests)
    line.errors += int(errors or 0)
    line.prompt_tokens += int(prompt or 0)
    line.completion_tokens += int(completion or 0)
    line.cost_micros += int(cost or 0)


def _add_series(line: Line, when, figures) -> None:
    requests, _errors, prompt, completion, cost = figures
    bucket = line.series.setdefault(float(when), [0, 0, 0])
    bucket[0] += int(requests)
    bucket[1] += int(prompt or 0) + int(completion or 0)
    bucket[2] += int(cost or 0)


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
