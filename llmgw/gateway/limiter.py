"""A gateway worker's side of the accountant: admit before forwarding, settle after.

One DEALER socket per worker carries every request's admit (answered) and
settle (not answered), as `llmgw/wire/accounting.py` shapes them; one greenlet
reads the answers and wakes the request waiting for each. The accountant lets
only the connection that admitted a request settle it. A key that nothing limits never gets here, so it pays no
round trip.

Most limited requests pay none either: each admit asks for an allowance of
requests like it at the same levels (`Allowance`), which the accountant grants
while the pools are far from their limits. The worker admits the next requests
at those levels from it, without asking, for `accounting.GRANT_SECONDS`, and
settles it once, with what its requests used, when it is spent or its time is
up and its last request has ended. It asks for twice as many as the last one
used (from `FIRST_GRANT` up to `LARGEST_GRANT`), so a key sending one request
a minute holds no more than it needs. Near a limit the accountant grants none
and every request is asked for, so limits hold exactly as without allowances.

An accountant split into parts (llmgw/control/accountparts.py) counts each pool in one part: a request
whose pools are in several is admitted by each in the order of the parts (`admit_split`), and when one
refuses, what the parts before it admitted is handed back (an allowance's request returned to it; a
reservation settled as not made, which the accountant was asked to allow: `undo`). No pool passes its
limit; a request another one refused at a later part held a slot meanwhile, and may have been refused
for it.

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
import time

import gevent
from gevent.event import AsyncResult
from zmq import NOBLOCK, Again

from llmgw import addresses
from llmgw.wire import accounting
from llmgw.wire.accounting import GRANT_SECONDS, LARGEST_GRANT, ProtocolError
from llmgw.wire.curve import ClientKeys, dial

log = logging.getLogger("llmgw.limiter")

FIRST_GRANT = 4  # requests: the first allowance asked for at a set of levels


class Allowance:
    """Requests, tokens and cost the accountant set aside for this worker's requests at one set of levels.

    A request admitted from it takes one request, its token estimate and its cost estimate, all of which
    must fit in what is left, so its requests together never spend more than the accountant granted. Each
    is given a ticket, (the allowance, its estimate, its cost), that `Limiter.settle` takes back."""

    __slots__ = ("address", "socket", "reservation", "size", "requests", "tokens", "cost", "until", "status",
                 "in_flight", "held_tokens", "held_cost", "used_tokens", "used_cost", "closed", "handed")

    def __init__(self, address: str, socket, reservation: int, size: int, tokens: int, cost: int,
                 until: float, status: dict):
        self.address = address  # the accountant that granted it, and the only one it is handed back to
        self.socket = socket  # the connection it was granted over: once closed, it is the accountant's to forget
        self.reservation = reservation
        self.size = size
        self.requests, self.tokens, self.cost = size, tokens, cost  # what is left
        self.until = until  # time.monotonic() past which it admits nothing more
        self.status = status  # what each request it admits is told
        self.in_flight = 0
        self.held_tokens = self.held_cost = 0  # the estimates of the requests in flight
        self.used_tokens = self.used_cost = 0  # what the requests that ended used
        self.closed = False  # admits nothing more
        self.handed = False  # settled with the accountant

    def take(self, estimate: int, cost: int, now: float) -> dict | None:
        """Admit one request of ESTIMATE tokens and COST from what is left: its answer, or None when it
        does not fit."""
        if self.closed or now >= self.until or self.requests < 1 or estimate > self.tokens or cost > self.cost:
            return None
        self.requests -= 1
        self.tokens -= estimate
        self.cost -= cost
        self.in_flight += 1
        self.held_tokens += estimate
        self.held_cost += cost
        return {"ok": True, "r": (self, estimate, cost), "status": self.status}

    def end(self, ticket: tuple, tokens: int, cost: int) -> None:
        """The request TICKET admitted used TOKENS and cost COST."""
        self._out(ticket)
        self.used_tokens += tokens
        self.used_cost += cost

    def untake(self, ticket: tuple) -> None:
        """The request TICKET admitted was refused elsewhere: what it took is left for the next."""
        estimate, held = self._out(ticket)
        self.requests += 1
        self.tokens += estimate
        self.cost += held

    def _out(self, ticket: tuple) -> tuple[int, int]:
        """TICKET's request is in flight no more; its estimate and cost."""
        _allowance, estimate, held = ticket
        self.in_flight -= 1
        self.held_tokens -= estimate
        self.held_cost -= held
        return estimate, held

    @property
    def used(self) -> int:
        return self.size - self.requests


