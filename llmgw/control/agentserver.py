"""The controller's end of the agents' connections: one ZeroMQ ROUTER, CURVE-authenticated.

Agents dial in (DEALER); everything travels on that one connection in both
directions. With CURVE, the ZAP handler admits only keys issued by `llmgw ctl
node-key issue`, and labels each message with the key its session was opened
with; each message is held to the node that key is issued to now, and a node
claiming another id is refused and told why. A key nobody issued fails the
handshake, which the agent sees on its socket monitor. Without a ZAP handler
CURVE admits every key, so the domain is enforced: with no handler answering,
connections fail closed.

A session stays authenticated once open: revoking or replacing a node's key
once left its agent connected and obeyed. So the key is looked up for every
message, and a message on a session whose key is no longer issued is refused
and counted; and when keys leave the ring, their nodes and replicas are
forgotten here, on the thread that handles their messages, so that none
handled a moment earlier can bring them back.

A node speaks from the address it registered from (the connection's peer, as
ZeroMQ saw it): a message from another address is answered `register_again`.
What it says of its shards is judged by llmgw/control/claims.py first (its
engines on that address, only shards this controller placed once its
adoption window is over); a shard it may not claim is refused, counted, and, when no other
node holds it, stopped, as an engine that no controller accounts for.
"""

from __future__ import annotations

import logging
import time
import uuid

import zmq
from prometheus_client.core import CounterMetricFamily

from llmgw import addresses
from llmgw.control.authenticator import AGENTS, KeyRing, serve_curve
from llmgw.control.claims import ShardClaims
from llmgw.control.fleet import Fleet
from llmgw.wire import agent as protocol

log = logging.getLogger("llmgw.agentserver")
LOGGED_A_MINUTE = 20  # refusals logged for one node in a minute; the rest are counted


