"""The controller's view of its nodes: what each said about itself, when it was last heard, its state.

A node is `ready` while it heartbeats, `cordoned` when an operator said to
place nothing new on it, `draining` when its replicas are being moved off, `unreachable` after `unreachable_after` seconds of
silence (nothing is placed there) and `lost` after `lost_after` (its work is
replaced elsewhere). States are computed from the clock when asked, never
stored, so a silent node needs no timer to age. A lost node that speaks again
must register again, so the controller learns what it still runs.

A controller that has just started knows only the nodes that have registered
since: it is `settling` until every node it expects (those with issued keys)
has, and at most `unreachable_after`, the silence after which a node it did
know would count as unreachable anyway. Thread-safe: the agent loop writes and
the admin API reads.

What a node said about itself reaches placement, metrics and the admin API as
typed facts (`NodeFacts`, `Gpu`), built in one place (`node_facts`) from its
registration and the latest of each heartbeat field since: the latest heartbeat
wins, so a GPU that fails after registration is seen failed. A figure the node
never sent is None, never a default.
"""

from __future__ import annotations

import dataclasses
import re
import threading

READY, CORDONED, DRAINING, UNREACHABLE, LOST = "ready", "cordoned", "draining", "unreachable", "lost"
STATES = (READY, CORDONED, DRAINING, UNREACHABLE, LOST)
# The one `health` value the agent's discovery writes for a card that works (llmgw/node/discovery.py).
HEALTHY = "ok"
MOST_GPUS = 1024  # a node's cards, as the wire bounds them
# A heartbeat's envelope, not something the node says about itself.
_ENVELOPE = ("v", "type", "node_id", "seq")
# The heartbeat fields that change a node's typed facts; the rest are read from its status when asked.
_TYPED = ("gpus", "engines")


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU as its node last reported it; None where the node has not said."""
    index: int
    gpu_class: str | None  # `class` on the wire, such as `h100-80g`
    name: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    utilization_percent: float | None
    health: str | None
    # Topology (llmgw/node/gputopology.py): NVLink links to each peer, distance (PIX..SYS) to each fabric
    # adapter, NUMA node, and the multi-node NVLink domain the card has joined ("" or None: none).
    nvlink: dict[int, int] = dataclasses.field(default_factory=dict)
    nic_paths: dict[str, str] = dataclasses.field(default_factory=dict)
    numa_node: int | None = None
    nvlink_domain: str | None = None

    @property
    def healthy(self) -> bool:
        """Only a card last reported healthy counts as one: an unknown health is not a good one."""
        return self.health == HEALTHY


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    """What a node has said about itself, the newest word on each; None where it has not said.

    The figures every heartbeat changes (memory, disk, load) are read from the node's latest status
    when asked, so a heartbeat that changes only those needs no new NodeFacts: rebuilding them for
    every node at every reconcile pass made a pass several times slower."""
    registration: dict  # the registration, as the node sent it (the admin API shows it as is)
    status: dict  # the latest of each heartbeat field, as sent (GPUs merged by index); the node's own
    labels: dict | None
    engines: dict | None  # engine -> version; None until the node has said which engines it runs
    gpus: tuple[Gpu, ...] | None  # None when the GPU probe failed or was never run
    cpu_count: int | None

    @property
    def installable(self) -> dict:
        """Engine -> version the node's catalogue can install there (empty where it has none, or an old agent)."""
        return self.registration.get("installable") or {}

    def install(self, engine: str) -> dict | None:
        """The node's latest word on installing ENGINE's catalogue version (llmgw/node/installer.py), if any."""
        version = self.installable.get(engine)
        installs = self.status.get("installs", self.registration.get("installs")) or {}
        return installs.get(f"{engine}/{version}") if version else None

    def _latest(self, field: str, key: str):
        """FIELD's KEY from the latest heartbeat that said it, else from the registration."""
        value = self.status.get(field, {}).get(key)
        return self.registration.get(field, {}).get(key) if value is None else value

    @property
    def memory_total_bytes(self) -> int | None:
        return self._latest("memory", "total_bytes")

    @property
    def memory_available_bytes(self) -> int | None:
        return self._latest("memory", "available_bytes")

    @property
    def disk_total_bytes(self) -> int | None:
        return self._latest("disk", "total_bytes")

    @property
    def disk_free_bytes(self) -> int | None:
        return self._latest("disk", "free_bytes")

    @property
    def load1(self) -> float | None:
        return self.status.get("load", {}).get("load1")

    @property
    def cpu_percent(self) -> float | None:
        return self.status.get("load", {}).get("cpu_percent")

    @property
    def fabrics(self) -> list[dict]:
        """The fabrics the node may run a multi-node replica's collectives on, as it last said (each
        `name`, `physical`, `adapters`, `rate_gbps`, and `degraded` where a port trained down); none for a
        node that declares none or whose ports are all down."""
        return self.status.get("fabrics", self.registration.get("fabrics")) or []

    @property
    def ib_ports(self) -> list[dict]:
        return self.status.get("ib_ports", self.registration.get("ib_ports")) or []

    @property
    def shard_loads(self) -> list[dict] | None:
        """Per engine, as the agent measured it (`load.shards`)."""
        return self.status.get("load", {}).get("shards")


