"""The controller's loop: one thread owns the agents' ROUTER and the gateways' sockets.

controller.py builds the parts (store, keys, fleet, catalog, sockets, admin
API) and hands them to a ControlLoop, which serves until a flag is set and
then closes them in order. Other threads never touch a ZeroMQ socket: the
admin API and the reconcile passes queue what they want sent in the Outbox,
and the loop sends it. What the reconcile passes (in APScheduler's thread) tell
the admin API (in threads of its own) is a ReconcileReport, under a lock.

With two controllers on one store, each loop renews the leader lease
(llmgw/control/lease.py) and acts only while it holds it: a standby refuses
agents, drops what gateways send and publishes nothing. Each time a controller
comes to lead it starts afresh, as a restarted one does (ON_LEAD).
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

import sqlalchemy as sa
from apscheduler.schedulers.background import BackgroundScheduler

from llmgw.control.agentserver import AgentServer
from llmgw.control.autoscale import Scaler
from llmgw.control.fleet import Fleet
from llmgw.control.lease import Lease
from llmgw.control.publisher import snapshot_body
from llmgw.control.reconciler import Start, plan, start_message, whole

log = logging.getLogger("llmgw.controller")

STOP_GRACE = 2.0  # seconds between taking a replica out of the snapshot and stopping its engine


class ReconcileReport:
    """How long reconcile passes take, the models the last pass could not place and why, and a way to ask
    for a pass now. Made by the controller, written by its reconcile passes, read by the admin API."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seconds: float | None = None
        self._seconds_max: float | None = None
        self._passes = 0  # passes made since the controller started (a standby makes none)
        self._unplaced: dict[str, dict[str, str]] = {}
        self._kick: Callable[[], None] = lambda: None  # until the scheduler runs, the first pass is due anyway

    def record_pass(self, seconds: float, unplaced: dict[str, dict[str, str]]) -> None:
        """A pass took SECONDS and could not place UNPLACED (model -> node -> why not)."""
        with self._lock:
            self._seconds = seconds
            self._seconds_max = max(seconds, self._seconds_max or 0.0)
            self._passes += 1
            self._unplaced = dict(unplaced)

    def passes(self) -> int:
        """Reconcile passes made since the controller started."""
        with self._lock:
            return self._passes

    def timings(self) -> tuple[float | None, float | None]:
        """The last pass's seconds and the longest pass's, or None before the first."""
        with self._lock:
            return self._seconds, self._seconds_max

    def unplaced_for(self, model: str) -> dict[str, str] | None:
        """Why the last pass could not place MODEL, node by node; None where it wanted none it could not place."""
        with self._lock:
            return self._unplaced.get(model)

    def on_kick(self, action: Callable[[], None]) -> None:
        """What kick does: the controller sets it once its scheduler runs."""
        self._kick = action

    def kick(self) -> None:
        """Ask for a reconcile pass now: a catalog change is acted on at once rather than at the next tick."""
        self._kick()


class Outbox:
    """What other threads want sent to nodes: they never touch a ZeroMQ socket, they queue what to send,
    and the loop sends it."""

    def __init__(self, server: AgentServer):
        self.server = server
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, message: tuple[str, str, dict]) -> None:
        """Queue MESSAGE, (node_id, kind, fields), for the loop to send."""
        self.queue.put(message)

    def ask_node(self, node_id: str, kind: str, fields: dict, timeout: float):
        """Send a request to a node and wait up to TIMEOUT seconds for its reply; None if none came."""
        request_id = uuid.uuid4().hex
        waiter = {"event": threading.Event(), "reply": None, "node": node_id}
        self.server.waiting[request_id] = waiter
        self.put((node_id, kind, {"request_id": request_id, **fields}))
        waiter["event"].wait(timeout)
        self.server.waiting.pop(request_id, None)
        return waiter["reply"]

    def discard(self) -> None:
        """Drop what was queued: a controller that does not lead sends nothing."""
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                return

    def send(self, fleet: Fleet) -> None:
        """Send what was queued, to the nodes FLEET knows (a message for a node no longer known is dropped)."""
        while True:
            try:
                node_id, kind, fields = self.queue.get_nowait()
            except queue.Empty:
                break
            node = fleet.nodes.get(node_id)
            if node is not None:
                self.server.send(node.identity, kind, **fields)


