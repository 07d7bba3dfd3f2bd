"""Limits and prices as the store keeps them: reading, setting (every change logged) and the change log.

What a limit means, and how the chain of levels a key is held to is worked
out, is `llmgw.rules`; this module is its store half.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import rules, settings, store
from llmgw.rules import BANDS, FIELDS, PERIODS, SCOPES, LimitError, Limits, Price, Prices, Rules, parse_money

# What the store's columns hold: a longer model name or scope id was refused by PostgreSQL (a 500).
LONGEST_MODEL = store.prices.c.model.type.length
LONGEST_SCOPE_ID = store.limits.c.scope_id.type.length

# --- prices ----------------------------------------------------------------------------------

def read_prices(conn: Connection) -> Prices:
    return Prices({r.model: Price(r.input_micros, r.output_micros) for r in conn.execute(store.prices.select())})


def set_price(engine: Engine, model: str, input_units: str, output_units: str, who: str) -> Price:
    if not model or len(model) > LONGEST_MODEL:
        raise LimitError(f"a price is for a model named in 1 to {LONGEST_MODEL} characters, or * for every model")
    price = Price(parse_money(input_units, "the input price"), parse_money(output_units, "the output price"))
    p = store.prices
    with store.writing(engine) as conn:
        old = conn.execute(p.select().where(p.c.model == model)).first()
        values = dict(input_micros=price.input, output_micros=price.output, updated_at=time.time())
        if old:
            conn.execute(p.update().where(p.c.model == model).values(**values))
        else:
            conn.execute(p.insert().values(model=model, **values))
        conn.execute(store.limit_changes.insert().values(
            at=time.time(), who=who, scope="price", scope_id=model[:32], field="price",
            old=f"{old.input_micros}/{old.output_micros}" if old else None, new=f"{price.input}/{price.output}"))
        store.bump_revision(conn, "keys")
    return price


def from_row(row) -> Limits:
    return Limits(row.rpm, row.tpm, row.budget_micros, row.period,
                  tuple(json.loads(row.models)) if row.models else None, row.band, row.disabled or None,
                  row.profile)


# Scopes set one a person or a key: a million of them at most, which a page showing a few must not read.
OWN_SCOPES = ("user", "key")
# Scopes above people and keys: the cluster's and the tree's, as many as its places.
ABOVE = ("cluster", "personal", *rules.TREE_SCOPES)


def read_all(conn: Connection, own: Iterable[tuple[str, str]] | None = None) -> dict[tuple[str, str], Limits]:
    """Every limit set; with OWN, of people's and keys' own limits only those named in it."""
    query = store.limits.select()
    if own is not None:
        c = store.limits.c
        named = sorted({pair for pair in own if pair[0] in OWN_SCOPES})
        kept = c.scope.not_in(OWN_SCOPES)
        query = query.where(sa.or_(kept, sa.tuple_(c.scope, c.scope_id).in_(named)) if named else kept)
    return {(r.scope, r.scope_id): from_row(r) for r in conn.execute(query)}


def first_below(conn: Connection, n: int) -> tuple[list[tuple[str, str]], int]:
    """The first N limits set below the tree's places (each member's of a place, a person's, a key's) by scope and
    id, on the table's key, and how many there are."""
    c = store.limits.c
    below = c.scope.not_in(ABOVE)
    first = [(r.scope, r.scope_id) for r in conn.execute(
        sa.select(c.scope, c.scope_id).where(below).order_by(c.scope, c.scope_id).limit(n))]
    return first, conn.execute(sa.select(sa.func.count()).select_from(store.limits).where(below)).scalar_one()


