"""Which controller leads: a lease in the store, taken and renewed by one statement.

Two controllers on one store must not both place replicas, run the accountant
or publish snapshots. The lease is a row of the `leases` table (SQLite has no
advisory locks, and a row outlives a leader that loses power): an owner, the
address its agents connect to, and an expiry on the database's own clock.
Taking and renewing are the same UPDATE, which succeeds only for the owner or
once the lease has expired, so two controllers racing for it cannot both win.

The owner is a random id made at each start, never the host name: a restarted
controller must not find its old lease and believe it led all along.

A leader measures its lease on its own monotonic clock from the moment it sent
the statement that renewed it, which is before the database set the expiry, and
trusts it for three quarters of the TTL, so it stops believing it leads well
before the database lets another take over.
It leads while `held()`: a controller that cannot reach the store keeps acting
until then, and stops; one that was paused (SIGSTOP) past its TTL finds on
waking that `held()` is false before it does anything, because every action
asks first. A clean stop releases the lease, so the standby takes over at its
next renewal instead of after the TTL.

A controller that was killed leaves its lease held under its address, and its
restart takes it back without waiting out the TTL: at its first tries a
controller also takes a lease held under its own address, but only once the
store's clock says nobody renewed it for one and a half renewal intervals. A
live holder renews every interval, so the one found so is another controller
configured with the same `controller.address` (two machines given one name):
taking its lease at once made both lead. This one stands by and says so.

Imported by: controller.py, llmgw/control/loop.py. Imports llmgw.store. Its `collect` is the
controller's `llmgw_controller_leading` series.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy.engine import Engine

from llmgw import store

log = logging.getLogger("llmgw.lease")

NAME = "controller"
# The share of the TTL a leader trusts its lease for: the rest covers what happens between asking `held()`
# and acting on the answer (a poll, a pass), and a clock that stood still (a suspended VM).
TRUSTED = 0.75
# The share of the TTL one renewal may wait for a lock: the store's own wait (SQLite's busy timeout, 10 s) was
# as long as the TTL, so a renewal stuck behind a writer outlived the lease it was renewing, and held up the
# tries after it. Failing after this leaves room for three more tries within the trusted part.
RENEW_WAIT = TRUSTED / 4
# How long a lease under this controller's own address must have gone unrenewed, in renewal intervals, before
# a first try takes it: more than one, since a live holder's renewal comes up to an interval apart and may be
# late on a busy machine.
STILL = 1.5
# The share of the TTL a renewal's client may fall silent inside its transaction before the server (PostgreSQL)
# ends its session: a leader paused between its UPDATE and its COMMIT holds the row's lock, and the standby's
# renewals wait on it. Ended before the lease it was renewing expires, it delays no failover; longer than the
# lock wait, so a live controller on a busy machine is not cut off for a slow moment.
SILENT = 0.5


class Lease:
    def __init__(self, engine: Engine, address: str, ttl: float, renew_interval: float,
                 clock: Callable[[], float] = time.monotonic):
        """ADDRESS is where this controller's agents connect, named by standbys to the agents they refuse; the
        first renewal must come after the controller listens there (see `renew`). RENEW_INTERVAL is how often
        `renew` is called, here and (in one configuration) on every other controller."""
        self.engine = engine
        self.address = address
        self.ttl = ttl
        self.renew_interval = renew_interval
        self.clock = clock
        self.owner = os.urandom(8).hex()
        self.valid_until = 0.0  # monotonic seconds: this controller leads until then
        self.leader = ""  # the address of whoever leads, as the store said at the last renewal
        self.term = 0  # how many times this controller came to lead; each is a fresh start for its state
        self._now = store.db_now(engine.dialect.name)
        self._lock = threading.Lock()
        self._twin: tuple[str, float] | None = None  # (owner, expiry) of a lease last seen under our address
        self._told = ""  # the owner of that lease once this controller said it is another controller's

    def held(self) -> bool:
        """Whether this controller leads now."""
        return self.clock() < self.valid_until

    def leader_address(self) -> str:
        """Where the leader's agents connect ("" when no controller leads, as far as this one knows)."""
        return self.address if self.held() else self.leader

    def renew(self) -> bool:
        """Take the lease, or renew it; whether this controller leads afterwards. A store that cannot be
        reached changes nothing: the lease held so far runs out on its own."""
        with self._lock:
            sent = self.clock()
            table = store.leases
            try:
                takeable = [table.c.owner == self.owner, table.c.expires_at < self._now]
                if self.term == 0:
                    # Until it first leads, a controller also takes a lease held under its own address whose
                    # expiry was last set (renewed) over STILL intervals ago: an earlier run of this controller,
                    # killed before it could release it. A restart need not wait out the TTL.
                    takeable.append(sa.and_(table.c.address == self.address, table.c.expires_at <
                                            self._now + self.ttl - STILL * self.renew_interval))
                with self.engine.begin() as conn:
                    store.bounded(conn, self.ttl * RENEW_WAIT, silent=self.ttl * SILENT)
                    taken = conn.execute(
                        table.update()
                        .where(table.c.name == NAME)
                        .where(sa.or_(*takeable))
                        .values(owner=self.owner, address=self.address, expires_at=self._now + self.ttl)
                    ).rowcount == 1
                    if not taken:
                        row = conn.execute(sa.select(table.c.owner, table.c.address, table.c.expires_at,
                                                     table.c.expires_at >= self._now)
                                           .where(table.c.name == NAME)).first()
                        self.leader = row.address if row is not None and row[3] else ""
                        if row is not None and row[3] and row.address == self.address and self.term == 0:
                            self._same_address(row.owner, row.expires_at)
            except sa.exc.SQLAlchemyError as e:
                if not self.held() and self.leader == self.address:
                    self.leader = ""  # no longer this controller, and the store cannot say who
                left = self.valid_until - self.clock()
                log.warning("cannot renew the leader lease: %s; %s", str(e).splitlines()[0],
                            f"leading {left:.1f} s more at most" if left > 0 else "not leading")
                return self.held()
            if taken:
                if sent >= self.valid_until:
                    # Not leading until now (or no longer, after a pause or a store that did not answer): what
                    # this controller knew may be stale, and the loop starts its term afresh.
                    self.term += 1
                    log.info("leading: took the leader lease (owner %s, %s, term %d)", self.owner, self.address,
                             self.term)
                self.valid_until = sent + self.ttl * TRUSTED
                self.leader = self.address
            else:
                if self.valid_until:
                    log.warning("lost the leader lease to %s: standing by", self.leader or "no one yet")
                self.valid_until = 0.0
            return taken

    def _same_address(self, owner: str, expires_at: float) -> None:
        """A live lease under this controller's own address, not yet taken: its holder renewed it lately. Said
        once a renewal is seen, which proves the holder lives: another controller uses this address."""
        seen, self._twin = self._twin, (owner, expires_at)
        if seen is not None and seen[0] == owner and seen[1] != expires_at and owner != self._told:
            self._told = owner
            log.error("another controller leads under this controller's address %s, and renews its lease, so this "
                      "one stands by: two controllers are configured with the same controller.address. Set "
                      "controller.address on each to the HOST:PORT its own agents dial (its "
                      "controller.agent_listen on its own machine), then restart this one", self.address)

    def release(self) -> None:
        """Give the lease up now (a clean stop), so a standby takes over at its next renewal."""
        with self._lock:
            self.valid_until = 0.0
            table = store.leases
            try:
                with self.engine.begin() as conn:
                    store.bounded(conn, self.ttl * RENEW_WAIT, silent=self.ttl * SILENT)
                    conn.execute(table.update().where(table.c.name == NAME).where(table.c.owner == self.owner)
                                 .values(owner="", expires_at=0.0))
            except sa.exc.SQLAlchemyError as e:
                log.warning("could not release the leader lease (it expires on its own): %s", str(e).splitlines()[0])

    def collect(self):
        """prometheus-client's collector interface: whether this controller leads now. No controller at 1
        is a control plane that places nothing and runs no accountant (alert `ControlPlaneUnreachable`)."""
        yield GaugeMetricFamily("llmgw_controller_leading", "1 while this controller holds the leader lease.",
                                value=1.0 if self.held() else 0.0)
