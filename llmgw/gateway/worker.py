"""Everything one gateway worker holds in memory, and the greenlets that keep it current.

The request path reads only what is here: the routing snapshot with each
replica's load and breaker, the key table, the upstream connection pool, the
admission queue.
Background greenlets keep it true: one reads each engine's load, probes
replicas whose breaker is open and sets the replicas' and the pools' gauges,
one writes buffered usage, one folds the metrics counted in plain Python
into prometheus-client's files once a second (llmgw/gateway/metrics.py), and
one follows the controller's snapshots and keys (or, without a controller,
notices changed keys in the store with one small query a second, never one
per request). On SQLite their store work runs in a thread of its own
(llmgw/gateway/offloop.py), so the loop serves on.
"""

from __future__ import annotations

import logging
import time

import gevent
import gevent.event
from sqlalchemy.engine import Engine
from zmq import NOBLOCK, Again

from llmgw import addresses
from llmgw.engines import metrics as enginemetrics
from llmgw.gateway.admission import AdmissionQueue
from llmgw.gateway.balancer import ReplicaState, Router
from llmgw.gateway.keytable import HeldKeys, KeyTable
from llmgw.gateway.limiter import Limiter
from llmgw.gateway.masterstate import MasterState
from llmgw.gateway.metrics import FOLD_EVERY, UNKNOWN, GatewayMetrics
from llmgw.gateway.offloop import StoreJobs
from llmgw.gateway.routingprofiles import RoutingProfiles
from llmgw.gateway.saturation import pool_saturation
from llmgw.gateway.snapshot import Snapshot
from llmgw.gateway.upstream import Pool, Target, UpstreamError
from llmgw.gateway.usage import UsageRecorder
from llmgw.settings import Config
from llmgw.wire import gateways
from llmgw.wire.curve import dial

log = logging.getLogger("llmgw.worker")

PROBE_TIMEOUT = 2.0
# Seconds a stopping worker tries to write its buffered usage before it spools the rest: a store that is down
# or hung must not hold up the stop, nor run into the master's kill (see USAGE_CLOSE_MARGIN in server.py).
# It bounds PostgreSQL's waits (cooperative); on SQLite the stop waits no longer for the flush, but the spool
# waits for it to end (offloop.py: one thread), which its busy timeout bounds (store.py).
CLOSE_WRITE_LIMIT = 5.0
DEMAND_EVERY = 1.0  # seconds: a model wanted by many requests is said once
USED_EVERY = 10.0  # seconds: "still in use" needs saying only well inside any idle timeout