def validate(changes: dict) -> dict:
    """Check the fields of CHANGES (rpm, tpm, budget in micro-units, period, models, band); None clears one."""
    out = {}
    for name, value in changes.items():
        if name not in FIELDS:
            raise LimitError(f"there is no limit called {name!r}; limits are {', '.join(FIELDS)}")
        if value is None:
            out[name] = None
        elif name in ("rpm", "tpm", "budget"):
            largest = rules.LARGEST_AMOUNT * rules.MICROS if name == "budget" else rules.LARGEST_COUNT
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= largest:
                raise LimitError(f"{name} is a whole number from 0 to {largest:,}, not {value!r}")
            out[name] = value
        elif name == "period":
            if value not in PERIODS:
                raise LimitError(f"a budget's period is {' or '.join(PERIODS)}, not {value!r}")
            out[name] = value
        elif name == "disabled":
            if value is not True:
                raise LimitError(f"disabled is true (personal use turned off) or cleared, not {value!r}")
            out[name] = value
        elif name == "profile":
            try:
                settings.check_profile_name(value, "a routing profile")
            except ValueError as e:
                raise LimitError(str(e)) from None
            out[name] = value
        elif name == "band":
            if value not in BANDS:
                raise LimitError(f"an admission band is {', '.join(BANDS)}, not {value!r}")
            out[name] = value
        else:
            models = tuple(sorted({str(m).strip() for m in value if str(m).strip()}))
            out[name] = models
    return out


def set_limits(engine: Engine, scope: str, scope_id: str, who: str, **changes) -> Limits:
    """Change some fields of SCOPE/SCOPE_ID's limits (None clears one); every change is logged."""
    if scope not in SCOPES:
        raise LimitError(f"a scope is one of {', '.join(SCOPES)}, not {scope!r}")
    if len(scope_id) > LONGEST_SCOPE_ID:
        raise LimitError(f"no {scope} has an id that long: ids are at most {LONGEST_SCOPE_ID} characters")
    if scope in ("cluster", "personal") and scope_id:
        raise LimitError(f"the {scope} scope has no id: it is one for the whole cluster")
    changes = validate(changes)
    if changes.get("profile") and scope == "cluster":
        raise LimitError("the cluster's routing profile is routing.default_profile in each gateway's configuration, "
                         "below a model's own; set a profile on an organisation, team, project, person or key")
    if changes.get("disabled") and scope != "personal":
        raise LimitError("only personal use can be turned off (--scope personal); to stop a project, revoke its "
                         "keys or allow it no model")
    t = store.limits
    where = sa.and_(t.c.scope == scope, t.c.scope_id == scope_id)
    with store.writing(engine) as conn:
        row = conn.execute(t.select().where(where)).first()
        before = from_row(row) if row else Limits()
        after = dataclasses.replace(before, **changes)
        if after.budget is not None and after.period is None:
            after = dataclasses.replace(after, period="month")
        now = time.time()
        for name in FIELDS:
            old, new = getattr(before, name), getattr(after, name)
            if old != new:
                conn.execute(store.limit_changes.insert().values(
                    at=now, who=who, scope=scope, scope_id=scope_id, field=name,
                    old=None if old is None else json.dumps(old), new=None if new is None else json.dumps(new)))
        values = dict(rpm=after.rpm, tpm=after.tpm, budget_micros=after.budget, period=after.period,
                      models=json.dumps(list(after.models)) if after.models is not None else None,
                      band=after.band, disabled=after.disabled, profile=after.profile, updated_at=now)
        if after.empty():
            conn.execute(t.delete().where(where))
        elif row:
            conn.execute(t.update().where(where).values(**values))
        else:
            conn.execute(t.insert().values(scope=scope, scope_id=scope_id, **values))
        store.bump_revision(conn, "keys", [("limit", f"{scope}:{scope_id}")])
    return after


def personal_off(conn: Connection) -> bool:
    """Whether personal use is turned off: no personal keys, no chat on one's own."""
    t = store.limits
    return bool(conn.execute(sa.select(t.c.disabled).where(sa.and_(t.c.scope == "personal", t.c.scope_id == ""))
                             ).scalar())


def changes_log(conn: Connection, limit: int = 50) -> list:
    c = store.limit_changes
    return conn.execute(c.select().order_by(c.c.id.desc()).limit(limit)).all()



def read_rules(conn: Connection, own: Iterable[tuple[str, str]] | None = None) -> Rules:
    """The tree, the limits and the memberships as they are now, to resolve principals from; with OWN, of people's
    and keys' own limits only those named in it (`read_all`)."""
    t, p = store.teams, store.projects
    parents = {r[0]: (r[1], r[2]) for r in conn.execute(
        sa.select(p.c.id, p.c.team_id, t.c.org_id).join(t, t.c.id == p.c.team_id))}
    return Rules(read_all(conn, own), parents, {r[0]: r[1] for r in conn.execute(sa.select(t.c.id, t.c.org_id))})