class ControlLoop:
    """The controller's main thread: serves agents, sends what other threads queued, gathers the gateways'
    demand, pushes keys and publishes routing snapshots, while APScheduler runs the reconcile passes and the
    key check beside it. Built from the parts controller.py made; close() stops them all."""

    def __init__(self, *, context, engine, auth, fleet: Fleet, catalog, replicas, demand, server: AgentServer,
                 outbox: Outbox, inbox, key_pusher, publisher, account_server, housekeepers, admin,
                 report: ReconcileReport, reconcile_interval: float, lease: Lease, renew_interval: float,
                 on_lead: Callable[[], None], on_standby: Callable[[], None], scaler: Scaler, maps=None):
        """LEASE says whether this controller leads; it is renewed every RENEW_INTERVAL seconds. ON_LEAD starts
        a term afresh (what a standby knew is stale), in this thread before it acts; ON_STANDBY runs after each
        renewal that did not lead (a standby keeps the keys it admits current). MAPS: each fabric's map
        (llmgw/control/fabricmaps.py), scanned from here while this controller leads."""
        self.context = context
        self.engine = engine
        self.auth = auth
        self.fleet = fleet
        self.catalog = catalog
        self.replicas = replicas
        self.snapshot_of: tuple | None = None  # the catalog's and replicas' revisions and the accountant's ports last published
        self.demand = demand
        self.scaler = scaler
        self.server = server
        self.outbox = outbox
        self.inbox = inbox
        self.key_pusher = key_pusher
        self.publisher = publisher
        self.account_server = account_server
        self.housekeepers = housekeepers  # threads of their own (usage roll-ups, the conversations' sweep)
        self.admin = admin
        self.report = report
        self.reconcile_interval = reconcile_interval
        self.lease = lease
        self.renew_interval = renew_interval
        self.on_lead = on_lead
        self.on_standby = on_standby
        self.maps = maps
        self.term = 0  # the lease's term this loop has started: it acts only in that one
        self.term_lock = threading.Lock()  # a reconcile pass never overlaps the start of a term
        self.scheduler = BackgroundScheduler()

    def leading(self) -> bool:
        """Whether this controller leads now, a new term started first when it has just come to lead."""
        if not self.lease.held():
            return False
        if self.lease.term != self.term:
            with self.term_lock:
                try:
                    self.on_lead()
                except sa.exc.SQLAlchemyError as e:
                    # The store answered the renewal a moment ago; act only once this term has started.
                    log.warning("cannot start leading yet, the store did not answer: %s", str(e).splitlines()[0])
                    return False
                self.term = self.server.term = self.lease.term
                # The term's first snapshot is newer than any sent before, even with nothing changed:
                # gateways that followed another leader meanwhile keep its addresses until one is.
                self.publisher.forget()
                self.snapshot_of = None
        return True

    def renew(self) -> None:
        if self.lease.renew():
            return
        try:
            self.on_standby()
        except sa.exc.SQLAlchemyError as e:
            log.warning("standing by; could not read the keys from the store: %s", str(e).splitlines()[0])

    def reconcile(self) -> None:
        with self.term_lock:
            # Asked as late as can be: a controller paused past its lease must find out before it places.
            if self.lease.held() and self.lease.term == self.term:
                self._reconcile()

    def _reconcile(self) -> None:
        now = time.monotonic()
        if self.fleet.settling(now):
            # Just started: a node not yet back may run replicas this controller has not heard of,
            # and placing them again would run them twice.
            return
        models = self.catalog.models()
        nodes = self.fleet.describe(now)
        wanted = {name: model.min_replicas for name, model in models.items()}
        wanted.update(self.demand.wanted(models, now))
        loads = {shard["shard_id"]: shard for n in nodes for shard in n.facts.shard_loads or ()}
        wanted.update(self.scaler.wanted(models, whole(self.replicas.snapshot()), loads, self.catalog.limits(),
                                         wanted, now))
        leaves = self.maps.leaves() if self.maps is not None else None
        actions, unplaced = plan(models, nodes, self.replicas, now, wanted=wanted, leaves=leaves,
                                 adopting=self.fleet.adopting(now))
        self.report.record_pass(round(time.monotonic() - now, 6), unplaced)
        for action in actions:
            if isinstance(action, Start):
                profile = action.decision.profile
                log.info("starting %s on %s (%s, profile %s%s)", action.shard_id, action.decision.node_id,
                         profile.engine, profile.name,
                         f", rank {action.rank} of {action.ranks}" if action.group else "")
                self.outbox.put((action.decision.node_id, "start_shard", start_message(models[action.model], action)))
            else:
                log.info("stopping %s on %s: %s", action.shard_id, action.node_id, action.reason)
                # The replica leaves the gateways' snapshot now; the engine is drained a little later (it
                # stops once idle), so a request routed to it a moment ago still finds it answering.
                message = (action.node_id, "drain_shard", {"request_id": uuid.uuid4().hex,
                                                           "shard_id": action.shard_id})
                threading.Timer(STOP_GRACE, self.outbox.put, args=(message,)).start()

    def scan_fabrics(self) -> None:
        if self.lease.held():
            self.maps.scan(self.fleet.describe(time.monotonic()), self.outbox.ask_node)

    def run(self, stopping: threading.Event) -> None:
        """Serve until STOPPING is set; the loop notices within one poll."""
        self.scheduler.add_job(self.renew, "interval", id="lease", seconds=self.renew_interval,
                               max_instances=1, coalesce=True)
        self.scheduler.add_job(self.reconcile, "interval", id="reconcile", seconds=self.reconcile_interval,
                               max_instances=1, coalesce=True, next_run_time=datetime.datetime.now())
        if self.maps is not None:
            # Each fabric is mapped every fabricmaps.SCAN_EVERY; a job a minute finds the ones due. A scan is a
            # node's minutes of work, asked in this job's own thread, never the loop's.
            self.scheduler.add_job(self.scan_fabrics, "interval", id="fabric-scan", seconds=60, max_instances=1,
                                   coalesce=True, next_run_time=datetime.datetime.now())
        self.key_pusher.start()
        self.scheduler.start()
        # A catalog change is acted on at once rather than at the next tick.
        self.report.on_kick(lambda: self.scheduler.modify_job("reconcile", next_run_time=datetime.datetime.now()))
        while not stopping.is_set():
            leading = self.leading()  # first: a term starts before its agents' messages are taken
            self.server.poll(100)
            if not leading:
                # A standby sends nothing: what was queued is dropped, the gateways' demand and key changes
                # are the leader's to act on, and the gateways keep the leader's last snapshot.
                self.outbox.discard()
                self.inbox.drain(lambda model: None)
                self.key_pusher.take()
                continue
            self.outbox.send(self.fleet)
            self.inbox.drain(lambda model: self.demand.note(model, time.monotonic()))
            for topic, message in self.key_pusher.take():
                self.publisher.publish_encoded(topic, message)
            if self.fleet.settling(time.monotonic()):
                # Gateways keep the last snapshot they had, with the replicas of nodes still on their way
                # back, rather than one that lacks them; but they ask this controller's accountant and tell
                # it their demand from now on. Waiting for the nodes to say so cost every budgeted request
                # a 503 until they were back, or unreachable_after passed.
                self.publisher.publish_leading(self.inbox.port, self.account_server.port, self.account_server.ports)
            else:
                # Made again only when the catalog or a replica changed, else repeated: made at every turn of
                # this loop (each message from an agent), 20,000 replicas kept a core busy.
                ports = self.account_server.ports  # an accountant part started again is on a new one
                seen = (self.catalog.revision, self.replicas.revision, ports)
                if seen != self.snapshot_of:
                    self.snapshot_of = seen
                    self.publisher.publish(snapshot_body(self.catalog.models(), whole(self.replicas.snapshot()),
                                                         self.inbox.port, self.account_server.port,
                                                         self.catalog.limits(), ports))
                else:
                    self.publisher.repeat()

    def close(self) -> None:
        """Stop every part, whether run() returned or failed; the lease is given up early, so a standby takes
        over at its next renewal, once the accountant (and each of its parts) answers no more."""
        if self.scheduler.running:  # run() may have failed before starting it
            self.scheduler.shutdown(wait=False)
        self.account_server.stop()
        self.lease.release()
        self.admin.shutdown()
        self.publisher.close()
        for housekeeper in self.housekeepers:
            housekeeper.stop()
        self.inbox.close()
        self.key_pusher.close()
        self.server.close()
        if self.auth is not None:
            self.auth.stop()
        self.context.term()
        self.engine.dispose()
        log.info("controller stopped")
