"""One usage row per request, buffered in memory and written in batches off the request path.

A request appends a tuple to a deque (no lock, no I/O). A flusher greenlet
writes what has gathered every `flush_interval` in one INSERT of up to
`batch_size` rows. With PostgreSQL the driver yields to other greenlets while
it waits (llmgw/gateway/greendb.py); with SQLite a batch holds the worker for
the milliseconds its write takes, which is why rows are batched. A batch that
fails to write stays at the front of the buffer and is tried again; a stopping
worker writes everything left before it exits, so a graceful stop loses no row.
"""

from __future__ import annotations

import collections
import logging
import threading

from sqlalchemy.engine import Engine

from llmgw import store

log = logging.getLogger("llmgw.usage")

FIELDS = ("at", "key_id", "project_id", "model_asked", "model_served", "replica", "endpoint", "stream",
          "status", "prompt_tokens", "completion_tokens", "latency_ms", "ttft_ms", "user_id", "cost_micros")


class UsageRecorder:
    def __init__(self, engine: Engine, batch_size: int, metrics=None):
        self.engine = engine
        self.batch_size = batch_size
        self.metrics = metrics
        self.rows: collections.deque[tuple] = collections.deque()
        # One writer at a time: the periodic flusher and the final flush at exit.
        self.write_lock = threading.Lock()

    def record(self, row: tuple) -> None:
        self.rows.append(row)

    def pending(self) -> int:
        return len(self.rows)

    def flush(self) -> int:
        """Write everything buffered now; returns rows written. Safe from any thread."""
        written = 0
        with self.write_lock:
            while self.rows:
                batch = [self.rows.popleft() for _ in range(min(self.batch_size, len(self.rows)))]
                try:
                    with self.engine.begin() as conn:
                        conn.execute(store.usage.insert(), [dict(zip(FIELDS, row)) for row in batch])
                except Exception:
                    # Put the batch back in order and stop this round; the
                    # next flush tries again. Nothing is dropped.
                    self.rows.extendleft(reversed(batch))
                    if self.metrics:
                        self.metrics.usage_failures.inc()
                    log.exception("writing %d usage rows failed; they stay buffered and will be retried", len(batch))
                    break
                written += len(batch)
        if self.metrics:
            self.metrics.usage_pending.set(len(self.rows))
        return written
