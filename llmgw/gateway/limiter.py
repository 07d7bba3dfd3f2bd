"""A gateway worker's side of the accountant: admit before forwarding, settle after.

One DEALER socket per worker carries every request's admit (answered) and
settle (not answered), as `llmgw/wire/accounting.py` shapes them; one greenlet
reads the answers and wakes the request waiting for each. The accountant lets
only the connection that admitted a request settle it. A key that nothing limits never gets here, so it pays no
round trip.

When the accountant does not answer within `limits.accountant_timeout`:
requests and tokens a minute are let through (they protect capacity, which
the engines also protect, and an outage is short), but a request a budget
could refuse is refused with 503, since money once spent is not handed back.
Both are counted (`llmgw_accountant_unavailable_total`) so an operator is told.
"""

from __future__ import annotations

import itertools
import logging
import os

import gevent
from gevent.event import AsyncResult
from zmq import NOBLOCK, Again

from llmgw import addresses
from llmgw.wire import accounting
from llmgw.wire.accounting import ProtocolError
from llmgw.wire.curve import ClientKeys, dial

log = logging.getLogger("llmgw.limiter")


class Unavailable(Exception):
    """The accountant did not answer in time."""


class Limiter:
    def __init__(self, timeout: float, metrics=None, keys: ClientKeys | None = None):
        self.timeout = timeout
        self.keys = keys  # the accountant's server key and ours; None: plaintext
        self.metrics = metrics
        self.address: str | None = None
        self.socket = None
        self.reader: gevent.Greenlet | None = None
        self.waiting: dict[int, AsyncResult] = {}
        self.ids = itertools.count(1)

    def _connect(self, address: str) -> None:
        import zmq.green as zmq

        self.close()
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 10000)
        dial(self.socket, self.keys)
        # The accountant knows who admitted a request by this id; a chosen one (random, so nobody can guess
        # it) survives a reconnect, so what was admitted before it can still be settled after.
        self.socket.setsockopt(zmq.ROUTING_ID, b"w" + os.urandom(15))
        self.socket.connect(addresses.zmq_connect(address, "the accountant's address"))
        self.address = address
        self.reader = gevent.spawn(self._read, self.socket)

    def _read(self, sock) -> None:
        while True:
            try:
                answer = accounting.decode(sock.recv())
            except ProtocolError as e:
                log.warning("ignored an answer from the accountant that cannot be read: %s", e)
                continue
            waiter = self.waiting.pop(answer["id"], None)
            if waiter is not None:
                waiter.set(answer)

    def _send(self, address: str, op: str, **fields) -> None:
        if address != self.address:
            self._connect(address)
        try:
            self.socket.send(accounting.encode(op, **fields), flags=NOBLOCK)
        except Again:
            raise Unavailable() from None

    def ask(self, address: str | None, msg: dict) -> dict:
        """Send MSG ({"op": ..., fields but its id}) and wait for its answer; Unavailable when none comes
        in time."""
        if address is None:
            raise Unavailable()
        msg_id = next(self.ids)
        waiter = AsyncResult()
        self.waiting[msg_id] = waiter
        try:
            self._send(address, **msg, id=msg_id)
            return waiter.get(timeout=self.timeout)
        except (Unavailable, gevent.Timeout):
            if self.metrics:
                self.metrics.accountant_unavailable.inc()
            raise Unavailable() from None
        finally:
            self.waiting.pop(msg_id, None)

    def admit(self, address: str | None, levels: list, priced: bool, estimate: int, cost: int) -> dict:
        return self.ask(address, {"op": "admit", "levels": levels, "priced": priced, "tokens": estimate,
                                  "cost": cost})

    def settle(self, address: str | None, reservation: int, tokens: int, cost: int) -> None:
        if address is None:
            return
        try:
            self._send(address, "settle", r=reservation, tokens=tokens, cost=cost)
        except Unavailable:
            log.warning("could not settle a request with the accountant (%d tokens, cost %d); "
                        "it is rebuilt from usage rows when it restarts", tokens, cost)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.kill(block=False)
            self.reader = None
        if self.socket is not None:
            self.socket.close(0)
            self.socket = None
        self.address = None