class Unavailable(Exception):
    """The accountant did not answer in time."""


class Held:
    """What a request admitted by the parts of a split accountant settles: each part's reservation (an id, a
    ticket of an allowance, or None), with that part's address."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[tuple[str, int | tuple | None]]):
        self.parts = parts


def merged(statuses: list[dict]) -> dict:
    """The status of several parts' answers: for each kind of limit, the pool nearest to refusing, as one
    accountant says it (`Accountant.status`)."""
    out: dict = {}
    for status in statuses:
        for name, (limit, remaining) in status.items():
            if name not in out or remaining * out[name][0] < out[name][1] * limit:
                out[name] = (limit, remaining)
    return out


class Limiter:
    def __init__(self, timeout: float, metrics=None, keys: ClientKeys | None = None):
        self.timeout = timeout
        self.keys = keys  # the accountant's server key and ours; None: plaintext
        self.metrics = metrics
        self.address: str | tuple | None = None  # the accountant asked, or its parts' addresses
        self.sockets: dict[str, object] = {}  # address -> DEALER
        self.readers: dict[str, gevent.Greenlet] = {}
        self.waiting: dict[int, AsyncResult] = {}
        self.ids = itertools.count(1)
        self.allowances: dict[tuple, Allowance] = {}  # (levels, priced[, part]): the allowance requests come from
        self.closing: set[Allowance] = set()  # closed, with requests still in flight
        self.asking: set[tuple] = set()  # levels an allowance is being asked for, so that only one is
        self.sweeper: gevent.Greenlet | None = None

    def _use(self, route: str | tuple) -> None:
        """Ask ROUTE (one accountant, or a tuple of its parts' addresses) from now on: another leader's, or a
        part started again elsewhere. The connections to addresses still in it stay, with what they admitted
        (a part that was not restarted still settles its requests and allowances); what was admitted over the
        others is left to the accountant behind them, which forgets it."""
        keep = set(route) if type(route) is tuple else {route}
        for address in [a for a in self.sockets if a not in keep]:
            self._drop(address)
        self.address = route

    def _drop(self, address: str) -> None:
        """Close the connection to ADDRESS, and forget the allowances granted over it."""
        for key, allowance in list(self.allowances.items()):
            if allowance.address == address:
                allowance.closed = True
                del self.allowances[key]
        self.closing = {a for a in self.closing if a.address != address}
        reader = self.readers.pop(address, None)
        if reader is not None:
            reader.kill(block=False)
        self.sockets.pop(address).close(0)

    def _connect(self, address: str):
        import zmq.green as zmq

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10000)
        dial(sock, self.keys)
        # The accountant knows who admitted a request by this id; a chosen one (random, so nobody can guess
        # it) survives a reconnect, so what was admitted before it can still be settled after.
        sock.setsockopt(zmq.ROUTING_ID, b"w" + os.urandom(15))
        sock.connect(addresses.zmq_connect(address, "the accountant's address"))
        self.sockets[address] = sock
        self.readers[address] = gevent.spawn(self._read, sock, address)
        if self.sweeper is None:
            self.sweeper = gevent.spawn(self._sweep)
        return sock

    def _read(self, sock, address: str) -> None:
        while True:
            try:
                answer = accounting.decode(sock.recv())
            except ProtocolError as e:
                log.warning("ignored an answer from the accountant that cannot be read: %s", e)
                continue
            waiter = self.waiting.pop(answer["id"], None)
            if waiter is not None:
                waiter.set(answer)
            elif answer.get("n") and answer.get("r") is not None:
                # An allowance granted after its request stopped waiting (and was waived or refused): nothing
                # was admitted from it, and the accountant would hold it for an hour.
                self._settle(address, answer["r"], 0, 0, 0)

    def _send(self, address: str, op: str, **fields) -> None:
        sock = self.sockets.get(address) or self._connect(address)
        try:
            sock.send(accounting.encode(op, **fields), flags=NOBLOCK)
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

    def admit(self, address: str | None, key: tuple, levels: list, priced: bool, estimate: int, cost: int) -> dict:
        """Admit a request of ESTIMATE tokens and COST at LEVELS (KEY names them, with PRICED): from this
        worker's allowance when it has one that fits, else by asking the accountant, for an allowance too.
        The answer's `r` is what `settle` takes: a ticket of an allowance, a reservation's id, or None."""
        if address is None:
            raise Unavailable()
        if address != self.address:
            self._use(address)
        return self._admit(address, key, levels, priced, estimate, cost, False)

    def admit_split(self, parts: tuple[str, ...], key: tuple, split: list[tuple[int, list]], priced: bool,
                    estimate: int, cost: int, allowances: bool = True) -> dict:
        """Admit a request at the levels of each part in SPLIT ((part, levels), in the parts' order; PARTS their
        addresses), handing back what the first admitted when a later one refuses or does not answer. One
        answer, whose `r` is a `Held` and whose status is the fullest pools' of every part. ALLOWANCES False:
        asked for, never taken from one (a request asked again with its prompt counted)."""
        if parts != self.address:
            self._use(parts)
        held: list[tuple[str, int | tuple | None]] = []
        statuses = []
        last = len(split) - 1
        for i, (part, levels) in enumerate(split):
            address = parts[part]
            try:
                if allowances:
                    answer = self._admit(address, (*key, part), levels, priced, estimate, cost, i < last)
                else:
                    answer = self.ask(address, {"op": "admit", "levels": levels, "priced": priced,
                                                "tokens": estimate, "cost": cost, "undo": i < last})
            except Unavailable:
                self._undo(held)
                raise
            statuses.append(answer.get("status") or {})
            if not answer.get("ok"):
                # As within one accountant: refused for its tokens, the request did arrive, and counts in the
                # requests-a-minute pools of the parts that saw it; refused for its rate or a budget, in none.
                # `at`: the parts after it were not asked (a request asked again asks them whole).
                self._undo(held, keep_requests=answer.get("limit") == "tpm")
                return {**answer, "status": merged(statuses), "at": i}
            held.append((address, answer.get("r")))
        return {"ok": True, "r": Held(held), "status": merged(statuses)}

    def _undo(self, held: list[tuple[str, int | tuple | None]], keep_requests: bool = False) -> None:
        """Hand back what HELD admitted (but the request itself, with KEEP_REQUESTS): another part refused it."""
        for address, reservation in held:
            if type(reservation) is tuple:
                allowance = reservation[0]
                if keep_requests:
                    allowance.end(reservation, 0, 0)
                else:
                    allowance.untake(reservation)
                self._ended(allowance)
            elif reservation is not None:
                self._settle(address, reservation, 0, 0, 1 if keep_requests else 0)

    def _admit(self, address: str, key: tuple, levels: list, priced: bool, estimate: int, cost: int,
               undo: bool) -> dict:
        """`admit` at one accountant (or part); UNDO: a reservation it answers may be handed back."""
        now = time.monotonic()
        held = self.allowances.get(key)
        if held is not None:
            answer = held.take(estimate, cost, now)
            if answer is not None:
                return answer
            self._close(held)
        msg = {"op": "admit", "levels": levels, "priced": priced, "tokens": estimate, "cost": cost}
        if undo:
            msg["undo"] = True
        if key in self.asking:  # another request asks for this key's allowance: this one asks for itself
            return self.ask(address, msg)
        self.asking.add(key)
        sock = self.sockets.get(address) or self._connect(address)
        try:
            answer = self.ask(address, {**msg, "grant": _next_size(held)})
        finally:
            self.asking.discard(key)
        size = answer.get("n") or 1
        if size == 1 or not answer.get("ok"):
            return answer
        if self.sockets.get(address) is not sock:  # another request moved this worker off ADDRESS meanwhile
            return {**answer, "r": None}  # which leaves this one's allowance to be forgotten by the old one
        allowance = Allowance(address, sock, answer["r"], size, estimate * size, cost * size,
                              now + GRANT_SECONDS, answer.get("status") or {})
        previous = self.allowances.get(key)
        if previous is not None:
            self._close(previous)
        self.allowances[key] = allowance
        return allowance.take(estimate, cost, now)

    def settle(self, address: str | None, reservation: int | tuple | Held, tokens: int, cost: int) -> None:
        """A request admitted with RESERVATION is over: it used TOKENS and cost COST."""
        if type(reservation) is tuple:
            allowance = reservation[0]
            allowance.end(reservation, tokens, cost)
            self._ended(allowance)
            return
        if type(reservation) is Held:
            for part, held in reservation.parts:
                # A part started again meanwhile holds nothing of it: only the parts still asked are told.
                if held is not None and part in self.sockets:
                    self.settle(part, held, tokens, cost)
            return
        if address is None:
            return
        self._settle(address, reservation, tokens, cost)

    def _ended(self, allowance: Allowance) -> None:
        """A request of ALLOWANCE ended: a closed allowance is handed back after its last."""
        if allowance.closed and allowance.in_flight == 0:
            self.closing.discard(allowance)
            self._hand_back(allowance)

    def _settle(self, address: str, reservation: int, tokens: int, cost: int, used: int | None = None) -> None:
        try:
            self._send(address, "settle", r=reservation, tokens=tokens, cost=cost, n=used)
        except Unavailable:
            log.warning("could not settle %s with the accountant (%d tokens, cost %d); "
                        "it is rebuilt from usage rows when it restarts",
                        "a request" if used is None else f"an allowance of {used} requests", tokens, cost)

    def _close(self, allowance: Allowance) -> None:
        """Admit nothing more from ALLOWANCE; it is handed back once its last request has settled."""
        if not allowance.closed:
            allowance.closed = True
            if allowance.in_flight == 0:
                self._hand_back(allowance)
            else:
                self.closing.add(allowance)

    def _hand_back(self, allowance: Allowance) -> None:
        """Settle ALLOWANCE: what its requests used, those still in flight (a worker stopping) at their
        estimates."""
        if allowance.handed or self.sockets.get(allowance.address) is not allowance.socket:
            return
        allowance.handed = True
        self._settle(allowance.address, allowance.reservation, allowance.used_tokens + allowance.held_tokens,
                     allowance.used_cost + allowance.held_cost, allowance.used)

    def _sweep(self) -> None:
        """Close the allowances whose time is up, and forget them, so a key gone quiet holds nothing."""
        while True:
            gevent.sleep(GRANT_SECONDS)
            now = time.monotonic()
            for key, allowance in list(self.allowances.items()):
                if allowance.closed or now >= allowance.until:
                    self._close(allowance)
                    if self.allowances.get(key) is allowance:
                        del self.allowances[key]

    def stop(self) -> None:
        """Hand back every allowance, then close: the accountant would hold what they hold for an hour (it
        forgets a reservation then), and keep it from the other workers meanwhile. One question answered
        says the hand-backs before it were taken (one DEALER's messages are taken in order)."""
        held = [a for a in self.allowances.values() if not a.handed] + list(self.closing)
        for allowance in held:
            allowance.closed = True
            self._hand_back(allowance)
        for address in sorted({a.address for a in held if self.sockets.get(a.address) is a.socket}):
            try:
                self.ask(address, {"op": "status", "levels": []})
            except Unavailable:
                log.warning("the accountant at %s did not confirm the allowances handed back as this worker "
                            "stopped; what they hold is freed within the hour", address)
        self.close()

    def close(self) -> None:
        # What was granted belongs to the accountant this worker leaves: it forgets it after an hour, or
        # sooner when it is a standby that comes to lead again (llmgw/control/accountserver.py).
        for allowance in self.allowances.values():
            allowance.closed = True
        self.allowances.clear()
        self.closing.clear()
        for address in list(self.sockets):
            self._drop(address)
        if self.sweeper is not None:
            self.sweeper.kill(block=False)
            self.sweeper = None
        self.address = None


def _next_size(previous: Allowance | None) -> int:
    """How many requests to ask an allowance for: twice what the last one was used for."""
    if previous is None:
        return FIRST_GRANT
    return min(LARGEST_GRANT, max(FIRST_GRANT, 2 * previous.used))