class AgentServer:
    def __init__(self, context: zmq.Context, listen: str, fleet: Fleet, ring: KeyRing | None,
                 keypair: tuple[bytes, bytes] | None, heartbeat_interval: float = 5.0, replicas=None, lease=None,
                 models=dict):
        """RING is None only in plaintext mode; then no key is asked for. The controller's `Authenticator`
        must be running on CONTEXT with RING as its agents' domain. LEASE (llmgw/control/lease.py) says
        whether this controller leads; None: it always does. MODELS: the catalog's models now."""
        self.fleet = fleet
        self.lease = lease
        # The lease term whose start the control loop has made (`ControlLoop.leading`): agents are taken only
        # within it. The lease is taken in another thread; a registration taken between that and the term's
        # start was judged against the fleet of the standby (its adoption window long over), and the node told
        # to stop the replica it brought back, which was then placed anew under the gateways routing to it.
        self.term: int | None = None
        self.replicas = replicas
        self.claims = ShardClaims(fleet, replicas, models) if replicas is not None else None
        self.waiting: dict[str, dict] = {}  # request_id -> {"event", "reply", "node"}, for replies someone waits on
        self.ring = ring
        self.keys_seen = ring.keys if ring is not None else None  # the ring as of the last look for revocations
        self.heartbeat_interval = heartbeat_interval
        self.refused: dict[str, int] = {}  # why -> messages dropped or refused, for llmgw_agent_messages_refused_total
        self.told: dict[str, list] = {}  # node -> [minute it began, lines logged in it, refusals not logged]
        self.context_warned: set[str] = set()  # shards whose short context was logged
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting agent may reuse its identity
        if ring is not None:
            serve_curve(self.socket, keypair, AGENTS)
        self.socket.bind(addresses.zmq_bind(listen, "controller.agent_listen"))

    def close(self) -> None:
        self.socket.close(0)

    def send(self, identity: bytes, kind: str, **fields) -> None:
        try:
            self.socket.send_multipart([identity, protocol.encode(kind, **fields)], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("could not send %s: the agent's queue is full", kind)

    def poll(self, timeout_ms: int) -> None:
        """Handle whatever arrives within TIMEOUT_MS."""
        self.forget_revoked()
        if not self.socket.poll(timeout_ms):
            return
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue
            identity = frames[0].bytes
            key = frames[1].get("User-Id") if self.ring is not None else None
            self.handle(identity, key, frames[1].bytes, frames[1].get("Peer-Address"))

    def forget_revoked(self) -> None:
        """Forget the nodes whose keys left the ring since the last look (revoked, or replaced by a new
        one), with their replicas: their sessions are refused from now on."""
        if self.ring is None or self.ring.keys is self.keys_seen:
            return
        keys, self.keys_seen = self.keys_seen, self.ring.keys
        for node_id in sorted({name for key, name in keys.items() if key not in self.keys_seen}):
            known = self.fleet.forget(node_id)
            gone = self.replicas.forget_node(node_id) if self.replicas is not None else []
            if known or gone:
                log.warning("node %s: its key was revoked or replaced; its session is refused, and it is "
                            "forgotten with its replicas (%s)", node_id, ", ".join(gone) or "none")

    def handle(self, identity: bytes, key: str | None, payload: bytes, peer: str | None = None) -> None:
        """Act on one message; KEY is the z85 public key its session was opened with (None: plaintext), PEER
        the address it came from."""
        authenticated = self.ring.node_for(key.encode()) if key is not None else None
        if key is not None and authenticated is None:
            self._count("revoked")
            self.send(identity, "refused", reason="this node's key was revoked or replaced. On the controller, "
                                                  "`llmgw ctl node-key issue NODE` makes a new one; install it "
                                                  "as agent.key_file and restart the agent.")
            return
        if self.lease is not None and not (self.lease.held() and self.lease.term == self.term):
            # Commands travel on the connection an agent opened, so a standby holding one would leave the
            # leader unable to reach that node: it sends the agent on to the next address it has.
            self._count("standby")
            self.send(identity, "refused", reason=f"standby; the leader is {self.lease.leader or 'not known yet'}")
            return
        try:
            message = protocol.decode(payload)
        except protocol.ProtocolError as e:
            log.warning("dropped a message from %s that cannot be read: %s", authenticated or "a node", e)
            self._count("malformed")
            return
        node_id = message.get("node_id")
        if authenticated is not None and node_id != authenticated:
            # The key is genuine but belongs to another node: never let one node speak for another.
            log.warning("refused %s from a node whose key was issued to %r", message["type"], authenticated)
            self._count("other_node")
            self.send(identity, "refused", reason=f"this node's key was issued to {authenticated!r}, not {node_id!r}. "
                                                  f"Set agent.node_id to {authenticated!r}, or issue a key for "
                                                  f"{node_id!r} with `llmgw ctl node-key issue {node_id}`.")
            return
        now = time.monotonic()
        if message["type"] == "register":
            facts = {k: v for k, v in message.items() if k not in ("v", "type", "shards")}
            adopting = self.fleet.adopting(now)
            self.fleet.register(node_id, facts, identity, now, peer)
            shards = message.get("shards", [])  # each with its shard_id and state: llmgw/wire/agent.py checked
            if self.replicas is not None:
                # What the node runs: how a restarted controller learns its replicas, and how a restarted
                # agent's adopted engines stay in the snapshot without a gap.
                taken = [shard for shard in shards if self._may_claim(node_id, identity, shard, now, adopting)]
                for shard_id, reason in self.replicas.registered(node_id, taken, now, peer):
                    self._refuse_if(node_id, shard_id, reason)
            log.info("node %s registered from %s (agent %s, %d shards running)", node_id, peer,
                     message["agent_version"], len(shards))
            self.send(identity, "registered", node_id=node_id, heartbeat_interval=self.heartbeat_interval)
        elif message["type"] == "heartbeat":
            if self.fleet.heartbeat(node_id, message, identity, now, peer):
                self.send(identity, "heartbeat_ack", seq=message["seq"])
                if message.get("fabrics_changed"):
                    # Placement reads the new list from the node's status; the operator reads why here.
                    usable = ", ".join(f"{f['name']} ({', '.join(f.get('adapters', []))})"
                                       for f in message.get("fabrics", [])) or "none"
                    log.info("node %s's usable fabrics are now: %s", node_id, usable)
            else:
                self.send(identity, "register_again", reason="this controller does not know the node (it restarted), "
                                                             "lost it, or heard it from another address: say again "
                                                             "what runs there")
        elif message["type"] == "shard_status":
            if self.replicas is not None and self.fleet.heartbeat(node_id, {}, identity, now, peer) and \
                    self._may_claim(node_id, identity, message, now, self.fleet.adopting(now)):
                refused = self.replicas.report(node_id, message, now, address=peer)
                self._refuse_if(node_id, message["shard_id"], refused)
                if refused is None and message["state"] == "ready":
                    self._check_context(message)
        elif message["type"] in ("ack", "logs_reply", "weights_reply", "fabric_test_reply", "scan_fabric_reply"):
            waiter = self.waiting.get(message["request_id"])
            if waiter is not None and waiter.get("node", node_id) != node_id:
                self._refuse_if(node_id, message["request_id"], f"request {message['request_id']} went to "
                                                                 f"{waiter['node']}, not to {node_id}")
            elif waiter is not None:
                waiter["reply"] = message
                waiter["event"].set()
            elif message["type"] == "ack" and not message["ok"]:
                log.warning("node %s could not carry out a command: %s", node_id, message.get("error"))
        else:
            log.warning("dropped a %s message: agents do not send those", message["type"])

    def _may_claim(self, node_id: str, identity: bytes, shard: dict, now: float, adopting: bool) -> bool:
        """Whether NODE_ID may say SHARD (llmgw/control/claims.py); when not, it is refused, counted, and an
        engine of a shard no other node holds is stopped: no controller accounts for it."""
        reason = self.claims.judge(node_id, shard, now, adopting)
        if reason is None:
            return True
        self._refuse_if(node_id, shard["shard_id"], reason)
        if not self.replicas.knows(shard["shard_id"]) and shard["state"] not in ("stopped", "failed"):
            self.send(identity, "stop_shard", request_id=uuid.uuid4().hex, shard_id=shard["shard_id"])
        return False

    def _check_context(self, shard: dict) -> None:
        """Say when a replica serves less context than its catalog entry asks: requests are then held to the
        engine's figure (publisher.snapshot_body), and the operator should know why."""
        model = self.claims.models().get(shard.get("model"))
        context = shard.get("context")
        if shard["shard_id"] in self.context_warned:
            return
        if len(self.context_warned) > 10_000:  # shards come and go; this only keeps a line from repeating
            self.context_warned.clear()
        if model is not None and model.max_context and context is not None and context < model.max_context:
            self.context_warned.add(shard["shard_id"])
            log.warning("replica %s of %s serves %d tokens a request, not the %d its max_context asks (llama.cpp "
                        "caps a slot at what the model was trained on); requests are held to %d",
                        shard["shard_id"], model.name, context, model.max_context, context)

    def _refuse_if(self, node_id: str, about: str, reason: str | None) -> None:
        """Log and count a claim NODE_ID may not make (REASON None: it was accepted). At most LOGGED_A_MINUTE
        lines a node a minute, the rest counted into the next: a node whose key leaked once wrote 17 MB of
        log a second by listing a thousand refused shards in each registration."""
        if reason is None:
            return
        self._count("not_its_own")
        now = time.monotonic()
        told = self.told.get(node_id)
        if told is None or now - told[0] >= 60:
            told = self.told[node_id] = [now, 0, told[2] if told else 0]
        if told[1] >= LOGGED_A_MINUTE:
            told[2] += 1
            return
        told[1] += 1
        more = f" ({told[2]} more refused before this, not logged)" if told[2] else ""
        told[2] = 0
        log.warning("refused what node %s said about %s: %s%s", node_id, about[:200], reason, more)

    def _count(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1

    def collect(self):
        """prometheus-client's collector interface: what agents said that was dropped or refused, by why."""
        family = CounterMetricFamily("llmgw_agent_messages_refused", "Messages from agents dropped (malformed) or "
                                     "refused (about another node's shard or request, as another node, on a "
                                     "session whose key was revoked, or by a standby controller).", labels=["why"])
        for why in ("malformed", "other_node", "not_its_own", "revoked", "standby"):
            family.add_metric([why], self.refused.get(why, 0))
        yield family