class Runtime:
    def __init__(self, cfg: Config, snapshot: Snapshot, engine: Engine, key_source, state: MasterState):
        """STATE: what the gateway's master learnt and this worker inherited (keys, the accountant, the
        controller's last word)."""
        self.cfg = cfg
        self.state = state
        self.engine = engine
        self.key_source = key_source
        self.metrics = GatewayMetrics()
        self.router = Router(snapshot, cfg["breaker.failures"], cfg["breaker.cooldown"],
                             cfg["routing.metrics_stale_after"], cfg["routing.affinity_factor"], make_target=Target,
                             max_outstanding=cfg["routing.max_outstanding"], policy=cfg["routing.policy"])
        self.profiles = RoutingProfiles(cfg)  # how each request is routed: by its key's profile, or its model's
        self.pool = Pool(cfg["timeouts.connect"])
        self.queue = AdmissionQueue(cfg["gateway.queue_size"], cfg["gateway.queue_wait"])
        self.shown_replicas: set[str] = set()  # replicas and models whose gauges this worker has set
        self.shown_models: set[str] = set()
        # Read once at start; then pushed by the controller, or (without one) read again when they change. The
        # controller's messages are subscribed to first: a change made during the read waits to be taken.
        self.subscription = None
        if cfg["gateway.controller"]:
            from llmgw.gateway.follower import subscribe

            self.subscription = subscribe(cfg["gateway.controller"], state.controller_keys)
        try:
            self.keys = KeyTable.from_message(key_source.key_set(engine))
        except BaseException:
            if self.subscription is not None:
                self.subscription.close(0)
            raise
        self.usage = UsageRecorder(engine, cfg["usage.batch_size"], self.metrics, cfg["usage.spool_dir"])
        self.store_jobs = StoreJobs(engine)
        self.limiter = Limiter(cfg["limits.accountant_timeout"], self.metrics,
                               state.accountant_keys(bool(cfg["gateway.controller"])))
        self.greenlets: list[gevent.Greenlet] = []
        self.demand_socket = None
        self.demand_address: str | None = None
        self.told: dict[tuple[str, str], float] = {}
        self.keys_replaced = gevent.event.Event()  # set when `keys` is replaced; a new one waits for the next

    def demand(self, model: str) -> None:
        """Tell the controller MODEL is wanted now (an on-demand model starts by this)."""
        self._tell("demand", model, DEMAND_EVERY)

    def used(self, model: str) -> None:
        """Tell the controller MODEL served a request (an idle model stops when this stops)."""
        self._tell("used", model, USED_EVERY)

    def _tell(self, kind: str, model: str, every: float) -> None:
        address = self.router.snapshot.demand
        now = time.monotonic()
        if address is None or now - self.told.get((kind, model), -every) < every:
            return
        if address != self.demand_address:
            import zmq.green as zmq

            if self.demand_socket is not None:
                self.demand_socket.close(0)
            self.demand_socket = zmq.Context.instance().socket(zmq.PUSH)
            self.demand_socket.setsockopt(zmq.LINGER, 0)
            self.demand_socket.setsockopt(zmq.SNDHWM, 100)
            dial(self.demand_socket, self.state.controller_keys)
            self.demand_socket.connect(addresses.zmq_connect(address, "the controller's demand address"))
            self.demand_address = address
        try:
            self.demand_socket.send(gateways.encode(kind, model=model), flags=NOBLOCK)
        except Again:
            return  # the controller is away; the next request says it again
        self.told[(kind, model)] = now

    def apply(self, snapshot: Snapshot) -> None:
        """Take a newer snapshot (an older or equal one is ignored), or the first of a new controller's epoch:
        only the authenticated controller publishes, so a new epoch is a restart, never a forger's word."""
        current = self.router.snapshot
        if snapshot.epoch != current.epoch or snapshot.version > current.version:
            self.router.apply(snapshot)

    def snapshot_held(self) -> tuple[str | None, int]:
        """The epoch and version of the snapshot routed by: `follow` drops a repeat of it unread."""
        return self.router.snapshot.epoch, self.router.snapshot.version

    def apply_keys(self, table: KeyTable) -> None:
        """Take a newer key table (a later revision of the store's keys, from whichever controller)."""
        if self.keys.newer(table):
            self._replace_keys(table)

    def _replace_keys(self, table: KeyTable) -> None:
        self.keys = table
        replaced, self.keys_replaced = self.keys_replaced, gevent.event.Event()
        replaced.set()

    def newer_keys(self, timeout: float) -> bool:
        """Wait up to TIMEOUT seconds for the key table to be replaced; whether it was."""
        return self.keys_replaced.wait(timeout)

    def start(self) -> None:
        self.greenlets = [gevent.spawn(self._every, self.cfg["routing.metrics_interval"], self.watch_replicas),
                          gevent.spawn(self._every, self.cfg["usage.flush_interval"], self.flush_usage),
                          gevent.spawn(self._every, FOLD_EVERY, self.metrics.fold)]
        if self.cfg["gateway.controller"]:
            from llmgw.gateway.follower import follow, from_controller, with_leader

            base = self.router.snapshot

            def on_snapshot(body: dict, host: str) -> None:
                self.apply(from_controller(body, base, host))

            def on_leading(body: dict, host: str) -> None:
                # A new leader, not yet knowing its replicas: the ones routed to now stay.
                self.router.apply(with_leader(body, self.router.snapshot, host))

            def on_key_changes(message: dict) -> None:
                table = self.held_keys.changes(message)
                if table is not None:
                    self._replace_keys(table)

            def on_keys(message: dict) -> None:
                table = self.held_keys.whole(message)
                if table is not None:
                    self._replace_keys(table)

            # A worker that replaces a crashed one starts from what the master heard last, at once.
            last = self.state.last_word
            if "snapshot" in last:
                on_snapshot(*last["snapshot"])
            if "leading" in last:
                on_leading(*last["leading"])
            self.held_keys = HeldKeys.at_start(self.keys, last.get("keys"))
            self.apply_keys(self.held_keys.table)
            if last:
                log.info("started from the master's last snapshot (version %s) and keys (revision %s)",
                         last.get("snapshot", ({},))[0].get("version"), self.keys.revision)
            self.greenlets.append(gevent.spawn(follow, self.cfg["gateway.controller"], self.state.controller_keys,
                                               on_snapshot, on_keys, on_leading, None,
                                               self.metrics.controller_dropped, on_key_changes=on_key_changes,
                                               keys_held=self.held_keys.holds, snapshot_held=self.snapshot_held,
                                               subscribed=self.subscription, caught_up=self.held_keys.caught_up))
            self.subscription = None  # follow's now, which closes it
        else:
            # No controller pushes keys: notice a change in the store (one small query a second).
            self.greenlets.append(gevent.spawn(self._every, self.cfg["keys.refresh_interval"], self.refresh_keys))

    def close(self) -> None:
        """Stop the background work, write every buffered usage row (or spool what the store will not take)
        and fold the metrics counted since the last fold."""
        try:
            gevent.killall(self.greenlets, block=True, timeout=2)
            self.greenlets = []
            if self.demand_socket is not None:
                self.demand_socket.close(0)
            if self.subscription is not None:  # never followed: the app was made but not started
                self.subscription.close(0)
            self.limiter.stop()
            self.save_usage()
            self.store_jobs.close()
            self.pool.close()
        finally:
            # Last, after everything that counts (the usage writes do): what was counted since the last fold
            # would otherwise go with the process.
            self.metrics.fold()

    def save_usage(self) -> None:
        """Write the buffered usage rows within CLOSE_WRITE_LIMIT; spool what is left then for the next start."""
        written = 0
        with gevent.Timeout(CLOSE_WRITE_LIMIT, False):
            # A flush writes what was buffered when it began: again, for rows a request ending meanwhile added.
            while self.usage.pending():
                flushed = self.flush_usage()
                if not flushed:
                    break  # the store takes nothing now: what is left is spooled
                written += flushed
        if written:
            log.info("wrote %d buffered usage rows before stopping", written)
        path, spooled = self.store_jobs.run(self.usage.spool)
        if path:
            log.warning("the store did not take %d usage rows before stopping; they are in %s, and the next start "
                        "writes them into the store", spooled, path)

    @staticmethod
    def _every(interval: float, job) -> None:
        while True:
            started = time.monotonic()
            try:
                job()
            except Exception:
                log.exception("background job %s failed; it runs again in %.1f s", job.__name__, interval)
            gevent.sleep(max(0.0, interval - (time.monotonic() - started)))

    def flush_usage(self) -> int:
        return self.store_jobs.run(self.usage.flush)

    def refresh_keys(self) -> None:
        changed = self.store_jobs.run(self._changed_keys, self.keys.revision)
        if changed is not None:
            self._replace_keys(KeyTable.from_message(changed))

    def _changed_keys(self, held: int) -> dict | None:
        """The store's key set if its revision is not HELD, else None."""
        if self.key_source.current_revision(self.engine) == held:
            return None
        return self.key_source.key_set(self.engine)

    def watch_replicas(self) -> None:
        """Read the engines of the models this worker routes to (`Router.watched`) and show what it knows of
        them; a replica it stops reading leaves its gauges (UNKNOWN: the master shows other workers' figures)."""
        router = self.router
        states, models = router.watched(time.monotonic(), self.cfg["routing.watch_for"])
        jobs = [gevent.spawn(self._watch_one, state) for state in states]
        gevent.joinall(jobs, timeout=PROBE_TIMEOUT + 0.5)
        now = time.monotonic()
        stale_after = self.cfg["routing.metrics_stale_after"]
        m = self.metrics
        for state in states:
            rid = state.spec.id
            m.breaker_open.labels(rid).set(1 if state.breaker.is_open else 0)
            m.metrics_stale.labels(rid).set(0 if state.fresh(now, stale_after) else 1)
            m.waiting.labels(rid).set(UNKNOWN if state.waiting is None else state.waiting)
            m.kv_cache.labels(rid).set(UNKNOWN if state.kv_cache is None else state.kv_cache)
        shown = {state.spec.id for state in states}
        for rid in self.shown_replicas - shown:
            for gauge in (m.breaker_open, m.metrics_stale, m.waiting, m.kv_cache):
                gauge.labels(rid).set(UNKNOWN)
        self.shown_replicas = shown
        self.show_pools(models, now, stale_after)

    def show_pools(self, models: list[str], now: float, stale_after: float) -> None:
        """Set the admission queue depth and pool saturation (llmgw/gateway/saturation.py) of each of MODELS,
        those this worker routes to; a model it stopped routing to leaves the saturation gauge."""
        m = self.metrics
        router = self.router
        for name in models:
            depth = self.queue.depth(name)
            for band, waiting in depth.items():
                m.queue_depth.labels(name, band).set(waiting)
            replicas = ((*r.held(now, stale_after, router.max_outstanding),
                         r.kv_cache if r.fresh(now, stale_after) else None) for r in router.available(name))
            figure = pool_saturation(replicas, sum(depth.values()))
            m.saturation.labels(name).set(UNKNOWN if figure is None else figure)
        shown = set(models)
        for name in self.shown_models - shown:
            m.saturation.labels(name).set(UNKNOWN)
            for band in self.queue.depth(name):
                m.queue_depth.labels(name, band).set(0)  # summed over workers: nobody waits here for it now
        self.shown_models = shown

    def _watch_one(self, state: ReplicaState) -> None:
        now = time.monotonic()
        breaker = state.breaker
        if breaker.is_open:
            if breaker.probe_due(now):
                if self._get(state, "/health") is not None:
                    breaker.success()
                    log.info("replica %s answers its health check again; back in rotation", state.spec.id)
                else:
                    breaker.probe_failed(now)
            return
        text = self._get(state, "/metrics")
        if text is None:
            return
        figures = enginemetrics.parse_load(text.decode("utf-8", "replace"))
        if figures:
            state.record_metrics(figures, time.monotonic())

    def _get(self, state: ReplicaState, path: str) -> bytes | None:
        try:
            resp = self.pool.request(state.target, "GET", path, first_byte=PROBE_TIMEOUT,
                                     deadline=time.monotonic() + PROBE_TIMEOUT)
        except UpstreamError:
            return None
        try:
            body = resp.read()
        except UpstreamError:
            resp.abort()
            return None
        resp.release()
        return body if resp.status == 200 else None
