"""The accountant on the wire: one thread, one ZeroMQ ROUTER, every gateway worker a DEALER.

One thread owns the `Accountant`, so every admit and settle is applied in the
order it arrives and no lock is needed: two workers asking for the last slot
of a limit are answered one after the other. The messages (admit, settle,
status and their answers) are in `llmgw/wire/accounting.py` and
`docs/protocol.md`.

Whoever reaches the socket can write anything to it, so nothing a peer sends
can stop the thread: a frame that is not a message of the schema, or a settle
the accountant refuses (another gateway's reservation, one already settled),
is dropped, logged and counted (`llmgw_accountant_dropped_messages_total`),
and so is a message whose handling fails in a way nobody foresaw.

The controller runs it (`controller.accountant_listen`); a gateway without a
controller runs its own in the gunicorn master, so its workers still share one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq
from prometheus_client.core import CounterMetricFamily

from llmgw import addresses
from llmgw.control.accountant import Accountant, Refused
from llmgw.control.authenticator import serve_curve
from llmgw.wire import accounting
from llmgw.wire.accounting import ProtocolError

log = logging.getLogger("llmgw.accountserver")

SWEEP_EVERY = 60.0
LOG_EVERY = 10.0  # seconds between log lines about dropped messages of one kind, so a flood cannot fill a disk
DROPPED = ("malformed", "settle", "error", "standby")  # why a message was dropped: the counter's labels


class Dropped(Exception):
    """A message the accountant does not act on; WHY is one of DROPPED."""

    def __init__(self, why: str, detail: str):
        super().__init__(detail)
        self.why = why


def _status(accountant: Accountant, levels) -> dict:
    return {name: list(pair) for name, pair in accountant.status(levels).items()}


def handle(accountant: Accountant, peer: object, msg: dict) -> bytes | None:
    """The answer to MSG (decoded, so its shape is checked) from PEER, or None when it needs none."""
    op = msg["op"]
    if op == "settle":
        refusal = accountant.settle(msg["r"], msg["tokens"], msg["cost"], owner=peer, requests=msg.get("n"))
        if refusal is not None:
            raise Dropped("settle", refusal)
        return None
    if op == "admit":
        levels = msg["levels"]
        result = accountant.admit(levels, msg["priced"], msg["tokens"], msg["cost"], owner=peer,
                                  grant=msg.get("grant", 1), undo=msg.get("undo", False))
        if isinstance(result, Refused):
            return accounting.encode("refused", id=msg["id"], ok=False, limit=result.limit, counter=result.counter,
                                     retry_after=result.retry_after, message=result.message,
                                     status=_status(accountant, levels))
        return accounting.encode("admitted", id=msg["id"], ok=True, r=result.id if result.held else None,
                                 status=_status(accountant, levels), n=result.size if result.size > 1 else None)
    if op == "status":
        return accounting.encode("status_reply", id=msg["id"], status=_status(accountant, msg["levels"]))
    raise Dropped("malformed", f"{op!r} is an answer, not something the accountant is asked")


class AccountServer:
    """The accountant's thread. `start()` binds (so the port is known at once) and serves until `stop()`."""

    def __init__(self, accountant: Accountant, listen: str, context: zmq.Context | None = None,
                 curve: tuple | None = None, lease=None, fresh: Callable[[], Accountant] | None = None):
        """CONTEXT is the caller's (whose authenticator admits gateway keys); CURVE is (keypair, domain), or
        None for plaintext. With LEASE (a controller's, llmgw/control/lease.py) it answers only while the
        controller leads, and each time it comes to lead it starts from FRESH(): spend rebuilt from the store,
        as at a restart, since the reservations and windows it held are the old leader's business now."""
        self.accountant = accountant
        self.lease = lease
        self.fresh = fresh
        self.term = lease.term if lease is not None else 0
        self.own_context = context is None
        self.curve = curve is not None
        self.context = context or zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            serve_curve(self.socket, *curve)
        self.socket.bind(addresses.zmq_bind(listen, "the accountant's address", free_port=True))
        self.port = addresses.bound_port(self.socket.last_endpoint)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="accountant", daemon=True)
        self.dropped = dict.fromkeys(DROPPED, 0)  # fixed keys: a scrape reads it while the thread counts
        self.logged: dict[str, float] = {}

    def start(self) -> "AccountServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.socket.close(0)
        if self.own_context:
            self.context.destroy(linger=0)

    def _serve(self) -> None:
        sock = self.socket
        swept = time.monotonic()
        while not self.stopping.is_set():
            if sock.poll(200):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if self._standing_by():
                        self._drop("standby", "this controller does not lead; the gateway asks the leader's "
                                              "accountant once it has the leader's snapshot")
                        continue
                    self._take(frames)
            if time.monotonic() - swept > SWEEP_EVERY:
                swept = time.monotonic()
                if self.accountant.forget_stale():
                    log.info("forgot reservations never settled (their gateway went away)")

    def _standing_by(self) -> bool:
        """Whether to answer nothing, the controller not leading; a new term starts from a fresh accountant."""
        if self.lease is None:
            return False
        if not self.lease.held():
            return True
        if self.lease.term != self.term:
            if self.fresh is not None:
                try:
                    self.accountant = self.fresh()
                except Exception as e:  # the store failing as the term starts: answer nothing until it does not
                    log.warning("cannot rebuild the accountant from the store yet (%s); gateways wait meanwhile",
                                str(e).splitlines()[0])
                    return True
            self.term = self.lease.term
        return False

    def _take(self, frames: list[zmq.Frame]) -> None:
        """Act on one message and answer it; whatever it holds, the loop goes on."""
        try:
            if len(frames) != 2:
                raise Dropped("malformed", f"{len(frames) - 1} frames where a message is one")
            identity, payload = frames[0].bytes, frames[1].bytes
            # Who may settle what it admitted: the gateway its key was issued to (CURVE), and the worker's
            # DEALER within it, whose random routing id survives its reconnects.
            peer = (frames[1].get("User-Id") if self.curve else "", identity)
            try:
                msg = accounting.decode(payload)
            except ProtocolError as e:
                raise Dropped("malformed", str(e)) from None
            answer = handle(self.accountant, peer, msg)
            if answer is not None:
                self.socket.send_multipart([identity, answer])
        except Dropped as e:
            self._drop(e.why, str(e))
        except Exception as e:  # a peer must never be able to stop the accountant, whatever it found
            self._drop("error", f"handling it failed, and the accountant carries on: {type(e).__name__}: {e}",
                       traceback=True)

    def _drop(self, why: str, detail: str, traceback: bool = False) -> None:
        self.dropped[why] += 1
        now = time.monotonic()
        if now - self.logged.get(why, -LOG_EVERY) >= LOG_EVERY:
            self.logged[why] = now
            log.warning("the accountant dropped a message (%s, %d so far; one line every %g s at most): %s",
                        why, self.dropped[why], LOG_EVERY, detail, exc_info=traceback)

    def collect(self):
        """The dropped messages, for a Prometheus registry (`registry.register(server)`)."""
        family = CounterMetricFamily("llmgw_accountant_dropped_messages",
                                     "Messages the accountant dropped unread or refused, by why: malformed, a "
                                     "settle it refused (not the admitting gateway's, already settled, negative), "
                                     "an error handling it, or a controller standing by.", labels=["why"])
        for why in DROPPED:
            family.add_metric([why], self.dropped[why])
        yield family
