"""One usage row per request, buffered in memory and written in batches off the request path.

A request appends a tuple to a deque (no lock, no I/O). A flusher greenlet
writes what has gathered every `flush_interval`, up to `batch_size` rows a
transaction. With PostgreSQL the driver yields to other greenlets while it
waits (llmgw/gateway/greendb.py); with SQLite the worker runs the flush in a
thread of its own (llmgw/gateway/offloop.py), so the loop serves meanwhile.

What can go wrong, and what happens then:

- The store cannot be written (down, full, read-only, locked): the rows stay
  at the front of the buffer and the next flush tries again. Nothing is lost.
- The store refuses a row for what it holds: that row alone is left out,
  logged with its content and counted (`llmgw_usage_rows_dropped_total`); the
  rest of its batch is written. Text longer than its column is cut to fit
  before any write, so a long model name is stored cut, not refused. (Once,
  one model name over 200 characters failed its batch on PostgreSQL again and
  again, and no later row was ever written.)
- The worker stops while the store cannot be written: what is left goes to a
  spool file (0600) in `usage.spool_dir`, and the next start writes it into
  the store, once, however often that start is interrupted.
"""

from __future__ import annotations

import collections
import glob
import itertools
import json
import logging
import os
import threading
import time
import uuid

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from llmgw import filemodes, store

log = logging.getLogger("llmgw.usage")

FIELDS = ("at", "key_id", "project_id", "model_asked", "model_served", "replica", "endpoint", "stream",
          "status", "prompt_tokens", "completion_tokens", "latency_ms", "ttft_ms", "user_id", "cost_micros",
          "guard_verdict", "guard_category")

# The widths of the text columns, read from the schema so the two never differ.
WIDTHS = {name: store.usage.c[name].type.length for name in FIELDS
          if isinstance(store.usage.c[name].type, sa.String) and store.usage.c[name].type.length}

# Fields added since spool files were first written: a spool file an older gateway left lacks them (null).
ADDED = frozenset({"guard_verdict", "guard_category"})

SPOOL_PATTERN = "usage-*.jsonl"

# SQLite's own INSERT, its rows given as tuples to the driver's executemany: SQLAlchemy's executemany took 21 µs
# of a worker's CPU a row here (a dict a row, each value through its type's processor), this 7 to 11.
QMARK_INSERT = f"INSERT INTO usage ({', '.join(FIELDS)}) VALUES ({', '.join('?' * len(FIELDS))})"


def bounded(row: tuple) -> dict:
    """ROW as the column values the schema allows: text longer than its column is cut to fit."""
    values = dict(zip(FIELDS, row))
    for name, width in WIDTHS.items():
        value = values.get(name)
        if isinstance(value, str) and len(value) > width:
            values[name] = value[:width]
    return values


def refused_for_its_content(error: Exception) -> bool:
    """Whether the store refused a row for what it holds (a value it cannot take, a required one missing), as
    opposed to not being writable at all (down, full, read-only, locked): only the first is never worth retrying."""
    if isinstance(error, (sa.exc.DataError, sa.exc.IntegrityError)):
        return True
    # Raised while binding the row's values, before the database saw it.
    return isinstance(error, sa.exc.StatementError) and not isinstance(error, sa.exc.DBAPIError)


def insert_rows(conn: Connection, rows: list[tuple]) -> list[tuple[tuple, Exception]]:
    """Insert ROWS in CONN's transaction, leaving out any the store refuses for its content; returns those, each
    with the reason. Any other failure is raised: the caller keeps every row for a later try."""
    if conn.dialect.name == "postgresql":
        # Shared with other writers until this transaction ends: the roller takes it alone before it reads how
        # far to roll up, so no row whose id is given out below that is still uncommitted (and skipped for good).
        conn.execute(sa.select(sa.func.pg_advisory_xact_lock_shared(store.USAGE_WRITES_LOCK)))
    try:
        # A savepoint, because on PostgreSQL a refused statement spoils the rest of its transaction.
        with conn.begin_nested():
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql(QMARK_INSERT, [tuple(map(values.get, FIELDS)) for values in map(bounded, rows)])
            else:
                conn.execute(store.usage.insert(), [bounded(row) for row in rows])
        return []
    except Exception as e:
        if not refused_for_its_content(e):
            raise
        if len(rows) == 1:
            return [(rows[0], e)]
    # One at a time, to find which rows the store refuses.
    return [refusal for row in rows for refusal in insert_rows(conn, [row])]