def _by_index(gpus: list) -> dict:
    # A GPU without an index cannot be matched to a card, nor given to an engine: it is left out.
    return {g["index"]: g for g in gpus if isinstance(g, dict) and "index" in g}


def _merge_gpus(before: list, reported: list) -> list:
    """The latest of each GPU's fields: a heartbeat's `gpus` speak for the cards they name, by index."""
    merged = _by_index(before)
    for index, gpu in _by_index(reported).items():
        merged[index] = {**merged.get(index, {}), **gpu}
    return [merged[i] for i in sorted(merged)]


def _gpu(index: int, g: dict) -> Gpu:
    # Only ASCII digits below the cards a node may have: str.isdigit() takes "²", which int() refuses.
    nvlink = {int(peer): links for peer, links in (g.get("nvlink") or {}).items()
              if re.fullmatch(r"[0-9]{1,4}", peer) and int(peer) < MOST_GPUS and int(peer) != index}
    return Gpu(index=index, gpu_class=g.get("class"), name=g.get("name"),
               memory_total_bytes=g.get("memory_total_bytes"), memory_used_bytes=g.get("memory_used_bytes"),
               utilization_percent=g.get("utilization_percent"), health=g.get("health"), nvlink=nvlink,
               nic_paths=dict(g.get("nic_paths") or {}), numa_node=g.get("numa_node"),
               nvlink_domain=g.get("nvlink_domain") or None)


def node_gpus(registration: dict, status: dict) -> tuple[Gpu, ...] | None:
    """The node's cards: the registration says which there are, heartbeats how each is doing now."""
    if registration.get("gpus") is None:
        return None
    latest = _by_index(status.get("gpus", []))
    return tuple(_gpu(index, {**reported, **latest.get(index, {})})
                 for index, reported in sorted(_by_index(registration["gpus"]).items()))


def node_facts(registration: dict, status: dict) -> NodeFacts:
    """The typed facts of a node from its REGISTRATION's fields and STATUS, the latest of each heartbeat
    field since (a heartbeat's value wins over the registration's: it is newer)."""
    if "engines" in status:
        engines = status["engines"]
    else:  # a registration's table is an answer only where the agent says it looked (old agents did not)
        engines = registration.get("engines") if registration.get("engines_probed") else None
    gpus = node_gpus(registration, status)
    return NodeFacts(registration=registration, status=status, labels=registration.get("labels"),
                     engines=engines, gpus=gpus, cpu_count=registration.get("cpu", {}).get("count"))


