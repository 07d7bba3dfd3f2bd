"""What the people page reads, at any size: a page of accounts, and the first few keys and members of each place.

The page once read every account, membership, key and sign-in, and offered every place in a list on every
account's row: at 3,000 keys it was 4.6 MB, and it grew with the keys times nothing (bench/keys.py). Here
each read is bounded by what one page shows, and says how many more there are, so the page can say where
to see them (`llmgw keys list --project`, the next page).
"""

from __future__ import annotations

import dataclasses

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from llmgw import store
from llmgw.people import accounts

ACCOUNTS_PAGE = 50  # accounts in one page of the table
FIRST = 10  # keys and members shown in each place; the rest are counted


@dataclasses.dataclass(frozen=True)
class Shown:
    """The first few of something, and how many there are in all."""
    items: list
    total: int

    @property
    def more(self) -> int:
        return self.total - len(self.items)


def accounts_page(conn: Connection, search: str = "", after: str = "",
                  limit: int = ACCOUNTS_PAGE) -> tuple[list[accounts.User], int, str | None]:
    """The accounts whose email contains SEARCH, by email, after the email AFTER: at most LIMIT, how many match
    in all, and the email the next page begins after (None on the last)."""
    u = store.users
    matching = u.c.email.contains(search, autoescape=True) if search else sa.true()
    total = conn.execute(sa.select(sa.func.count()).select_from(u).where(matching)).scalar_one()
    rows = conn.execute(u.select().where(matching, u.c.email > after).order_by(u.c.email).limit(limit + 1)).all()
    page = [accounts.row_of(r) for r in rows[:limit]]
    return page, total, page[-1].email if len(rows) > limit else None


def _first_of_each(conn: Connection, table: sa.Table, column, order, ids: set[str], n: int, where=None) -> dict:
    """The first N rows of TABLE (by ORDER) for each value of COLUMN among IDS, with how many there are:
    {id: Shown(rows, total)}. One query, read in pieces of ids the drivers take."""
    out: dict[str, Shown] = {}
    ids = sorted(ids)
    for start in range(0, len(ids), 500):
        chunk = ids[start:start + 500]
        numbered = sa.select(table, sa.func.row_number().over(partition_by=column, order_by=order).label("n"),
                             sa.func.count().over(partition_by=column).label("total")) \
            .where(column.in_(chunk), where if where is not None else sa.true()).subquery()
        for row in conn.execute(sa.select(numbered).where(numbered.c.n <= n).order_by(numbered.c.n)):
            key = getattr(row, column.name)
            shown = out.setdefault(key, Shown([], row.total))
            shown.items.append(row)
    return out


def first_keys(conn: Connection, project_ids: set[str], now: float, n: int = FIRST) -> dict[str, Shown]:
    """Each project's first N keys that work at NOW (by when they were made) and how many it has, as `llmgw keys
    list --project` counts them."""
    k = store.api_keys
    working = sa.and_(k.c.revoked_at.is_(None), sa.or_(k.c.expires_at.is_(None), k.c.expires_at > now))
    return _first_of_each(conn, k, k.c.project_id, (k.c.created_at, k.c.id), project_ids, n, working)


def first_members(conn: Connection, node_ids: set[str], n: int = FIRST) -> dict[str, Shown]:
    """Each place's first N members (by when they joined) and how many it has."""
    m = store.memberships
    return _first_of_each(conn, m, m.c.scope_id, (m.c.created_at, m.c.user_id), node_ids, n)


def emails_in_state(conn: Connection, state: str, most: int) -> list[str] | None:
    """The emails of every account in STATE, by email; None when there are more than MOST."""
    u = store.users
    found = conn.execute(sa.select(u.c.email).where(u.c.state == state).order_by(u.c.email).limit(most + 1)).scalars()
    found = list(found)
    return None if len(found) > most else found


def emails_of(conn: Connection, user_ids: set[str]) -> dict[str, str]:
    u = store.users
    ids = sorted(i for i in user_ids if i)
    out = {}
    for start in range(0, len(ids), 500):
        out.update(conn.execute(sa.select(u.c.id, u.c.email).where(u.c.id.in_(ids[start:start + 500]))).all())
    return out
