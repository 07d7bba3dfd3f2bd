"""Telling gateways where each model can be served: the routing snapshot, pushed over ZeroMQ PUB.

The whole snapshot (the catalog's names, aliases and limits, the ready
replicas with their addresses, and the ids of those whose node found their
engine unhealthy) goes out whenever it changes and again every
`REPEAT` seconds. Sending it whole, and repeating it, is what makes PUB/SUB
safe here: a gateway that joined late, or missed a message across a restart,
is right again within seconds, with no request for a full copy.

Each controller start begins a new epoch; within it, versions only grow. The
socket is CURVE: a gateway subscribes with its issued key and believes only a
publisher holding the controller's secret key, so a process that binds the
port while the controller restarts is never heard (it once was, and every
gateway sent its traffic to the forger until restarted).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import zmq
from prometheus_client.core import CounterMetricFamily

from llmgw import addresses, store
from llmgw.control.authenticator import serve_curve
from llmgw.control.catalog import Model
from llmgw.control.reconciler import Replica
from llmgw.people import keys
from llmgw.wire import gateways, keychanges

log = logging.getLogger("llmgw.publisher")

REPEAT = 2.0
KEYS_CHECK = 0.25  # seconds between looks at the store's key revision
# Seconds between reads of the whole key set while changes arrive named (`people.keys.changed_since`): what
# the changes read missed (a writer that named less than it changed) is sent then, and said.
KEYS_WHOLE_EVERY = 300.0
# The whole set is made again at most once in this many times what it last took to encode: made after each burst
# of changes, at a million keys (7 s) it kept the key thread, and every change waiting behind it, busy most of
# the time.
KEYS_REPEAT_COST = 10


def snapshot_body(models: dict[str, Model], replicas: list[Replica], demand_port: int | None = None,
                  accountant_port: int | None = None, limits: dict[tuple[str, str], int] | None = None,
                  accountant_ports: list[int] | None = None) -> dict:
    """LIMITS: (model, profile fingerprint) -> requests in flight, as measured (Catalog.limits). ACCOUNTANT_PORTS:
    each part's, where the accountant has several (the first is ACCOUNTANT_PORT)."""
    ready = sorted((r for r in replicas if r.state == "ready" and r.url and r.model in models),
                   key=lambda r: r.shard_id)
    weights = {}
    for name, model in models.items():
        for profile in model.profiles:
            weights[(name, model.fingerprint(profile))] = profile.weight
    limits = limits or {}
    served: dict[str, int] = {}  # model -> the largest context a ready replica of it serves
    for r in ready:
        if r.context is not None:
            served[r.model] = max(r.context, served.get(r.model, r.context))
    loading = _loading(replicas, {r.model for r in ready})
    return {
        "models": [_model(m, served.get(m.name), loading.get(m.name)) for m in sorted(models.values(),
                                                                                       key=lambda m: m.name)],
        "demand_port": demand_port,
        "accountant_port": accountant_port,
        "replicas": [_replica(r, weights.get((r.model, r.profile_fp), 1.0), limits.get((r.model, r.profile_fp)))
                     for r in ready],
        # Out of rotation like any replica not listed, but named: a request a gateway sent one before its node
        # found it hung is moved to another replica (a replica merely stopping or drained finishes its own).
        "unhealthy": sorted(r.shard_id for r in replicas if r.state == "unhealthy"),
        **_parts(accountant_ports),
    }


def _parts(ports: list[int] | None) -> dict:
    """The accountant's ports as a snapshot or `leading` carries them: only where there are several."""
    return {"accountant_ports": ports} if ports and len(ports) > 1 else {}


# How far a replica is from serving, least first: what a model with none ready says it waits for.
PROGRESS = ("waiting", "pending", "fetching", "starting")


def _loading(replicas: list[Replica], ready: set[str]) -> dict[str, dict]:
    """For each model with no replica ready, its replica nearest to serving: its state, and a download's
    bytes (the chat page says what the model waits for: a node, its weights, its engine)."""
    found: dict[str, Replica] = {}
    for r in replicas:
        if r.model in ready or r.state not in PROGRESS:
            continue
        best = found.get(r.model)
        if best is None or PROGRESS.index(r.state) > PROGRESS.index(best.state):
            found[r.model] = r
    out = {}
    for model, r in found.items():
        fetch = r.fetch or {}
        out[model] = {"state": r.state, **{k: fetch[k] for k in ("bytes_done", "bytes_total")
                                          if isinstance(fetch.get(k), int) and r.state == "fetching"}}
    return out