@dataclasses.dataclass(frozen=True)
class NodeView:
    """One node as `Fleet.describe` shows it at one moment."""
    node_id: str
    state: str
    last_heard_s: float
    registered_s: float
    facts: NodeFacts
    address: str | None = None  # where its connection comes from (None: not known)

    def to_dict(self) -> dict:
        """The admin API's JSON for the node (`llmgw ctl nodes`, the cluster page): the messages as sent."""
        return {"node_id": self.node_id, "state": self.state, "last_heard_s": self.last_heard_s,
                "registered_s": self.registered_s, "address": self.address, "facts": self.facts.registration,
                # A copy: the node's status changes under a later heartbeat, and this may be written out then.
                "status": dict(self.facts.status)}


class FleetError(Exception):
    """An operator's request about a node that cannot be done; the message says why and what to do."""


@dataclasses.dataclass
class Node:
    node_id: str
    facts: dict  # the registration, as the node sent it
    identity: bytes  # its ZeroMQ routing identity, to send it commands
    # The address its connection comes from, as the socket saw it: what it may speak for (its engines listen
    # there). Not the `address` it says it has, which a node whose key leaked would write as it pleased.
    peer: str | None
    registered_at: float
    last_heard: float
    status: dict = dataclasses.field(default_factory=dict)  # the latest of each heartbeat field
    cordoned: bool = False
    draining: bool = False
    # The typed facts, made when a pass first needs them after the registration, the cards or the
    # engines changed; the figures every heartbeat changes are read from STATUS as they are.
    typed: NodeFacts | None = None


