"""Usage roll-ups: raw rows summed per hour and per day, and raw rows kept only as long as asked.

The controller rolls up every minute. Each pass takes the raw rows past a
watermark (the last usage id rolled), sums them per hour and per day by key,
project, person and model, adds those sums into `usage_hourly` and
`usage_daily`, and moves the watermark, all in one transaction (a million rows
at most; a longer backlog takes several): a step that fails leaves nothing
half-counted, and two controllers cannot count a row twice. The database makes
and adds the sums itself (INSERT ... SELECT ... ON CONFLICT). Rows younger
than a minute wait for the next pass, so a batch a gateway is still writing is
not split across the watermark.

Reports read the roll-ups plus the few raw rows past the watermark, so they
are exact whether or not the roller has run lately, and cost the same over ten
rows or ten million.
"""

from __future__ import annotations

import logging
import time

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import store

log = logging.getLogger("llmgw.rollup")

SETTLE = 60.0  # seconds a raw row waits before it is rolled up
HOUR, DAY = 3600, 86400
WATERMARK = "usage_rolled"
BUCKETS = ((store.usage_hourly, "hour", HOUR), (store.usage_daily, "day", DAY))
DELETE_BATCH = 50_000


def bucket(column, seconds: int):
    return sa.func.floor(column / seconds) * seconds


def watermark(conn: Connection, lock: bool = False) -> int:
    """The last usage id rolled up (0 before the first pass). LOCK holds it for this transaction on
    PostgreSQL; the row is made when missing only then, by the roller, so readers never write."""
    r = store.revisions
    query = sa.select(r.c.value).where(r.c.name == WATERMARK)
    if lock and conn.dialect.name == "postgresql":
        query = query.with_for_update()
    value = conn.execute(query).scalar()
    if value is None and lock:
        conn.execute(r.insert().values(name=WATERMARK, value=0))
    return value or 0


def spend_since(conn: Connection, start: float) -> list[tuple[str | None, str | None, str | None, int]]:
    """(key, project, person, micro-units) spent since START, a day's start: from the daily roll-ups
    and the raw rows past the watermark, so it costs the same over a day or a month of requests."""
    d, u = store.usage_daily, store.usage
    rolled = conn.execute(sa.select(d.c.key_id, d.c.project_id, d.c.user_id, sa.func.sum(d.c.cost_micros))
                          .where(d.c.day >= start, d.c.cost_micros > 0)
                          .group_by(d.c.key_id, d.c.project_id, d.c.user_id)).all()
    tail = conn.execute(sa.select(u.c.key_id, u.c.project_id, u.c.user_id, sa.func.sum(u.c.cost_micros))
                        .where(u.c.id > watermark(conn), u.c.at >= start, u.c.cost_micros > 0)
                        .group_by(u.c.key_id, u.c.project_id, u.c.user_id)).all()
    return [(k or None, p or None, who or None, int(cost)) for k, p, who, cost in rolled + tail]


SUMS = ("requests", "errors", "prompt_tokens", "completion_tokens", "cost_micros")
# Raw rows a transaction at most: a long backlog (a store upgraded from before roll-ups, a roller stopped for
# weeks) is caught up in steps that each commit, instead of one transaction over millions of rows.
CHUNK = 1_000_000


def _insert(conn: Connection):
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


def select_sums(u: sa.Table) -> list:
    """The sums a roll-up keeps of raw rows, in SUMS' order."""
    return [sa.func.count(), sa.func.sum(sa.case((u.c.status >= 400, 1), else_=0)),
            sa.func.coalesce(sa.func.sum(u.c.prompt_tokens), 0), sa.func.coalesce(sa.func.sum(u.c.completion_tokens), 0),
            sa.func.coalesce(sa.func.sum(u.c.cost_micros), 0)]


def add_sums(conn: Connection, table: sa.Table, column: str, seconds: int, start: int, end: int) -> None:
    """Add the sums of the raw rows START < id <= END into TABLE's buckets of SECONDS, in the database: the rows
    never come to this process. (They did once: a pass over 100,000 rows held a dict a group and took 42 s, most
    of it sending the groups back one by one; a year of rows would not have fitted in memory.)"""
    u = store.usage
    when = bucket(u.c.at, seconds)
    keys = [sa.func.coalesce(u.c[c], "") for c in ("key_id", "project_id", "user_id", "model_served")]
    sums = select_sums(u)
    query = sa.select(when, *keys, *sums).where(u.c.id > start, u.c.id <= end).group_by(when, *keys)
    stmt = _insert(conn)(table).from_select([column, "key_id", "project_id", "user_id", "model", *SUMS], query)
    stmt = stmt.on_conflict_do_update(index_elements=[c.name for c in table.primary_key.columns],
                                      set_={c: table.c[c] + stmt.excluded[c] for c in SUMS})
    conn.execute(stmt)


def roll_up(engine: Engine, now: float | None = None, going_on=lambda: True) -> int:
    """Roll up every raw row a minute old or more, a transaction per CHUNK rows, while GOING_ON() says so
    between them (a long backlog takes minutes); returns how many it counted."""
    now = time.time() if now is None else now
    counted = 0
    while True:
        rows, more = _step(engine, now)
        counted += rows
        if not more or not going_on():
            return counted


# Seconds the roller waits for gateways' usage flushes still open; gateways' new flushes wait behind it meanwhile,
# so one gateway stuck in a transaction must not hold the rest for longer.
WRITERS_WAIT = 5.0
# Seconds the roller's client may fall silent while it holds the writers' lock alone, before the server ends its
# session: a controller paused there (SIGSTOP, a frozen virtual machine) would hold every gateway's flush.
HELD_SILENT = 10.0


