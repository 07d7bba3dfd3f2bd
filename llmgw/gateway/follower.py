"""A gateway worker following the controller: routing snapshots and keys arrive over ZeroMQ SUB.

A greenlet in each worker subscribes to the controller's publisher
(`gateway.controller`) and swaps each newer snapshot, and each newer key
table, in whole. Replicas and models given in the gateway's own
configuration stay in every snapshot, so router-only endpoints and
controller-placed replicas can be mixed. While the
controller is away, the worker keeps routing with the last snapshot it had:
the engines it lists are probably still serving, and the breakers take out
any that are not.

With two controllers on one store, one SUB socket dials both: only the leader
publishes, so what arrives is the leader's. A snapshot names the ports of its
controller's demand and accountant sockets; the host is the address the
snapshot came from (ZeroMQ's Peer-Address), so a gateway asks whichever
controller leads. A new leader says where those sockets are at once
(`leading`), before it knows its replicas: the worker keeps the replicas and
models it routes with and takes only the two addresses, so budgeted requests
are admitted again while the new leader waits for its nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import zmq.green as zmq

from llmgw import addresses, settings
from llmgw.gateway.snapshot import ModelSpec, ReplicaSpec, Snapshot
from llmgw.wire import gateways
from llmgw.wire.curve import ClientKeys, dial

log = logging.getLogger("llmgw.follower")


def from_controller(body: dict, base: Snapshot, host: str = "127.0.0.1") -> Snapshot:
    """The routing snapshot in BODY over BASE (the gateway's own configuration); HOST is the controller's."""
    models = dict(base.models)
    for m in body.get("models", []):
        models[m["name"]] = ModelSpec(name=m["name"], aliases=tuple(m.get("aliases") or ()),
                                      description=m.get("description") or "", max_context=m.get("max_context"),
                                      max_output=m.get("max_output"), on_demand=bool(m.get("on_demand")),
                                      stopped=bool(m.get("stopped")), loading=_loading(m.get("loading")),
                                      role=m.get("role") or "", guard=settings.guard_pairs(m.get("guard") or {}),
                                      routing_profile=m.get("routing_profile"))
    replicas = dict(base.replicas)
    for r in body.get("replicas", []):
        why = _off_node(r, host)
        if why is not None:
            log.warning("left out replica %s (%s): %s", r["id"], r["url"], why)
            continue
        replicas[r["id"]] = ReplicaSpec(id=r["id"], url=r["url"].rstrip("/"), models=tuple(r["models"]),
                                        weight=float(r.get("weight", 1.0)), api_key=r.get("api_key"),
                                        max_in_flight=r.get("max_in_flight"))
    demand = addresses.join(host, body["demand_port"]) if body.get("demand_port") else None
    accountant, parts = _accountant(body, host, base)
    return Snapshot(version=body["version"], models=models, replicas=replicas, demand=demand, accountant=accountant,
                    parts=parts, epoch=body.get("epoch"), unhealthy=frozenset(body.get("unhealthy") or ()))


def _accountant(body: dict, host: str, current: Snapshot) -> tuple[str | None, tuple[str, ...]]:
    """The accountant's address and its parts' (several, or none), as BODY from HOST says, else CURRENT's."""
    if not body.get("accountant_port"):
        return current.accountant, current.parts
    parts = tuple(addresses.join(host, port) for port in body.get("accountant_ports") or ())
    return addresses.join(host, body["accountant_port"]), parts


def _loading(row: dict | None) -> tuple[str, int | None, int | None] | None:
    return None if row is None else (row["state"], row.get("bytes_done"), row.get("bytes_total"))


def _off_node(replica: dict, host: str) -> str | None:
    """Why a gateway must not dial REPLICA (from the controller at HOST), or None. The controller checks a
    node's engines are on the node's own address as it reports them; a gateway dials nothing off it either.
    Loopback is each machine's own: a node on the controller's machine that dials it over loopback is
    reached at 127.0.0.1 only by a gateway on that machine, and any other would send prompts, with the
    engine's key, to whatever listens on that port of its own. A controller that sends no address (older
    than the check) is not followed into the unknown."""
    return _off(replica["url"], replica.get("address"), host)


@functools.lru_cache(maxsize=32768)
def _off(url: str, address: str | None, host: str) -> str | None:
    """`_off_node`'s answer, remembered: each snapshot lists every replica again, and parsing their URLs and
    addresses was most of reading one (0.3 s at 20,000 replicas)."""
    if address is None:
        return "the controller did not say its node's address (upgrade the controller first)"
    if not addresses.same_machine(addresses.url_host(url), address):
        return f"its URL is not on its node's address {address}"
    if addresses.is_loopback(address) and not addresses.is_loopback(host):
        return f"its node is on the controller's machine ({host}), which is not this one"
    return None


def _holds(held: tuple[str | None, int] | None, head: tuple[str, int] | None) -> bool:
    """Whether a snapshot beginning HEAD (epoch, version) is one the holder of HELD has, or an older one."""
    return held is not None and head is not None and held[0] == head[0] and head[1] <= held[1]


def with_leader(body: dict, current: Snapshot, host: str) -> Snapshot:
    """CURRENT with the demand and accountant addresses of a `leading` message in BODY from HOST; its models,
    replicas, epoch and version stay, so the new leader's first whole snapshot replaces it as any would."""
    demand = addresses.join(host, body["demand_port"]) if body.get("demand_port") else current.demand
    accountant, parts = _accountant(body, host, current)
    return dataclasses.replace(current, demand=demand, accountant=accountant, parts=parts)


TOPICS = (gateways.SNAPSHOT, gateways.KEYS, gateways.LEADING, gateways.KEY_CHANGES)


def subscribe(controllers: list[str], keys: ClientKeys | None, context=None) -> zmq.Socket:
    """A SUB socket dialled to every controller of CONTROLLERS for every topic a gateway takes, with KEYS (see
    `follow`). A worker makes it before it reads the keys from the store at its start, so what is published
    meanwhile waits in it: subscribed after that read (8 s at a million keys), a worker missed the changes made
    during it, and took changes again only after the next whole set, 70 s later."""
    context = context or zmq.Context.instance()
    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    dial(sock, keys)
    for topic in TOPICS:
        sock.setsockopt(zmq.SUBSCRIBE, topic)
    for address in controllers:
        sock.connect(addresses.zmq_connect(address, "gateway.controller"))
    return sock


def follow(controllers: list[str], keys: ClientKeys | None, on_snapshot, on_keys, on_leading, context=None,
           dropped=None, on_key_changes=None, keys_held=None, snapshot_held=None, subscribed=None,
           caught_up=None) -> None:
    """Run forever: ON_SNAPSHOT(message, host), ON_KEYS(message), ON_KEY_CHANGES(message) and
    ON_LEADING(message, host) for each message a controller of CONTROLLERS publishes, checked against its schema;
    HOST is the address it came from. With KEYS, only a publisher holding the controller's secret key is
    heard. CONTEXT: a worker's green one by default; the master passes a plain one for its thread. DROPPED, a
    counter, counts what cannot be read. KEYS_HELD(revision) says whether a whole set at that revision (None
    where its first bytes do not say) is dropped unread (llmgw/gateway/keytable.py's `HeldKeys.holds`).
    SNAPSHOT_HELD() is the epoch and version of the snapshot held: a snapshot of that epoch and no later
    version, which the holder would ignore once read, is dropped unread. SUBSCRIBED: a socket `subscribe`
    made earlier, read from here (and closed at the end) instead of a new one; CAUGHT_UP() is called once what
    it held when this began has been read."""
    sock = subscribed if subscribed is not None else subscribe(controllers, keys, context)
    try:
        while True:
            if caught_up is not None and not sock.poll(0):
                caught_up()
                caught_up = None
            frames = sock.recv_multipart(copy=False)
            topic = frames[0].bytes
            if len(frames) != 2 or topic not in TOPICS:
                log.warning("ignored a message from the controller with %d frames and topic %r", len(frames),
                            topic[:20])
                if dropped is not None:
                    dropped.inc()
                continue
            if topic == gateways.KEYS and keys_held is not None \
                    and keys_held(gateways.keys_revision(frames[1].buffer)):
                continue
            if topic == gateways.SNAPSHOT and snapshot_held is not None \
                    and _holds(snapshot_held(), gateways.snapshot_version(frames[1].buffer)):
                continue
            try:
                message = gateways.decode(frames[1].bytes)
            except gateways.ProtocolError as e:
                log.warning("ignored a message from the controller that cannot be read: %s", e)
                if dropped is not None:
                    dropped.inc()
                continue
            if topic == gateways.SNAPSHOT:
                on_snapshot(message, frames[1].get("Peer-Address"))
            elif topic == gateways.LEADING:
                on_leading(message, frames[1].get("Peer-Address"))
            elif topic == gateways.KEY_CHANGES:
                if on_key_changes is not None:
                    on_key_changes(message)
            else:
                on_keys(message)
    finally:
        sock.close(0)
