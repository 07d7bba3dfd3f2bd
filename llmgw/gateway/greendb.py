"""Make psycopg2 cooperative under gevent, so a slow PostgreSQL stalls no stream.

psycopg2 talks to the server in C and would block the whole worker while it
waits; with a wait callback it hands each wait to gevent instead (the approach
of the psycogreen package, in the few lines it takes). SQLite cannot yield:
a worker's background SQLite work runs in a thread instead (offloop.py).
"""

from __future__ import annotations


def _wait(conn, timeout=None):
    import psycopg2.extensions as ext
    from gevent.socket import wait_read, wait_write

    while True:
        state = conn.poll()
        if state == ext.POLL_OK:
            return
        if state == ext.POLL_READ:
            wait_read(conn.fileno(), timeout=timeout)
        elif state == ext.POLL_WRITE:
            wait_write(conn.fileno(), timeout=timeout)
        else:
            raise ext.OperationalError(f"bad state from poll: {state}")


def make_psycopg2_green() -> None:
    import psycopg2.extensions

    psycopg2.extensions.set_wait_callback(_wait)