class FlushesOpen(Exception):
    """A gateway's usage flush stayed open past WRITERS_WAIT: the next pass tries again."""


def _last_committed(engine: Engine, conn: Connection, start: int, now: float) -> int | None:
    """The last id past START of a row a minute old, read when every row with a lower id is committed. On
    PostgreSQL ids are given out at insert and rows seen at commit, so a gateway's flush still open (a store
    slow after an outage, every gateway writing its backlog at once) can hold ids below one already seen;
    rolled up past, its rows would never be counted. Gateways write under a shared lock this takes alone, in
    a transaction of its own: it waits for the flushes open, and a flush begun after it gets higher ids. On
    SQLite CONN's transaction holds the one write lock: no flush is open."""
    u = store.usage
    query = sa.select(sa.func.max(u.c.id)).where(u.c.id > start, u.c.at < now - SETTLE)
    if conn.dialect.name != "postgresql":
        return conn.execute(query).scalar()
    with engine.begin() as apart:
        store.bounded(apart, WRITERS_WAIT, silent=HELD_SILENT)
        try:
            apart.execute(sa.select(sa.func.pg_advisory_xact_lock(store.USAGE_WRITES_LOCK)))
        except sa.exc.OperationalError as e:
            raise FlushesOpen(f"a gateway's usage flush has been open for more than {WRITERS_WAIT:g} s; rolling "
                              "up waits for it, as its rows may come before those already written") from e
        return apart.execute(query).scalar()


def _step(engine: Engine, now: float) -> tuple[int, bool]:
    """One transaction: up to CHUNK rows past the watermark rolled up, and the watermark moved past them.
    Returns the rows counted and whether more wait."""
    u = store.usage
    if engine.dialect.name == "postgresql":
        # Each statement sees what committed before it, as the rows read must be those committed while
        # _last_committed waited (a server whose default is REPEATABLE READ would not show them).
        engine = engine.execution_options(isolation_level="READ COMMITTED")
    with store.writing(engine) as conn:
        start = watermark(conn, lock=True)
        end = _last_committed(engine, conn, start, now)
        if end is None:
            return 0, False
        more = end > start + CHUNK
        end = min(end, start + CHUNK)
        for table, column, seconds in BUCKETS:
            add_sums(conn, table, column, seconds, start, end)
        counted = conn.execute(sa.select(sa.func.count()).where(u.c.id > start, u.c.id <= end)).scalar()
        conn.execute(store.revisions.update().where(store.revisions.c.name == WATERMARK).values(value=end))
    return counted, more


def prune(engine: Engine, keep_days: int, now: float | None = None) -> int:
    """Delete raw rows older than KEEP_DAYS that are already rolled up, and hourly roll-ups older than KEEP_DAYS
    or HOURLY_AT_LEAST days, whichever is longer; returns how many raw rows."""
    if keep_days <= 0:
        return 0
    now = time.time() if now is None else now
    u = store.usage
    deleted = 0
    while True:
        with store.writing(engine) as conn:
            rolled = watermark(conn)
            ids = [r[0] for r in conn.execute(sa.select(u.c.id).where(u.c.at < now - keep_days * DAY, u.c.id <= rolled)
                                              .order_by(u.c.id).limit(DELETE_BATCH))]
            if not ids:
                break
            conn.execute(u.delete().where(u.c.id >= ids[0], u.c.id <= ids[-1], u.c.at < now - keep_days * DAY))
            deleted += len(ids)
    _prune_hourly(engine, now - max(keep_days, HOURLY_AT_LEAST) * DAY)
    return deleted


# Days hourly roll-ups are kept at least: reports over two days or less read them. Past that only daily ones are
# read, and hourly ones grow with keys rather than requests (34 million rows for 50 million requests a year).
HOURLY_AT_LEAST = 7


def _prune_hourly(engine: Engine, before: float) -> None:
    """Delete hourly roll-ups of hours before BEFORE, a day of them a transaction."""
    h = store.usage_hourly
    while True:
        with store.writing(engine) as conn:
            oldest = conn.execute(sa.select(sa.func.min(h.c.hour))).scalar()
            if oldest is None or oldest >= before:
                return
            conn.execute(h.delete().where(h.c.hour < min(oldest + DAY, before)))


class Roller:
    """A thread that rolls up every INTERVAL seconds and prunes raw rows once an hour."""

    def __init__(self, engine: Engine, interval: float, keep_days: int, leading=lambda: True):
        """LEADING says whether to roll up now: with two controllers on one store, only the leader does."""
        import threading

        self.engine = engine
        self.leading = leading
        self.interval = interval
        self.keep_days = keep_days
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="usage-rollup", daemon=True)
        self.pruned_at = 0.0

    def start(self) -> "Roller":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while not self.stopping.wait(self.interval):
            if not self.leading():
                continue
            try:
                roll_up(self.engine, going_on=lambda: self.leading() and not self.stopping.is_set())
                if time.monotonic() - self.pruned_at > HOUR:
                    self.pruned_at = time.monotonic()
                    deleted = prune(self.engine, self.keep_days)
                    if deleted:
                        log.info("deleted %d raw usage rows older than %d days (their roll-ups stay)",
                                 deleted, self.keep_days)
            except FlushesOpen as e:
                log.warning("%s", e)
            except Exception:
                log.exception("rolling up usage failed; the next pass tries again")