class Fleet:
    def __init__(self, unreachable_after: float, lost_after: float, cordoned: set[str] | None = None,
                 started: float = 0.0, expected: set[str] | None = None):
        """STARTED is when this controller started (monotonic seconds); EXPECTED the nodes that may be
        running replicas, None when it cannot be known (plaintext: any node may connect)."""
        self.unreachable_after = unreachable_after
        self.lost_after = lost_after
        self.nodes: dict[str, Node] = {}
        self.cordoned = set(cordoned or ())
        self.started = started
        self.expected = expected
        self.lock = threading.RLock()

    def settling(self, now: float) -> bool:
        """True while nodes running replicas may still be on their way back to a controller that just
        started: until every expected node has registered, for at most `unreachable_after`."""
        if now - self.started >= self.unreachable_after:
            return False
        with self.lock:
            return self.expected is None or not self.expected <= self.nodes.keys()

    def adopting(self, now: float) -> bool:
        """True while a node may bring back replicas placed before this controller started (or came to lead):
        while it settles, and for `lost_after` after its start, past which a node silent since would count
        as lost and its replicas be replaced anyway. Later, a shard it did not place is no replica of its own
        (llmgw/control/claims.py). Ended at settling, a node a few seconds late (its agent trying the old
        leader first) had its engines stopped and loaded again elsewhere."""
        return now - self.started < self.lost_after or self.settling(now)

    def state(self, node: Node, now: float) -> str:
        silent = now - node.last_heard
        if silent > self.lost_after:
            return LOST
        if silent > self.unreachable_after:
            return UNREACHABLE
        if node.draining:
            return DRAINING
        return CORDONED if node.cordoned else READY

    def register(self, node_id: str, facts: dict, identity: bytes, now: float, peer: str | None = None) -> Node:
        """PEER: the address the registration came from."""
        with self.lock:
            node = Node(node_id, facts, identity, peer, now, now, cordoned=node_id in self.cordoned)
            previous = self.nodes.get(node_id)
            if previous is not None:
                # Its earlier heartbeats are older than this registration (a GPU they called failed may
                # be back), so they are not kept: the agent sends every field again in its next one.
                node.draining = previous.draining
            self.nodes[node_id] = node
            return node

    def heartbeat(self, node_id: str, fields: dict, identity: bytes, now: float, peer: str | None = None) -> bool:
        """Record a heartbeat; False when the node must register again: it is not known, speaks from another
        connection or address than it registered from, or was lost (while it was silent, its replicas may
        have been replaced; its registration says what it runs)."""
        with self.lock:
            node = self.nodes.get(node_id)
            if node is None or node.identity != identity or node.peer != peer or self.state(node, now) == LOST:
                return False
            node.last_heard = now
            # Heartbeats carry only what changed: absent fields keep their last value.
            for key, value in fields.items():
                if key not in _ENVELOPE:
                    node.status[key] = _merge_gpus(node.status.get("gpus", []), value) if key == "gpus" else value
                    if key in _TYPED:
                        node.typed = None
            return True

    def set_cordon(self, node_id: str, cordoned: bool) -> None:
        with self.lock:
            if node_id not in self.nodes and cordoned:
                raise FleetError(f"no node {node_id!r} has registered; `llmgw ctl nodes` lists them")
            (self.cordoned.add if cordoned else self.cordoned.discard)(node_id)
            if node_id in self.nodes:
                self.nodes[node_id].cordoned = cordoned
                if not cordoned:
                    self.nodes[node_id].draining = False

    def drain(self, node_id: str) -> None:
        """Cordon NODE_ID and move its replicas elsewhere, one at a time (the reconciler does the moving)."""
        with self.lock:
            if node_id not in self.nodes:
                raise FleetError(f"no node {node_id!r}; `llmgw ctl nodes` lists them")
            self.set_cordon(node_id, True)
            self.nodes[node_id].draining = True

    def remove(self, node_id: str, now: float) -> None:
        with self.lock:
            node = self.nodes.get(node_id)
            if node is None:
                raise FleetError(f"no node {node_id!r}; `llmgw ctl nodes` lists them")
            state = self.state(node, now)
            if state != LOST:
                raise FleetError(f"{node_id} is {state}; only a lost node (silent for {self.lost_after:.0f} s) "
                                 f"can be removed. Stop its agent first, or `llmgw ctl node remove --force "
                                 f"{node_id}` to stop its replicas and revoke its key now.")
            del self.nodes[node_id]

    def hold(self, node_id: str) -> None:
        """Place nothing new on NODE_ID while it is being removed. Only its entry is cordoned, not the
        remembered cordons: a node added again later starts uncordoned."""
        with self.lock:
            node = self.nodes.get(node_id)
            if node is not None:
                node.cordoned = True

    def begin(self, now: float, cordoned: set[str], expected: set[str] | None) -> None:
        """Start afresh at NOW, as a controller that just started (one that came to lead): no node known, and
        settling until the EXPECTED ones register; CORDONED as the store says now."""
        with self.lock:
            self.nodes.clear()
            self.cordoned = set(cordoned)
            self.expected = expected
            self.started = now

    def forget(self, node_id: str) -> bool:
        """Drop NODE_ID whatever its state (its key was revoked: it is no longer expected either); False
        when it was not known."""
        with self.lock:
            if self.expected is not None:
                self.expected.discard(node_id)
            return self.nodes.pop(node_id, None) is not None

    def describe(self, now: float) -> list[NodeView]:
        """Every node, by id: state, seconds since heard and since registered, and its facts."""
        with self.lock:
            return [self._view(n, now) for n in sorted(self.nodes.values(), key=lambda n: n.node_id)]

    def view(self, node_id: str, now: float) -> NodeView | None:
        """One node as `describe` shows it; None when it is not known."""
        with self.lock:
            node = self.nodes.get(node_id)
            return None if node is None else self._view(node, now)

    def _view(self, n: Node, now: float) -> NodeView:
        if n.typed is None:
            n.typed = node_facts(n.facts, n.status)
        return NodeView(n.node_id, self.state(n, now), round(now - n.last_heard, 1), round(now - n.registered_at, 1),
                        n.typed, n.peer)
