"""The agent's end: dial a controller, register, heartbeat, and move on when it stops answering.

A node needs no inbound port: its DEALER connects out to the controller's
ROUTER. The agent is given one or more controller addresses and tries them in
turn, waiting 1 s, then 2, 4, ... up to `reconnect_max` between rounds. A
controller that has not answered for three heartbeat intervals, that closed
the connection (it stopped or died), or where nothing listens (with more than
one address), is left for the next address at once.
With two controllers only the leader takes agents: a standby refuses with
"standby; the leader is HOST:PORT", and the agent goes to that address next
when it is one of its own, asking every second or so until one takes it. A CURVE handshake the controller refuses produces
no error on the socket (messages just queue), so a socket monitor watches for
it and the agent says what to do.
"""

from __future__ import annotations

import logging
import queue
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from llmgw import addresses
from llmgw.wire import agent as protocol

log = logging.getLogger("llmgw.controllerlink")

SILENCE_INTERVALS = 3
STANDBY = "standby; the leader is "  # how a standby controller's refusal begins (llmgw/control/agentserver.py)
COMMANDS = ("start_shard", "stop_shard", "drain_shard", "remove_weights", "logs_request", "weights_request",
            "reclaim_weights", "fabric_test", "scan_fabric", "install_engine")


FAILED_HANDSHAKE = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _dealer(context: zmq.Context, keys: dict | None, events: int) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER with this node's CURVE keys (none: plaintext), and a monitor told of EVENTS."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_secretkey = keys["secret_key"].encode()
        sock.curve_publickey = keys["public_key"].encode()
        sock.curve_serverkey = keys["controller_public_key"].encode()
    return sock, sock.get_monitor_socket(events)