def _model(m: Model, served: int | None, loading: dict | None = None) -> dict:
    """A model as gateways see it; a role and a guard override only where set (absent: none). Its context is
    what a request may use: the catalog's, or less where its engines serve less (SERVED, the largest of its
    ready replicas': llama.cpp holds a slot to what the model was trained on, whatever it was asked), so
    /v1/models and the gateway's refusals name the number the engines enforce. The largest, not the least:
    one replica on a node whose key leaked, saying 1, once held every request of the model to 1 token."""
    context = m.max_context if served is None else min(served, m.max_context or served)
    row = {"name": m.name, "aliases": list(m.aliases), "description": m.description, "max_context": context,
           "max_output": m.max_output, "on_demand": m.min_replicas == 0 < m.max_replicas}
    if m.max_replicas == 0:  # stopped by an operator: not offered, and a request is told so at once
        row["stopped"] = True
    if loading:
        row["loading"] = loading
    if m.role:
        row["role"] = m.role
    if m.guard:
        row["guard"] = dict(m.guard)
    if m.routing_profile:
        row["routing_profile"] = m.routing_profile
    return row


def _replica(replica: Replica, weight: float, max_in_flight: int | None) -> dict:
    """A ready replica as gateways see it: with its node's address (which its URL is on), its engine's key when
    it has one, and the requests in flight its profile was measured to take when it was (each absent
    otherwise, not sent as null)."""
    row = {"id": replica.shard_id, "url": replica.url, "models": [replica.model], "weight": weight}
    if replica.address is not None:
        row["address"] = replica.address
    if replica.api_key is not None:
        row["api_key"] = replica.api_key
    if max_in_flight is not None:
        row["max_in_flight"] = max_in_flight
    return row


class Publisher:
    def __init__(self, context: zmq.Context, listen: str, curve: tuple | None = None):
        """CURVE is (keypair, domain): only gateways holding an issued key may subscribe, and a gateway
        believes only a publisher that holds the controller's secret key. None: plaintext."""
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            serve_curve(self.socket, *curve)
        self.socket.bind(addresses.zmq_bind(listen, "controller.gateway_listen"))
        self.last_body: dict | None = None
        # A new epoch for each controller start: a gateway takes the first snapshot of a new epoch whatever
        # its version (the new controller's clock may be behind), and within an epoch only newer versions.
        self.epoch = os.urandom(8).hex()
        self.version = 0
        self.encoded = b""  # the last snapshot as sent: a repeat sends these bytes again
        self.sent_at = 0.0
        self.leading_sent_at = 0.0

    def forget(self) -> None:
        """Take the next snapshot as new, whatever it holds: it is sent at a higher version (a new term)."""
        self.last_body, self.encoded = None, b""

    def repeat(self) -> None:
        """Send the last snapshot again, the same bytes, if it is REPEAT seconds old (the body unchanged)."""
        if self.last_body is not None:
            self.publish(self.last_body)

    def publish(self, body: dict) -> None:
        """Send BODY if it changed, or if the last send is REPEAT seconds old."""
        now = time.monotonic()
        if body == self.last_body and now - self.sent_at < REPEAT:
            return
        if body != self.last_body:
            self.version = max(self.version + 1, int(time.time() * 1000))
            self.last_body = body
            self.encoded = gateways.encode("snapshot", epoch=self.epoch, version=self.version, **body)
        self.socket.send_multipart([gateways.SNAPSHOT, self.encoded])
        self.sent_at = now

    def publish_leading(self, demand_port: int | None, accountant_port: int | None,
                        accountant_ports: list[int] | None = None) -> None:
        """Say that this controller leads, where its demand and accountant sockets are, and nothing of replicas:
        at once, then every REPEAT seconds while the caller asks (a new leader, until it knows its nodes)."""
        now = time.monotonic()
        if now - self.leading_sent_at < REPEAT:
            return
        self.socket.send_multipart([gateways.LEADING, gateways.encode("leading", epoch=self.epoch,
                                                                      demand_port=demand_port,
                                                                      accountant_port=accountant_port,
                                                                      **_parts(accountant_ports))])
        self.leading_sent_at = now

    def publish_encoded(self, topic: bytes, message: bytes) -> None:
        """Send MESSAGE, encoded already under this publisher's epoch (KeyPusher's), on TOPIC."""
        self.socket.send_multipart([topic, message])

    def close(self) -> None:
        self.socket.close(0)


