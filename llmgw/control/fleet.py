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
"""

from __future__ import annotations

import dataclasses
import threading

READY, CORDONED, DRAINING, UNREACHABLE, LOST = "ready", "cordoned", "draining", "unreachable", "lost"
STATES = (READY, CORDONED, DRAINING, UNREACHABLE, LOST)


class FleetError(Exception):
    """An operator's request about a node that cannot be done; the message says why and what to do."""


@dataclasses.dataclass
class Node:
    node_id: str
    facts: dict  # the registration, as the node sent it
    identity: bytes  # its ZeroMQ routing identity, to send it commands
    registered_at: float
    last_heard: float
    status: dict = dataclasses.field(default_factory=dict)  # the latest of each heartbeat field
    cordoned: bool = False
    draining: bool = False


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

    def state(self, node: Node, now: float) -> str:
        silent = now - node.last_heard
        if silent > self.lost_after:
            return LOST
        if silent > self.unreachable_after:
            return UNREACHABLE
        if node.draining:
            return DRAINING
        return CORDONED if node.cordoned else READY

    def register(self, node_id: str, facts: dict, identity: bytes, now: float) -> Node:
        with self.lock:
            node = Node(node_id, facts, identity, now, now, cordoned=node_id in self.cordoned)
            previous = self.nodes.get(node_id)
            if previous is not None:
                node.status = previous.status
                node.draining = previous.draining
            self.nodes[node_id] = node
            return node

    def heartbeat(self, node_id: str, fields: dict, identity: bytes, now: float) -> bool:
        """Record a heartbeat; False when the node must register again: it is not known, or was lost
        (while it was silent, its replicas may have been replaced; its registration says what it runs)."""
        with self.lock:
            node = self.nodes.get(node_id)
            if node is None or node.identity != identity or self.state(node, now) == LOST:
                return False
            node.last_heard = now
            # Heartbeats carry only what changed: absent fields keep their last value.
            node.status.update((k, v) for k, v in fields.items() if k not in ("v", "type", "node_id", "seq"))
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
                                 "can be removed. Stop its agent first.")
            del self.nodes[node_id]

    def describe(self, now: float) -> list[dict]:
        """Every node as the admin API shows it: state, seconds since heard, facts, latest status."""
        with self.lock:
            nodes = sorted(self.nodes.values(), key=lambda n: n.node_id)
            return [{"node_id": n.node_id, "state": self.state(n, now), "last_heard_s": round(now - n.last_heard, 1),
                     "registered_s": round(now - n.registered_at, 1), "facts": n.facts, "status": dict(n.status)}
                    for n in nodes]