def _send(sock: zmq.Socket, data: bytes) -> bool:
    """Send without waiting. A DEALER with no live connection would block a plain send for ever: the
    agent once hung so, inside its first register, after a refused handshake, and never said why.
    What cannot be sent now is said again: registration repeats, and it lists the node's shards."""
    try:
        sock.send(data, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def check_handshake(context: zmq.Context, address: str, keys: dict | None, timeout: float = 5.0) -> str:
    """Connect to the controller at ADDRESS without registering: "accepted" when the handshake
    succeeds (with CURVE: the controller knows this node's key), "refused", or "silent"."""
    sock, monitor = _dealer(context, keys, zmq.EVENT_HANDSHAKE_SUCCEEDED | FAILED_HANDSHAKE)
    try:
        sock.connect(addresses.zmq_connect(address, "agent.controllers"))
        if not monitor.poll(int(timeout * 1000)):
            return "silent"
        event = recv_monitor_message(monitor)["event"]
        return "accepted" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


class ControllerLink:
    def __init__(self, context: zmq.Context, addresses: list[str], node_id: str, keys: dict | None,
                 heartbeat_interval: float, reconnect_max: float, register, heartbeat, on_command=None,
                 outbox: queue.SimpleQueue | None = None):
        """REGISTER() and HEARTBEAT() return the fields of those messages when called; ON_COMMAND(message)
        carries out a command and returns the replies to send, as (type, fields) pairs. Anything put on
        OUTBOX, as (type, fields), is sent while registered (other threads never touch the socket)."""
        self.on_command = on_command or (lambda message: [])
        self.outbox = outbox if outbox is not None else queue.SimpleQueue()
        if not addresses:
            raise ValueError("no controller address: set agent.controllers, such as [\"controller.internal:7443\"]")
        self.context = context
        self.addresses = addresses
        self.node_id = node_id
        self.keys = keys
        self.heartbeat_interval = heartbeat_interval
        self.reconnect_max = reconnect_max
        self.make_register = register
        self.make_heartbeat = heartbeat
        self.registered_with: str | None = None
        self.refusal: str | None = None
        self.seq = 0

    def _connect(self, address: str) -> tuple[zmq.Socket, zmq.Socket]:
        sock, monitor = _dealer(self.context, self.keys,
                                FAILED_HANDSHAKE | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        sock.connect(addresses.zmq_connect(address, "agent.controllers"))
        return sock, monitor

    @staticmethod
    def _events(monitor: zmq.Socket) -> int:
        """The monitor's events since the last call, or'd together."""
        seen = 0
        while monitor.poll(0):
            seen |= recv_monitor_message(monitor)["event"]
        return seen

    def _next_index(self, index: int) -> int:
        """Where to try next: the leader a standby named, when it is one of this agent's addresses."""
        if self.refusal and self.refusal.startswith(STANDBY):
            leader = self.refusal[len(STANDBY):]
            if leader in self.addresses:
                return self.addresses.index(leader)
        return index

    def run(self, stopping) -> None:
        """Stay connected to some controller until STOPPING() is true."""
        delay = 1.0
        index = 0
        tried = 0  # addresses tried since the last working connection
        while not stopping():
            address = self.addresses[index % len(self.addresses)]
            index += 1
            tried += 1
            if self.session(address, stopping):
                delay, tried = 1.0, 0  # it was a working connection: start the backoff again
                continue
            index = self._next_index(index)
            if self.refusal and self.refusal.startswith(STANDBY):
                delay = 1.0  # a controller answered: a leader is coming, so keep asking often
            if tried % len(self.addresses) == 0:
                waited = time.monotonic() + delay
                while time.monotonic() < waited and not stopping():
                    time.sleep(0.05)
                delay = min(delay * 2, self.reconnect_max)

    def session(self, address: str, stopping) -> bool:
        """One connection to ADDRESS; True if it got registered before it ended."""
        sock, monitor = self._connect(address)
        registered = False
        self.refusal = None  # this connection's, if it is refused
        try:
            _send(sock, protocol.encode("register", **self.make_register()))
            last_heard = time.monotonic()
            next_beat = last_heard + self.heartbeat_interval
            while not stopping():
                now = time.monotonic()
                events = self._events(monitor)
                if not registered and events & FAILED_HANDSHAKE:
                    log.error("the controller at %s refused this node's key. On the controller run "
                              "`llmgw ctl node-key issue %s` and install the key file here (agent.key_file).",
                              address, self.node_id)
                    return registered
                if not registered and events & zmq.EVENT_CONNECT_RETRIED and len(self.addresses) > 1:
                    # Nothing listens there (a controller that died): the next address may lead by now.
                    log.info("nothing answers at %s; trying the next address", address)
                    return registered
                if registered and events & zmq.EVENT_DISCONNECTED:
                    log.warning("the controller at %s closed the connection; trying %s", address,
                                "the next address" if len(self.addresses) > 1 else "again")
                    return registered
                if now - last_heard > SILENCE_INTERVALS * max(self.heartbeat_interval, 1.0):
                    log.warning("no answer from the controller at %s; trying %s", address,
                                "the next address" if len(self.addresses) > 1 else "again")
                    return registered
                while registered:
                    try:
                        kind, fields = self.outbox.get_nowait()
                    except queue.Empty:
                        break
                    _send(sock, protocol.encode(kind, **fields))
                if registered and now >= next_beat:
                    self.seq += 1
                    _send(sock, protocol.encode("heartbeat", node_id=self.node_id, seq=self.seq,
                                              **self.make_heartbeat()))
                    next_beat = now + self.heartbeat_interval
                if not sock.poll(20):
                    continue
                try:
                    message = protocol.decode(sock.recv())
                except protocol.ProtocolError as e:
                    log.warning("dropped a message from the controller: %s", e)
                    continue
                last_heard = time.monotonic()
                kind = message["type"]
                if kind == "registered":
                    registered = True
                    self.registered_with = address
                    self.refusal = None
                    log.info("registered with the controller at %s as %s", address, self.node_id)
                    next_beat = time.monotonic()
                elif kind == "register_again":
                    log.info("the controller at %s asks for registration again: %s", address, message["reason"])
                    _send(sock, protocol.encode("register", **self.make_register()))
                elif kind == "refused":
                    self.refusal = message["reason"]
                    if self.refusal.startswith(STANDBY):
                        log.info("the controller at %s stands by; the leader is %s", address,
                                 self.refusal[len(STANDBY):])
                    else:
                        log.error("the controller at %s refused this node: %s", address, message["reason"])
                    return registered
                elif kind in COMMANDS:
                    for reply_kind, fields in self.on_command(message):
                        _send(sock, protocol.encode(reply_kind, **fields))
                elif kind != "heartbeat_ack":
                    # A command this agent does not forward would otherwise vanish, and the controller wait.
                    log.warning("the controller at %s sent %s, which this agent does not act on", address, kind)
            return registered
        finally:
            if self.registered_with == address:
                self.registered_with = None
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