class DemandInbox:
    """The controller's PULL for what gateway workers say they want (`demand`) and use (`used`)."""

    def __init__(self, context: zmq.Context, listen: str, curve: tuple | None = None):
        self.socket = context.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            serve_curve(self.socket, *curve)
        self.socket.bind(addresses.zmq_bind(listen, "controller.demand_listen"))
        self.port = addresses.bound_port(self.socket.last_endpoint)
        self.dropped = 0  # notes that could not be read, for llmgw_gateway_messages_dropped_total

    def drain(self, note) -> None:
        """NOTE(model) for each note waiting now; what cannot be read is logged and counted."""
        while self.socket.poll(0):
            try:
                message = gateways.decode(self.socket.recv())
            except gateways.ProtocolError as e:
                self.dropped += 1
                log.warning("dropped a note from a gateway that cannot be read: %s", e)
                continue
            note(message["model"])

    def collect(self):
        """prometheus-client's collector interface."""
        family = CounterMetricFamily("llmgw_gateway_messages_dropped", "Notes from gateways that could not be "
                                     "read (malformed, or of a protocol version this controller does not know).")
        family.add_metric([], self.dropped)
        yield family

    def close(self) -> None:
        self.socket.close(0)


class KeyPusher:
    """What gateways need of the keys, and when: at once when the store's key revision changes (revoking a key,
    or any change to a person, such as suspending them, takes effect within `KEYS_CHECK` seconds and a message
    in every gateway holding the set it changes), what changed (`key_changes`, llmgw/wire/keychanges.py), then
    the whole set; and the whole set every `KEYS_REPEAT` seconds (longer where it is large: `KEYS_REPEAT_COST`),
    so a gateway that missed a change heals. A gateway's own read at its start takes changes at once (llmgw/gateway/keytable.py's
    HeldKeys). It looks in a thread of its own, which also encodes (the store's answer may be slow, a million
    keys take seconds to read and encode, and four looks a second through the scheduler cost more than the
    looks); the loop that owns the socket `take`s what is ready, encoded under EPOCH, the publisher's.

    A change whose writer named what it changed (`store.key_log`) is read alone, and the set this controller
    holds is brought up to date from it: what it costs grows with the change, not the keys (reading every key
    to send one revocation took 9.7 s at 100,000). The whole set is read at the start, when a change names
    nothing (a change to the tree or the prices, a writer of the version before), and every
    `KEYS_WHOLE_EVERY` seconds; after changes read alone it is encoded from what is held, at the next look
    without a change, or a repeat's time after the last while changes keep coming, never more often than
    `KEYS_REPEAT_COST` allows."""

    def __init__(self, engine, epoch: str):
        self.engine = engine
        self.epoch = epoch
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="keys", daemon=True)
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        self.revision: int | None = None
        self.seen: dict | None = None  # the view (keychanges.view) of the set last sent
        self.whole = b""  # the set last sent, encoded: a repeat sends it again as it was
        self.stale = False  # `whole` is older than the changes sent since
        self.follow = False  # changes were sent that the whole set has not followed yet
        self.made_s = 0.0  # what the whole set last took to encode
        self.read_whole_at = 0.0  # when the whole set was last read
        self.sent_at = 0.0
        # One connection kept for the look at the revision: checking one out of the pool for each look
        # cost five times the query (0.75 ms of CPU against 0.14, four times a second).
        self.conn = None

    def _current_revision(self) -> int:
        try:
            if self.conn is None:
                self.conn = self.engine.connect()
            revision = store.read_revision(self.conn, "keys")
            self.conn.rollback()  # end the read, so the next look sees what was written since
            return revision
        except Exception:
            # A lost database connection: the next look opens a new one.
            if self.conn is not None:
                self.conn.invalidate()
                self.conn = None
            raise

    def check(self) -> None:
        now = time.monotonic()
        moved = self._current_revision() != self.revision
        whole_due = self.seen is None or now - self.read_whole_at >= KEYS_WHOLE_EVERY
        if moved and not whole_due and self._read_alone(now):
            return
        if moved or whole_due:
            self._read_whole(now)
        elif self._whole_due(now, self.follow):
            self._send_whole(now)

    def _read_alone(self, now: float) -> bool:
        """Send what changed past the revision sent, read alone; False where it must be read whole."""
        assert self.seen is not None and self.revision is not None
        try:
            changed = keys.changed_since(self.engine, self.revision)
            if changed is None:
                return False
            changes = keychanges.advance(self.seen, changed)
            self._changes(changes, changed["revision"])
        except Exception:
            self.seen = None  # what it holds may be half changed: the next look reads the set whole
            raise
        self.revision, self.stale = changed["revision"], True
        # The whole set follows, made from what is held: at the next look without a change, once making it
        # again keeps within a tenth of this thread's time (gateways of the version before take no changes, and
        # wait for it; one of this version drops it unread), and at its repeat while changes keep coming.
        self.follow = True
        if self._whole_due(now, following=False):
            self._send_whole(now)
        return True

    def _read_whole(self, now: float) -> None:
        key_set = keys.key_set(self.engine)
        seen = keychanges.view(key_set)
        if self.seen is not None:
            changes = keychanges.difference(self.seen, seen)
            if changes and key_set["revision"] == self.revision:
                # What the changes read alone missed (a writer named less than it changed). Gateways take no
                # changes at the revision they hold, so the revision is moved, naming everything, and the
                # next look sends the difference from what they hold.
                log.warning("the key set read whole differs from what the changes read alone made of it, in %s: "
                            "a writer named less than it changed; sending the difference", ", ".join(sorted(changes)))
                with store.writing(self.engine) as conn:
                    store.bump_revision(conn, "keys")
                self.read_whole_at = 0.0
                return
            if changes:
                self._changes(changes, key_set["revision"])
        began = time.monotonic()
        self.whole = gateways.encode("keys", epoch=self.epoch, **key_set)
        self.made_s = time.monotonic() - began
        self.ready.put((gateways.KEYS, self.whole))
        self.revision, self.seen, self.stale, self.follow = key_set["revision"], seen, False, False
        self.sent_at = self.read_whole_at = now

    def _whole_due(self, now: float, following: bool) -> bool:
        """Whether the whole set is to be sent now: at its repeat, every KEYS_REPEAT seconds, or FOLLOWING changes
        sent since; either no sooner than KEYS_REPEAT_COST times its last encoding after the last."""
        since, least = now - self.sent_at, KEYS_REPEAT_COST * self.made_s
        return since >= max(gateways.KEYS_REPEAT, least) or (following and since >= least)

    def _send_whole(self, now: float) -> None:
        if self.stale:  # changes read alone since the set was encoded: made from what is held
            assert self.seen is not None and self.revision is not None
            began = time.monotonic()
            self.whole = gateways.encode("keys", epoch=self.epoch, **keychanges.message_of(self.seen, self.revision))
            self.made_s, self.stale = time.monotonic() - began, False
        self.ready.put((gateways.KEYS, self.whole))
        self.sent_at, self.follow = now, False

    def _changes(self, changes: dict, revision: int) -> None:
        self.ready.put((gateways.KEY_CHANGES, gateways.encode(
            "key_changes", epoch=self.epoch, base=self.revision, revision=revision, **changes)))

    def start(self) -> "KeyPusher":
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stopping.wait(KEYS_CHECK):
            try:
                self.check()
            except Exception as e:  # the store away: gateways keep the keys they have, and this tries again
                log.warning("could not read the keys to push to gateways (%s); trying again", e)

    def close(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def take(self) -> list[tuple[bytes, bytes]]:
        """The messages ready to send, in order: (topic, encoded message)."""
        out = []
        while True:
            try:
                out.append(self.ready.get_nowait())
            except queue.Empty:
                return out
