"""The store work a gateway worker does in the background, run where it cannot stall the worker's requests.

Python's sqlite3 works in C without yielding to gevent: a usage flush or the key-revision check run on a
worker's loop served nothing while SQLite worked, or waited up to its busy timeout for a lock. With usage
writes paused, p99 at 32 clients fell from 70.7 to 35.2 ms in one run (docs/performance.md, issue 14).
sqlite3 releases the GIL while SQLite works, so in a native thread the loop keeps serving meanwhile.

One thread, so that the jobs run one after another in the order given: a stopping worker's flush and spool
wait for a flush under way, which commits its rows or keeps them, and no row is written twice. Each job's
connections are opened and closed in that thread (the store never pools SQLite's: store.py).
PostgreSQL stays on the loop: psycopg2's wait callback (greendb.py) already yields to gevent there, and in
another thread it would wait on a hub of that thread's own.
"""

from __future__ import annotations

from gevent.threadpool import ThreadPool
from sqlalchemy.engine import Engine


class StoreJobs:
    def __init__(self, engine: Engine):
        self.thread = ThreadPool(1) if engine.dialect.name == "sqlite" else None

    def run(self, job, *args):
        """JOB(*ARGS)'s result, or its exception raised here; the calling greenlet waits, the loop serves on.
        A greenlet killed or timed out while it waits leaves the job to finish in the thread."""
        if self.thread is None:
            return job(*args)
        return self.thread.apply(job, args)

    def close(self) -> None:
        """Let the thread go once the jobs given have run."""
        if self.thread is not None:
            self.thread.kill()  # its thread ends after the jobs already queued