class UsageRecorder:
    def __init__(self, engine: Engine, batch_size: int, metrics=None, spool_dir: str | None = None):
        """SPOOL_DIR: where rows go that cannot be written at exit; files left there by an earlier run are written
        into the store by the first flushes. None: no spool (rows left at exit are logged)."""
        self.engine = engine
        self.batch_size = batch_size
        self.metrics = metrics
        self.spool_dir = spool_dir
        self.spooled = sorted(glob.glob(os.path.join(spool_dir, SPOOL_PATTERN))) if spool_dir else []
        self.rows: collections.deque[tuple] = collections.deque()
        # One writer at a time: the periodic flusher and the final flush at exit.
        self.write_lock = threading.Lock()

    def record(self, row: tuple) -> None:
        self.rows.append(row)

    def pending(self) -> int:
        return len(self.rows)

    def flush(self) -> int:
        """Write everything buffered now, then any spool file still waiting; returns the buffered rows written.
        Safe from any thread; a flush cut short (its greenlet killed, a deadline) loses no row."""
        written = 0
        with self.write_lock:
            # Only what is buffered now: rows that come in meanwhile wait for the next flush. A flush that chased
            # them, on a store slower to commit than requests came, never ended, and wrote one small batch after
            # another, each with its transaction's fsyncs: 0.37 ms of CPU a row at 1,000 requests a second.
            left = len(self.rows)
            try:
                while left:
                    # Rows leave the buffer only once their transaction has committed.
                    batch = list(itertools.islice(self.rows, min(left, self.batch_size)))
                    self._write(batch)
                    for _ in batch:
                        self.rows.popleft()
                    written += len(batch)
                    left -= len(batch)
                self._write_spooled()
            except Exception:
                if self.metrics:
                    self.metrics.usage_failures.inc()
                log.exception("writing usage rows failed; %d buffered rows and %d spool files wait for the next try",
                              len(self.rows), len(self.spooled))
        if self.metrics:
            self.metrics.usage_pending.set(len(self.rows))
        return written

    def _write(self, rows: list[tuple]) -> None:
        with self.engine.begin() as conn:
            refused = insert_rows(conn, rows)
        self._drop_refused(refused)

    def _drop_refused(self, refused: list[tuple[tuple, Exception]]) -> None:
        for row, error in refused:
            # The driver's own words: SQLAlchemy's would repeat the statement and every parameter.
            self._drop(row, f"the store refused it: {' '.join(str(error.orig).split())}")

    def _drop(self, row: tuple, why: str) -> None:
        """Give up on ROW, saying why and what it held, so a person can still put it in by hand."""
        if self.metrics:
            self.metrics.usage_dropped.inc()
        log.error("usage row dropped, %s: %s", why, json.dumps(bounded(row)))

    def spool(self) -> tuple[str | None, int]:
        """Move every buffered row to a new spool file, which the next start writes into the store. Returns its
        path (None when nothing was left, or it could not be written: then each row is logged) and the rows."""
        with self.write_lock:
            rows = list(self.rows)
            self.rows.clear()
        if not rows:
            return None, 0
        try:
            return self._write_spool_file(rows), len(rows)
        except OSError as e:
            for row in rows:
                self._drop(row, f"the store and the spool ({e}) could not be written")
            return None, len(rows)

    def _write_spool_file(self, rows: list[tuple]) -> str:
        if not self.spool_dir:
            raise OSError("usage.spool_dir is not set")
        filemodes.make_private_dir(self.spool_dir)
        # A unique name: it is what marks the file written (store.usage_spools).
        name = f"usage-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex}.jsonl"
        path = os.path.join(self.spool_dir, name)
        # Written under a name no reader looks for, then renamed: a worker starting meanwhile (gunicorn
        # replaces workers while others stop) must never read, and remove, a half-written file.
        partial = os.path.join(self.spool_dir, "." + name)
        try:
            with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, filemodes.FILE_MODE), "w") as f:
                f.writelines(json.dumps(dict(zip(FIELDS, row))) + "\n" for row in rows)
                f.flush()
                os.fsync(f.fileno())
            os.rename(partial, path)
        except OSError:
            if os.path.exists(partial):
                os.unlink(partial)
            raise
        return path

    def _write_spooled(self) -> None:
        while self.spooled:
            path = self.spooled[0]
            written = self._write_spool_file_into_store(path)
            if written is not None:
                log.info("wrote %d usage rows spooled by an earlier run (%s) into the store", written, path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # a sibling worker wrote it and removed it first
            self.spooled.pop(0)

    def _write_spool_file_into_store(self, path: str) -> int | None:
        """Write the rows of the spool file at PATH in one transaction with its name; None when it was written
        before (by a sibling worker, or by a run that stopped before it could remove the file)."""
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except FileNotFoundError:
            return None
        rows = [_parse(line) for line in lines]
        readable = [row for row in rows if row is not None]
        try:
            with self.engine.begin() as conn:
                # First, so that a sibling writing the same file waits here, then finds it done.
                conn.execute(store.usage_spools.insert().values(name=os.path.basename(path), rows=len(readable),
                                                                written_at=time.time()))
                refused = [r for start in range(0, len(readable), self.batch_size)
                           for r in insert_rows(conn, readable[start:start + self.batch_size])]
        except sa.exc.IntegrityError:
            return None
        self._drop_refused(refused)
        for line, row in zip(lines, rows):
            if row is None:
                self._drop_line(line)
        return len(readable) - len(refused)

    def _drop_line(self, line: str) -> None:
        if self.metrics:
            self.metrics.usage_dropped.inc()
        log.error("usage row dropped, unreadable in the spool: %s", line[:2000].strip())


def _parse(line: str) -> tuple | None:
    """The row a spool file's LINE holds, or None for a line this code never writes (a file edited by hand).
    Only plain values: a list or an object would make PostgreSQL refuse the whole file, at every try."""
    try:
        values = json.loads(line)
        row = tuple(values.get(name) if name in ADDED else values[name] for name in FIELDS)
    except (ValueError, KeyError, TypeError):
        return None
    return None if any(isinstance(value, (list, dict)) for value in row) else row
