"""A running gateway says so in its store: a row of `leases` from its start to its clean stop.

`llmgw store move` must not copy a store that something still writes to: the usage rows a gateway wrote
after the copy would stay behind in the old store. Controllers hold the leader lease; a gateway's master
writes a row of its own when it starts, named for its machine and listening address, and deletes it at a
clean stop, after the workers wrote their usage.

The row is written once, not renewed: on SQLite every write can make another connection's transaction that
read first fail with "database is locked", and a gateway that renewed a row every few seconds would make
`llmgw keys create` fail now and then. So a gateway that was killed leaves its row until it starts and stops
again; `llmgw store move --force` goes ahead regardless, for when the operator knows none runs. The master
writes before it forks its workers and from a thread it waits for, so no worker inherits a connection, and
a store that does not answer holds up neither the start nor the stop for more than WAIT seconds.

Imported by: llmgw/gateway/server.py (the master). Imports llmgw.store.
"""

from __future__ import annotations

import logging
import socket
import threading

import sqlalchemy as sa

from llmgw import store

log = logging.getLogger("llmgw.presence")

OWNER = "gateway"
FOREVER = 1e15  # the row's expiry: until the gateway takes it away
WAIT = 5.0


def name_for(listen: str) -> str:
    """The row's name for a gateway listening at LISTEN on this machine."""
    return f"gateway {socket.gethostname()} {listen}"


def _in_store(url: str, what: str, act) -> None:
    """ACT(connection) in one transaction on URL's store, in a thread waited for WAIT seconds at most."""
    def run() -> None:
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            with engine.begin() as conn:
                act(conn)
        except sa.exc.SQLAlchemyError as e:
            log.warning("could not %s: %s", what, str(e).splitlines()[0])
        finally:
            engine.dispose()

    thread = threading.Thread(target=run, name="presence", daemon=True)
    thread.start()
    thread.join(WAIT)


def mark(url: str, listen: str) -> None:
    """Say in URL's store that the gateway listening at LISTEN uses it (the master, before its workers)."""
    table, name = store.leases, name_for(listen)

    def act(conn) -> None:
        values = {"owner": OWNER, "address": listen, "expires_at": FOREVER}
        if conn.execute(table.update().where(table.c.name == name).values(**values)).rowcount == 0:
            conn.execute(table.insert().values(name=name, **values))

    _in_store(url, "say in the store that this gateway uses it (`llmgw store move` will not see it)", act)


def remove(url: str, listen: str) -> None:
    """Take the row away (the master, at a clean stop): a store move may go ahead."""
    _in_store(url, "take this gateway's mark out of the store (`llmgw store move` will need --force)",
              lambda conn: conn.execute(store.leases.delete().where(store.leases.c.name == name_for(listen))))
